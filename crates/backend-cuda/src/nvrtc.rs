//! NVRTC, loaded at run time: finding the library, compiling a source to PTX
//! or CUBIN ([`Nvrtc`], the kernel compiler of the CUDA backend), and reading
//! the kernels' parameters back from the PTX.
//!
//! cudarc opens `libnvrtc.so*` by name through the dynamic loader, so it finds
//! a library on `LD_LIBRARY_PATH` or in the system paths. `ARBOR_NVRTC_LIB`
//! (a `libnvrtc.so.12` file, or the folder holding it, such as the `lib`
//! folder of PyPI's `nvidia-cuda-nvrtc-cu12` wheel) names one elsewhere: it is
//! opened by path first and kept loaded, and the loader then resolves cudarc's
//! `libnvrtc.so.12` to it by its soname. Nothing here panics when NVRTC is
//! absent: [`available`] says why, and every other function checks it first.

#![allow(unsafe_code)]

use arbor_backend_gpu::kernels::{self, KernelCompiler, Param};
use cudarc::nvrtc::{result, sys};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

/// Why a compilation failed: NVRTC's error and its log.
#[derive(Debug, thiserror::Error)]
#[error("NVRTC {stage} for {target}: {error}\n{log}")]
pub struct CompileError {
    /// What failed (create, compile, get output).
    pub stage: &'static str,
    /// The target architecture.
    pub target: String,
    /// NVRTC's error.
    pub error: String,
    /// The compiler log.
    pub log: String,
}

fn preload() -> Result<(), String> {
    let Some(p) = std::env::var_os("ARBOR_NVRTC_LIB") else {
        return Ok(());
    };
    let p = PathBuf::from(p);
    let file = if p.is_dir() {
        ["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"]
            .iter()
            .map(|n| p.join(n))
            .find(|f| f.exists())
            .ok_or_else(|| format!("ARBOR_NVRTC_LIB={}: no libnvrtc.so* in it", p.display()))?
    } else {
        p
    };
    // SAFETY: loading NVRTC runs only its initializers, which have no
    // preconditions; the handle is leaked so the library stays loaded for the
    // process (cudarc's own handle then resolves to it).
    let lib = unsafe { libloading::Library::new(&file) }
        .map_err(|e| format!("ARBOR_NVRTC_LIB={}: {e}", file.display()))?;
    std::mem::forget(lib);
    Ok(())
}

/// `Ok` when NVRTC can be loaded; otherwise why not. Checked once per process.
pub fn available() -> Result<(), String> {
    static STATE: OnceLock<Result<(), String>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            preload()?;
            // SAFETY: only tries to open the library by its candidate names.
            if unsafe { sys::is_culib_present() } {
                Ok(())
            } else {
                Err(
                    "NVRTC (libnvrtc.so.12) not found: install the CUDA toolkit or PyPI's \
                     nvidia-cuda-nvrtc-cu12 and set ARBOR_NVRTC_LIB to its lib folder \
                     (or add it to LD_LIBRARY_PATH)"
                        .to_string(),
                )
            }
        })
        .clone()
}

/// NVRTC's (major, minor) version.
pub fn version() -> Result<(i32, i32), String> {
    available()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); both pointers are valid.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("nvrtcVersion: {e:?}"))?;
    Ok((major, minor))
}

struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by create_program and destroyed only here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

fn log_of(prog: &Program) -> String {
    // SAFETY: a live program.
    match unsafe { result::get_program_log(prog.0) } {
        Ok(raw) => {
            let bytes: Vec<u8> = raw
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        Err(e) => format!("(no log: {e:?})"),
    }
}

/// Compiles `src` for `target`: `compute_XY` gives PTX text (NUL-terminated),
/// `sm_XY` a CUBIN.
pub fn compile(src: &str, target: &str) -> Result<Vec<u8>, CompileError> {
    compile_with_log(src, target, &[]).map(|(b, _)| b)
}

/// [`compile`] with extra NVRTC options (such as `--ptxas-options=-v`); also
/// returns the compiler log.
pub fn compile_with_log(
    src: &str,
    target: &str,
    extra: &[&str],
) -> Result<(Vec<u8>, String), CompileError> {
    let fail = |stage: &'static str, error: String, log: String| CompileError {
        stage,
        target: target.to_string(),
        error,
        log,
    };
    available().map_err(|e| fail("load", e, String::new()))?;
    let csrc = CString::new(src).map_err(|e| fail("create", e.to_string(), String::new()))?;
    let name = c"arbor_kernels.cu";
    let prog = Program(
        result::create_program(&csrc, Some(name))
            .map_err(|e| fail("create", format!("{e:?}"), String::new()))?,
    );
    let mut opts = vec![
        format!("--gpu-architecture={target}"),
        "--std=c++17".to_string(),
        "--fmad=true".to_string(),
    ];
    opts.extend(extra.iter().map(|o| o.to_string()));
    // SAFETY: a live program; options are plain strings.
    if let Err(e) = unsafe { result::compile_program(prog.0, &opts) } {
        return Err(fail("compile", format!("{e:?}"), log_of(&prog)));
    }
    if target.starts_with("sm_") {
        let mut size = 0usize;
        // SAFETY: a compiled program; `size` is a valid out-pointer.
        unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
            .result()
            .map_err(|e| fail("get CUBIN size", format!("{e:?}"), log_of(&prog)))?;
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` holds the `size` bytes NVRTC asked for.
        unsafe { sys::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr() as *mut std::ffi::c_char) }
            .result()
            .map_err(|e| fail("get CUBIN", format!("{e:?}"), log_of(&prog)))?;
        Ok((buf, log_of(&prog)))
    } else {
        // SAFETY: a compiled program.
        let raw = unsafe { result::get_ptx(prog.0) }
            .map_err(|e| fail("get PTX", format!("{e:?}"), log_of(&prog)))?;
        let mut bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
        if bytes.last() != Some(&0) {
            bytes.push(0);
        }
        Ok((bytes, log_of(&prog)))
    }
}

/// The PTX text of a NUL-terminated PTX image.
pub fn ptx_text(image: &[u8]) -> String {
    CStr::from_bytes_until_nul(image)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(image).into_owned())
}

/// The CUDA backend's kernel compiler: `sm_XY` gives a CUBIN, `compute_XY` PTX.
pub struct Nvrtc;

impl KernelCompiler for Nvrtc {
    fn runtime(&self) -> &'static str {
        "cuda"
    }
    fn cache_env(&self) -> &'static str {
        "ARBOR_CUDA_CACHE"
    }
    fn version(&self) -> Result<String, String> {
        version().map(|(maj, min)| format!("nvrtc {maj}.{min}"))
    }
    fn compile(&self, src: &str, target: &str) -> Result<Vec<u8>, String> {
        compile(src, target).map_err(|e| e.to_string())
    }
    /// A CUBIN is an ELF file; PTX is a NUL-terminated text with a `.version`.
    fn looks_valid(&self, b: &[u8], target: &str) -> bool {
        if target.starts_with("sm_") {
            b.starts_with(b"\x7fELF")
        } else {
            b.last() == Some(&0) && b.windows(8).any(|w| w == b".version")
        }
    }
}

/// The `.entry` kernels of a PTX text with their parameter types (`u64`, `u32`, `f32`...).
pub fn ptx_entries(ptx: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry ") {
        rest = &rest[at + ".entry ".len()..];
        let name_end = rest.find(['(', ' ', '\n']).unwrap_or(rest.len());
        let name = rest[..name_end].trim().to_string();
        let params_end = rest.find(')').unwrap_or(rest.len());
        let params = rest[..params_end]
            .split(".param")
            .skip(1)
            .filter_map(|p| p.split_whitespace().next())
            .map(|t| t.trim_start_matches('.').to_string())
            .collect();
        out.push((name, params));
        rest = &rest[params_end..];
    }
    out
}

/// Checks that every kernel is in the PTX with parameters of its signature.
pub fn check_ptx(ptx: &str) -> Result<(), String> {
    let entries: HashMap<String, Vec<Param>> = ptx_entries(ptx)
        .into_iter()
        .map(|(name, params)| {
            let params = params
                .iter()
                .map(|t| match t.as_str() {
                    "u64" | "s64" | "b64" => Param::Bits64,
                    "u32" | "s32" | "b32" => Param::Bits32,
                    "f32" => Param::F32,
                    _ => Param::Other,
                })
                .collect();
            (name, params)
        })
        .collect();
    kernels::check_signatures(&entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ptx_entries() {
        let ptx = ".visible .entry rms_norm(\n\t.param .u64 rms_norm_param_0,\n\t.param .u32 a,\n\t.param .f32 b\n)\n{ ret; }\n.visible .entry x(\n)\n";
        let e = ptx_entries(ptx);
        assert_eq!(e[0].0, "rms_norm");
        assert_eq!(e[0].1, vec!["u64", "u32", "f32"]);
        assert_eq!(e[1].0, "x");
        assert!(e[1].1.is_empty());
    }
}
