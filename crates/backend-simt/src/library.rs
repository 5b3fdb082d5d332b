//! The kernel library: the GPU backend's kernel source (`kernels::source()`)
//! with the host emulator (`kernels::SIMT_HEADER`) and a dispatch table of
//! every kernel of `KERNELS`, compiled by the system's C++ compiler
//! (`$CXX`, else `c++`) into a shared library and loaded.
//!
//! The library is cached on disk under a hash of its source and the
//! compiler's version (`$ARBOR_SIMT_CACHE`, else the system's temporary
//! folder), written whole and renamed into place, so test processes that
//! open the emulator at once compile it at most once each and later ones
//! load it. Its one entry point, `arbor_simt_launch`, takes a kernel's name,
//! grid, block, dynamic shared memory and one 8-byte argument slot per
//! parameter (as the CUDA driver does), and runs the launch to completion
//! under a process-wide lock.

#![allow(unsafe_code)]

use arbor_backend_gpu::kernels::{self, KERNELS};
use std::ffi::{CString, c_char, c_int, c_uint, c_void};
use std::path::PathBuf;
use std::process::Command;

/// `arbor_simt_launch(name, gx, gy, gz, block, smem, args)`: 0 on success, 1
/// for an unknown kernel.
type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    *mut *mut c_void,
) -> c_int;

const DISPATCH: &str = r#"
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>

template <typename... P, size_t... I>
static std::function<void()> simt_bind_args(void (*f)(P...), void** a, std::index_sequence<I...>) {
    std::tuple<std::decay_t<P>...> vals{*reinterpret_cast<std::decay_t<P>*>(a[I])...};
    return [f, vals] { std::apply(f, vals); };
}

// The launch of `f` with the values in the argument slots `a`, copied now.
template <typename... P>
static std::function<void()> simt_bind(void (*f)(P...), void** a) {
    return simt_bind_args(f, a, std::index_sequence_for<P...>{});
}

typedef std::function<void()> (*SimtBinder)(void**);

static const std::unordered_map<std::string, SimtBinder>& simt_table() {
    static const std::unordered_map<std::string, SimtBinder> table = {
ENTRIES
    };
    return table;
}

extern "C" int arbor_simt_launch(const char* name, unsigned gx, unsigned gy, unsigned gz,
                                 unsigned block, unsigned smem, void** args) {
    static std::mutex lock;
    const auto& table = simt_table();
    const auto it = table.find(name);
    if (it == table.end()) return 1;
    std::function<void()> body = it->second(args);
    std::lock_guard<std::mutex> guard(lock);
    simt::launch(dim3{gx, gy, gz}, dim3{block, 1, 1}, 0, body, smem);
    return 0;
}
"#;

/// The whole C++ source of the library.
pub(crate) fn source() -> String {
    let entries: String = KERNELS
        .iter()
        .map(|(_, name, _)| {
            format!("        {{\"{name}\", [](void** a) {{ return simt_bind({name}, a); }}}},\n")
        })
        .collect();
    [
        kernels::SIMT_HEADER.to_string(),
        kernels::source(),
        DISPATCH.replace("ENTRIES", entries.trim_end()),
    ]
    .join("\n")
}

/// The C++ compiler and its version line, or why none runs.
pub(crate) fn compiler() -> Result<(String, String), String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = Command::new(&cxx)
        .arg("--version")
        .output()
        .map_err(|e| format!("the C++ compiler '{cxx}' does not run: {e}"))?;
    let version = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string();
    Ok((cxx, version))
}

fn fnv1a(data: &[u8], mut h: u64) -> u64 {
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// The loaded library and its entry point.
pub(crate) struct Library {
    launch: LaunchFn,
    /// Keeps the code of `launch` mapped.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("simt kernel library")
    }
}

impl Library {
    /// Compiles (or finds in the cache) and loads the library.
    pub(crate) fn open() -> Result<Self, String> {
        let (cxx, version) = compiler()?;
        let src = source();
        let hash = fnv1a(
            version.as_bytes(),
            fnv1a(src.as_bytes(), 0xcbf29ce484222325),
        );
        let dir = std::env::var_os("ARBOR_SIMT_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(format!("arbor-simt-{hash:016x}.so"));
        if !path.exists() {
            let tmp = dir.join(format!("arbor-simt-{hash:016x}.{}.tmp", std::process::id()));
            let cpp = tmp.with_extension("cpp");
            std::fs::write(&cpp, &src).map_err(|e| format!("{}: {e}", cpp.display()))?;
            let out = Command::new(&cxx)
                .args([
                    "-O1",
                    "-std=c++17",
                    "-shared",
                    "-fPIC",
                    "-ffp-contract=off",
                    "-w",
                    "-o",
                ])
                .arg(&tmp)
                .arg(&cpp)
                .output()
                .map_err(|e| format!("{cxx}: {e}"))?;
            let _ = std::fs::remove_file(&cpp);
            if !out.status.success() {
                let _ = std::fs::remove_file(&tmp);
                return Err(format!(
                    "{cxx} could not build the kernels for the emulator: {}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            std::fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        // SAFETY: the library is the one just built from our own source; its
        // initializers only build the dispatch table.
        let lib = unsafe { libloading::Library::new(&path) }
            .map_err(|e| format!("{}: {e}", path.display()))?;
        // SAFETY: `arbor_simt_launch` has exactly the `LaunchFn` signature (DISPATCH).
        let launch = unsafe { lib.get::<LaunchFn>(b"arbor_simt_launch\0") }
            .map(|f| *f)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Self { launch, _lib: lib })
    }

    /// Runs kernel `name` to completion.
    ///
    /// # Safety
    /// `args` holds one pointer per kernel parameter, each to an 8-byte slot
    /// holding the value, and every address among the values covers what the
    /// launch touches.
    pub(crate) unsafe fn launch(
        &self,
        name: &str,
        grid: [u32; 3],
        block: u32,
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<(), String> {
        let cname = CString::new(name).map_err(|e| e.to_string())?;
        // SAFETY: per this function's contract.
        let rc = unsafe {
            (self.launch)(
                cname.as_ptr(),
                grid[0],
                grid[1],
                grid[2],
                block,
                smem,
                args.as_mut_ptr(),
            )
        };
        match rc {
            0 => Ok(()),
            _ => Err(format!("the emulator has no kernel {name}")),
        }
    }
}
