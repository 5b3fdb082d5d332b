//! NVRTC, loaded at run time: finding the library, and compiling a source to
//! PTX or CUBIN.
//!
//! cudarc opens `libnvrtc.so*` by name through the dynamic loader, so it finds
//! a library on `LD_LIBRARY_PATH` or in the system paths. `ARBOR_NVRTC_LIB`
//! (a `libnvrtc.so.12` file, or the folder holding it, such as the `lib`
//! folder of PyPI's `nvidia-cuda-nvrtc-cu12` wheel) names one elsewhere: it is
//! opened by path first and kept loaded, and the loader then resolves cudarc's
//! `libnvrtc.so.12` to it by its soname. Nothing here panics when NVRTC is
//! absent: [`available`] says why, and every other function checks it first.

#![allow(unsafe_code)]

use cudarc::nvrtc::{result, sys};
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
