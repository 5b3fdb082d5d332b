//! rocBLAS, loaded at run time (`librocblas.so.4` of ROCm 6, `.so.3` of 5.6
//! and 5.7, `.so.0` of earlier 5.x; `ARBOR_ROCBLAS_LIB` first): one handle
//! bound to the backend's stream with a workspace the backend owns, so that
//! no GEMM reallocates during a graph capture, and `rocblas_gemm_ex` (with
//! `rocblas_gemm_strided_batched_ex` for per-head products side by side) in
//! the default host pointer mode (the mode rocBLAS supports under HIP graphs).

#![allow(unsafe_code)]

use crate::hip::Stream;
use arbor_engine_core::{CoreError, DType, Result};
use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

type Handle = *mut c_void;
type Status = c_int;

pub const OP_NONE: c_int = 111;
pub const OP_TRANSPOSE: c_int = 112;
pub const F16_R: c_int = 150;
pub const F32_R: c_int = 151;
pub const BF16_R: c_int = 168;
pub const GEMM_ALGO_STANDARD: c_int = 0;

/// rocBLAS's type of a GEMM input dtype.
pub fn datatype(d: DType) -> Result<c_int> {
    match d {
        DType::F32 => Ok(F32_R),
        DType::F16 => Ok(F16_R),
        DType::BF16 => Ok(BF16_R),
        other => Err(CoreError::unsupported(format!(
            "rocBLAS GEMM with {other} inputs"
        ))),
    }
}

type GemmEx = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    c_int,
    c_int,
    *mut c_void,
    c_int,
    c_int,
    c_int,
    c_int,
    i32,
    u32,
) -> Status;

/// `rocblas_gemm_strided_batched_ex`: `rocblas_gemm_ex`'s arguments with a
/// 64-bit stride after each matrix's leading dimension and the batch count
/// before the compute type.
type GemmStridedBatchedEx = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    c_int,
    c_int,
    i64,
    *const c_void,
    c_int,
    c_int,
    i64,
    *const c_void,
    *const c_void,
    c_int,
    c_int,
    i64,
    *mut c_void,
    c_int,
    c_int,
    i64,
    c_int,
    c_int,
    c_int,
    i32,
    u32,
) -> Status;

/// The bound rocBLAS functions.
pub struct RocBlas {
    pub create_handle: unsafe extern "C" fn(*mut Handle) -> Status,
    pub destroy_handle: unsafe extern "C" fn(Handle) -> Status,
    pub set_stream: unsafe extern "C" fn(Handle, Stream) -> Status,
    pub set_workspace: unsafe extern "C" fn(Handle, *mut c_void, usize) -> Status,
    pub gemm_ex: GemmEx,
    pub gemm_strided_batched_ex: GemmStridedBatchedEx,
    _lib: libloading::Library,
}

impl RocBlas {
    /// rocBLAS of this process, or why it cannot be loaded.
    pub fn get() -> std::result::Result<&'static RocBlas, String> {
        static LIB: OnceLock<std::result::Result<RocBlas, String>> = OnceLock::new();
        LIB.get_or_init(|| {
            let mut names: Vec<PathBuf> = std::env::var_os("ARBOR_ROCBLAS_LIB")
                .map(PathBuf::from)
                .into_iter()
                .collect();
            for n in [
                "librocblas.so",
                "librocblas.so.5",
                "librocblas.so.4",
                "librocblas.so.3",
                "librocblas.so.0",
                "/opt/rocm/lib/librocblas.so",
            ] {
                names.push(PathBuf::from(n));
            }
            for n in names {
                // SAFETY: loading runs only the library's initializers.
                let Ok(lib) = (unsafe { libloading::Library::new(&n) }) else {
                    continue;
                };
                let path = n.display().to_string();
                macro_rules! sym {
                    ($name:literal) => {
                        // SAFETY: the prototype of rocblas.h (ROCm 5.x and 6.x).
                        *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                            .map_err(|e| format!("{path}: no {}: {e}", $name))?
                    };
                }
                return Ok(RocBlas {
                    create_handle: sym!("rocblas_create_handle"),
                    destroy_handle: sym!("rocblas_destroy_handle"),
                    set_stream: sym!("rocblas_set_stream"),
                    set_workspace: sym!("rocblas_set_workspace"),
                    gemm_ex: sym!("rocblas_gemm_ex"),
                    gemm_strided_batched_ex: sym!("rocblas_gemm_strided_batched_ex"),
                    _lib: lib,
                });
            }
            Err("rocBLAS (librocblas.so.4) not found: install ROCm's rocblas or set ARBOR_ROCBLAS_LIB".into())
        })
        .as_ref()
        .map_err(Clone::clone)
    }
}

/// A rocBLAS handle on the backend's stream with the given workspace.
pub struct Blas {
    lib: &'static RocBlas,
    handle: Handle,
}

fn check(s: Status, what: &str) -> Result<()> {
    if s == 0 {
        Ok(())
    } else {
        Err(CoreError::Device(format!("{what}: rocblas_status {s}")))
    }
}

impl Blas {
    /// A handle bound to `stream`, using `workspace` (`bytes` of device memory
    /// that outlives the handle).
    pub fn new(stream: Stream, workspace: *mut c_void, bytes: usize) -> Result<Self> {
        let lib = RocBlas::get().map_err(CoreError::Device)?;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        check(
            unsafe { (lib.create_handle)(&mut handle) },
            "rocblas_create_handle",
        )?;
        let b = Self { lib, handle };
        // SAFETY: a live handle and stream.
        check(
            unsafe { (lib.set_stream)(handle, stream) },
            "rocblas_set_stream",
        )?;
        // SAFETY: the workspace is live device memory for the handle's lifetime.
        check(
            unsafe { (lib.set_workspace)(handle, workspace, bytes) },
            "rocblas_set_workspace",
        )?;
        Ok(b)
    }

    /// Row-major `out[m, n] = x[m, k] · w[n, k]ᵀ` (f32 out, f32 compute).
    ///
    /// # Safety
    /// The addresses cover `w [n, k]`, `x [m, k]` (of `ty`) and `out [m, n]` (f32).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm(
        &self,
        ty: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        w: u64,
        x: u64,
        out: u64,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Column-major outᵀ (n × m) = wᵀ (w stored k × n) · xᵀ (k × m); C = D.
        // SAFETY: the caller's contract; host scalars read during the call.
        let s = unsafe {
            (self.lib.gemm_ex)(
                self.handle,
                OP_TRANSPOSE,
                OP_NONE,
                n,
                m,
                k,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                ty,
                k,
                x as *const c_void,
                ty,
                k,
                &beta as *const f32 as *const c_void,
                out as *const c_void,
                F32_R,
                n,
                out as *mut c_void,
                F32_R,
                n,
                F32_R,
                GEMM_ALGO_STANDARD,
                0,
                0,
            )
        };
        check(s, &format!("rocblas_gemm_ex {m}x{n}x{k}"))
    }
}

impl Blas {
    /// `heads` products side by side: row-major `out[:, h·n..(h+1)·n] =
    /// x[:, h·k..(h+1)·k] · w[h·n..(h+1)·n]ᵀ` for `x` `[m, heads·k]`, `w`
    /// `[heads·n, k]` (of `ty`) and `out` `[m, heads·n]` (f32), one
    /// strided-batched call.
    ///
    /// # Safety
    /// The addresses cover those operands.
    pub unsafe fn gemm_heads(
        &self,
        ty: c_int,
        [m, n, k, heads]: [c_int; 4],
        w: u64,
        x: u64,
        out: u64,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let ld = |a: c_int| {
            a.checked_mul(heads)
                .ok_or_else(|| CoreError::unsupported(format!("GEMM width {a} x {heads}")))
        };
        let (ldx, ldo) = (ld(k)?, ld(n)?);
        // Head h: w + h·n·k (ld k), x + h·k (ld heads·k), out + h·n (ld
        // heads·n); column-major as in `gemm`, C = D.
        // SAFETY: the caller's contract; host scalars read during the call.
        let s = unsafe {
            (self.lib.gemm_strided_batched_ex)(
                self.handle,
                OP_TRANSPOSE,
                OP_NONE,
                n,
                m,
                k,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                ty,
                k,
                i64::from(n) * i64::from(k),
                x as *const c_void,
                ty,
                ldx,
                i64::from(k),
                &beta as *const f32 as *const c_void,
                out as *const c_void,
                F32_R,
                ldo,
                i64::from(n),
                out as *mut c_void,
                F32_R,
                ldo,
                i64::from(n),
                heads,
                F32_R,
                GEMM_ALGO_STANDARD,
                0,
                0,
            )
        };
        check(
            s,
            &format!("rocblas_gemm_strided_batched_ex {heads} x {m}x{n}x{k}"),
        )
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        unsafe { (self.lib.destroy_handle)(self.handle) };
    }
}
