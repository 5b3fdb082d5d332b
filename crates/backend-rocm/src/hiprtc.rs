//! hiprtc, loaded at run time: compiling the shared CUDA C kernel source to
//! an AMD GPU code object for one `gfx` target ([`Hiprtc`], the ROCm
//! backend's kernel compiler).
//!
//! ROCm 6+ ships hiprtc as `libhiprtc.so.N`; ROCm 5 (Debian's 5.2 among them)
//! exports it from `libamdhip64.so.5`. Both are tried, `ARBOR_HIPRTC_LIB`
//! first. hiprtc defaults to C++14 and, without a target, asks the current
//! GPU, so every compile passes `--offload-arch` and `-std=c++17`. Its
//! `hiprtcVersion` is fixed at 9.0, so the cache key uses the HIP runtime's
//! version when it loads, else the library's path.

#![allow(unsafe_code)]

use crate::hip::Hip;
use arbor_backend_gpu::kernels::KernelCompiler;
use std::ffi::{CString, c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

type Program = *mut c_void;
type RtcResult = c_int;

/// The bound hiprtc functions.
struct Rtc {
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> RtcResult,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> RtcResult,
    code_size: unsafe extern "C" fn(Program, *mut usize) -> RtcResult,
    code: unsafe extern "C" fn(Program, *mut c_char) -> RtcResult,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> RtcResult,
    log: unsafe extern "C" fn(Program, *mut c_char) -> RtcResult,
    destroy: unsafe extern "C" fn(*mut Program) -> RtcResult,
    path: String,
    _lib: libloading::Library,
}

fn candidates() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(p) = std::env::var_os("ARBOR_HIPRTC_LIB") {
        v.push(PathBuf::from(p));
    }
    for n in [
        "libhiprtc.so",
        "libhiprtc.so.7",
        "libhiprtc.so.6",
        "libhiprtc.so.5",
        "/opt/rocm/lib/libhiprtc.so",
        "libamdhip64.so",
        "libamdhip64.so.6",
        "libamdhip64.so.5",
        "/opt/rocm/lib/libamdhip64.so",
    ] {
        v.push(PathBuf::from(n));
    }
    v
}

impl Rtc {
    fn bind(lib: libloading::Library, path: String) -> Result<Self, String> {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol has the prototype of ROCm's hiprtc.h
                // (identical in ROCm 5.x and 6.x) given by the field it fills.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{path}: no {}: {e}", $name))?
            };
        }
        Ok(Self {
            create: sym!("hiprtcCreateProgram"),
            compile: sym!("hiprtcCompileProgram"),
            code_size: sym!("hiprtcGetCodeSize"),
            code: sym!("hiprtcGetCode"),
            log_size: sym!("hiprtcGetProgramLogSize"),
            log: sym!("hiprtcGetProgramLog"),
            destroy: sym!("hiprtcDestroyProgram"),
            path: path.clone(),
            _lib: lib,
        })
    }

    fn get() -> Result<&'static Rtc, String> {
        static RTC: OnceLock<Result<Rtc, String>> = OnceLock::new();
        RTC.get_or_init(|| {
            for c in candidates() {
                // SAFETY: loading runs only the library's initializers.
                if let Ok(lib) = unsafe { libloading::Library::new(&c) } {
                    match Rtc::bind(lib, c.display().to_string()) {
                        Ok(r) => return Ok(r),
                        Err(_) => continue,
                    }
                }
            }
            Err(
                "hiprtc not found (libhiprtc.so.6/.7, or libamdhip64.so.5 of ROCm 5): \
                 install ROCm (Debian: libamdhip64-dev libhiprtc-builtins5 rocm-device-libs) \
                 or set ARBOR_HIPRTC_LIB"
                    .to_string(),
            )
        })
        .as_ref()
        .map_err(Clone::clone)
    }
}

/// `Ok` when hiprtc loads; otherwise why not.
pub fn available() -> Result<(), String> {
    Rtc::get().map(|_| ())
}

/// The library hiprtc was loaded from.
pub fn library() -> Result<String, String> {
    Rtc::get().map(|r| r.path.clone())
}

struct Prog<'a>(&'a Rtc, Program);

impl Drop for Prog<'_> {
    fn drop(&mut self) {
        // SAFETY: created by hiprtcCreateProgram, destroyed only here.
        unsafe { (self.0.destroy)(&mut self.1) };
    }
}

impl Prog<'_> {
    fn log(&self) -> String {
        let mut n = 0usize;
        // SAFETY: a live program and a valid out-pointer.
        if unsafe { (self.0.log_size)(self.1, &mut n) } != 0 || n == 0 {
            return String::new();
        }
        let mut buf = vec![0u8; n];
        // SAFETY: `buf` holds the `n` bytes hiprtc asked for.
        unsafe { (self.0.log)(self.1, buf.as_mut_ptr() as *mut c_char) };
        String::from_utf8_lossy(&buf)
            .trim_end_matches('\0')
            .to_string()
    }
}

/// Compiles `src` for `arch` (`gfx90a`, or a target id such as
/// `gfx90a:sramecc+:xnack-`) with `extra` options; returns the code object
/// and the compiler's log. Note: hiprtc of ROCm 5.2 aborts the process on an
/// architecture newer than it knows (gfx94x, gfx11xx); the device's own
/// ROCm always knows the device's.
pub fn compile_with_log(
    src: &str,
    arch: &str,
    extra: &[&str],
) -> Result<(Vec<u8>, String), String> {
    let rtc = Rtc::get()?;
    let _init = crate::hip::INIT_LOCK
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let csrc = CString::new(src).map_err(|e| e.to_string())?;
    let mut prog: Program = std::ptr::null_mut();
    // SAFETY: valid NUL-terminated strings; no headers.
    let r = unsafe {
        (rtc.create)(
            &mut prog,
            csrc.as_ptr(),
            c"arbor_kernels.cu".as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != 0 || prog.is_null() {
        return Err(format!("hiprtcCreateProgram failed ({r})"));
    }
    let prog = Prog(rtc, prog);
    let opts: Vec<CString> = [format!("--offload-arch={arch}"), "-std=c++17".into()]
        .into_iter()
        .chain(extra.iter().map(|s| s.to_string()))
        .map(|o| CString::new(o).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: a live program; `ptrs` point at live NUL-terminated options.
    let r = unsafe { (rtc.compile)(prog.1, ptrs.len() as c_int, ptrs.as_ptr()) };
    let log = prog.log();
    if r != 0 {
        return Err(format!("hiprtc compile for {arch} failed ({r}):\n{log}"));
    }
    let mut n = 0usize;
    // SAFETY: a compiled program and a valid out-pointer.
    let r = unsafe { (rtc.code_size)(prog.1, &mut n) };
    if r != 0 || n == 0 {
        return Err(format!("hiprtcGetCodeSize for {arch} failed ({r})"));
    }
    let mut code = vec![0u8; n];
    // SAFETY: `code` holds the `n` bytes hiprtc asked for.
    let r = unsafe { (rtc.code)(prog.1, code.as_mut_ptr() as *mut c_char) };
    if r != 0 {
        return Err(format!("hiprtcGetCode for {arch} failed ({r})"));
    }
    Ok((code, log))
}

/// The ROCm backend's kernel compiler.
pub struct Hiprtc;

impl KernelCompiler for Hiprtc {
    fn runtime(&self) -> &'static str {
        "rocm"
    }
    fn cache_env(&self) -> &'static str {
        "ARBOR_ROCM_CACHE"
    }
    fn version(&self) -> Result<String, String> {
        let lib = library()?;
        Ok(match Hip::get().and_then(|h| h.version()) {
            Ok(v) => format!("hip {v} ({lib})"),
            Err(_) => lib,
        })
    }
    fn compile(&self, src: &str, target: &str) -> Result<Vec<u8>, String> {
        compile_with_log(src, target, &[]).map(|(code, _)| code)
    }
    /// A code object is an ELF file.
    fn looks_valid(&self, b: &[u8], _target: &str) -> bool {
        b.starts_with(b"\x7fELF")
    }
}
