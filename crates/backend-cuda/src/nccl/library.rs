//! The NCCL library, loaded at run time: finding it, resolving the few
//! functions the communicator calls, and turning NCCL's result codes into
//! errors that name the call.
//!
//! cudarc's bindings (`cudarc::nccl::sys`) give the types. Its loader looks
//! for `libnccl.so` and CUDA-versioned names, not NCCL's own soname
//! `libnccl.so.2` (the only name PyPI's `nvidia-nccl-cu12` wheel ships, and
//! what a system install without the -dev package has), so the functions are
//! resolved here from `ARBOR_NCCL_LIB` (a `libnccl.so.2` file, or the folder
//! holding it), else `libnccl.so.2`, else `libnccl.so`, through the dynamic
//! loader. Nothing panics when NCCL is absent: [`library`] says why.
//!
//! Invariant: the library stays loaded for the process (the [`Nccl`] table
//! lives in a `OnceLock`), so its function pointers never dangle.

#![allow(unsafe_code)]

use arbor_engine_core::{CoreError, Result};
use cudarc::nccl::sys;
use std::ffi::{CStr, OsString, c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

/// Oldest NCCL accepted (2.18: the functions below with these signatures,
/// and `ncclCommInitAll` over the devices of one process).
pub const MIN_VERSION: i32 = 21800;

type Code = c_int;
/// `ncclAllReduce` and `ncclReduceScatter`: (send, recv, count, type, op,
/// comm, stream).
type Reduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    sys::ncclDataType_t,
    sys::ncclRedOp_t,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> Code;

/// NCCL's functions that the communicator uses.
pub struct Nccl {
    /// Where it was loaded from.
    pub path: String,
    /// `ncclGetVersion`: major * 10000 + minor * 100 + patch.
    pub version: i32,
    error_string: unsafe extern "C" fn(Code) -> *const c_char,
    unique_id: unsafe extern "C" fn(*mut sys::ncclUniqueId) -> Code,
    pub(crate) comm_init_all:
        unsafe extern "C" fn(*mut sys::ncclComm_t, c_int, *const c_int) -> Code,
    pub(crate) comm_abort: unsafe extern "C" fn(sys::ncclComm_t) -> Code,
    pub(crate) comm_destroy: unsafe extern "C" fn(sys::ncclComm_t) -> Code,
    pub(crate) all_reduce: Reduce,
    pub(crate) all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        sys::ncclDataType_t,
        sys::ncclComm_t,
        sys::cudaStream_t,
    ) -> Code,
    pub(crate) reduce_scatter: Reduce,
    pub(crate) send: unsafe extern "C" fn(
        *const c_void,
        usize,
        sys::ncclDataType_t,
        c_int,
        sys::ncclComm_t,
        sys::cudaStream_t,
    ) -> Code,
    pub(crate) recv: unsafe extern "C" fn(
        *mut c_void,
        usize,
        sys::ncclDataType_t,
        c_int,
        sys::ncclComm_t,
        sys::cudaStream_t,
    ) -> Code,
    pub(crate) group_start: unsafe extern "C" fn() -> Code,
    pub(crate) group_end: unsafe extern "C" fn() -> Code,
    _lib: libloading::Library,
}

/// The file to open: `ARBOR_NCCL_LIB` (a file, or a folder holding
/// `libnccl.so.2` or `libnccl.so`), else the loader's names.
fn candidates(env: Option<OsString>) -> std::result::Result<Vec<PathBuf>, String> {
    let Some(p) = env else {
        return Ok(vec!["libnccl.so.2".into(), "libnccl.so".into()]);
    };
    let p = PathBuf::from(p);
    if !p.is_dir() {
        return Ok(vec![p]);
    }
    ["libnccl.so.2", "libnccl.so"]
        .iter()
        .map(|n| p.join(n))
        .find(|f| f.exists())
        .map(|f| vec![f])
        .ok_or_else(|| format!("ARBOR_NCCL_LIB={}: no libnccl.so.2 in it", p.display()))
}

/// Resolves symbol `name` of `lib` as a function of type `F`.
///
/// # Safety
/// `F` is the C signature of `name`.
unsafe fn symbol<F: Copy>(lib: &libloading::Library, name: &str) -> std::result::Result<F, String> {
    // SAFETY: the caller's contract on `F`.
    unsafe { lib.get::<F>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("{name}: {e}"))
}

impl Nccl {
    /// Loads NCCL from the first candidate that opens (see [`candidates`]).
    pub(crate) fn load(env: Option<OsString>) -> std::result::Result<Self, String> {
        let named = env.is_some();
        let mut tried = Vec::new();
        for file in candidates(env)? {
            // SAFETY: loading NCCL runs only its initializers, which have no
            // preconditions.
            match unsafe { libloading::Library::new(&file) } {
                Ok(lib) => return Self::resolve(lib, file.display().to_string()),
                Err(e) if named => {
                    return Err(format!("ARBOR_NCCL_LIB={}: {e}", file.display()));
                }
                Err(e) => tried.push(format!("{}: {e}", file.display())),
            }
        }
        Err(format!(
            "NCCL (libnccl.so.2) not found ({}): install it (PyPI nvidia-nccl-cu12, or the \
             libnccl2 package) and set ARBOR_NCCL_LIB to its lib folder or add that to \
             LD_LIBRARY_PATH",
            tried.join("; ")
        ))
    }

    fn resolve(lib: libloading::Library, path: String) -> std::result::Result<Self, String> {
        let fail = |e: String| format!("{path}: {e}");
        // SAFETY: each type below is the C signature of its symbol in nccl.h
        // (identical since NCCL 2.0 for these functions).
        unsafe {
            let get_version: unsafe extern "C" fn(*mut c_int) -> Code =
                symbol(&lib, "ncclGetVersion").map_err(fail)?;
            let mut version = 0;
            let rc = get_version(&mut version);
            if rc != 0 {
                return Err(fail(format!("ncclGetVersion returned {rc}")));
            }
            if version < MIN_VERSION {
                return Err(fail(format!(
                    "NCCL {version} is older than {MIN_VERSION} (2.18)"
                )));
            }
            Ok(Self {
                version,
                error_string: symbol(&lib, "ncclGetErrorString").map_err(fail)?,
                unique_id: symbol(&lib, "ncclGetUniqueId").map_err(fail)?,
                comm_init_all: symbol(&lib, "ncclCommInitAll").map_err(fail)?,
                comm_abort: symbol(&lib, "ncclCommAbort").map_err(fail)?,
                comm_destroy: symbol(&lib, "ncclCommDestroy").map_err(fail)?,
                all_reduce: symbol(&lib, "ncclAllReduce").map_err(fail)?,
                all_gather: symbol(&lib, "ncclAllGather").map_err(fail)?,
                reduce_scatter: symbol(&lib, "ncclReduceScatter").map_err(fail)?,
                send: symbol(&lib, "ncclSend").map_err(fail)?,
                recv: symbol(&lib, "ncclRecv").map_err(fail)?,
                group_start: symbol(&lib, "ncclGroupStart").map_err(fail)?,
                group_end: symbol(&lib, "ncclGroupEnd").map_err(fail)?,
                path,
                _lib: lib,
            })
        }
    }

    /// `Ok` for NCCL's success code; otherwise a device error naming `what`
    /// and NCCL's description of the code.
    pub fn check(&self, rc: c_int, what: &str) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let text = unsafe {
            let p = (self.error_string)(rc);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        Err(CoreError::Device(format!(
            "{what}: NCCL error {rc}: {text}"
        )))
    }

    /// A new unique id (what ranks of other processes would share to form
    /// a group); works without a device.
    pub fn unique_id(&self) -> Result<[u8; 128]> {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: a valid out-pointer.
        self.check(unsafe { (self.unique_id)(&mut id) }, "ncclGetUniqueId")?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// (major, minor, patch).
    pub fn version_parts(&self) -> (i32, i32, i32) {
        let v = self.version;
        (v / 10000, (v % 10000) / 100, v % 100)
    }
}

/// NCCL, loaded once per process; otherwise why it cannot be.
pub fn library() -> std::result::Result<&'static Nccl, String> {
    static LIB: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(|| Nccl::load(std::env::var_os("ARBOR_NCCL_LIB")))
        .as_ref()
        .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_library_that_is_not_there_is_an_error_naming_it() {
        let e = Nccl::load(Some("/nonexistent/libnccl.so.2".into()))
            .err()
            .unwrap_or_default();
        assert!(
            e.contains("ARBOR_NCCL_LIB=/nonexistent/libnccl.so.2"),
            "{e}"
        );
        let dir = std::env::temp_dir();
        let e = Nccl::load(Some(dir.clone().into()))
            .err()
            .unwrap_or_default();
        assert!(
            e.contains("no libnccl.so.2 in it") && e.contains(&dir.display().to_string()),
            "{e}"
        );
    }

    #[test]
    fn the_loader_names_come_without_the_variable() {
        let c = candidates(None).unwrap_or_default();
        assert_eq!(
            c,
            vec![PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")]
        );
    }
}
