//! x86-64 SIMD kernels (AVX2, AVX-512 and AMX), selected at run time.
//!
//! Every function here is `unsafe` only because it requires CPU features:
//! callers in `lib.rs` check the level against [`crate::detected_level`] and
//! validate all lengths first. Kernels never allocate or keep state.
//! [`Prefetch`] is the weight prefetch the GEMV and float kernels share.

/// The AVX2 and AVX-512 entry points (`rows_avx2`, `rows_avx512`) of the
/// invoking module's row kernel `rows::<F, VNNI, M>(w, n_rows, &Acts,
/// OutMat)`, each compiled with its target features, and their type
/// `RowsFn` (the block-quantized and K-quant GEMVs share this shape).
macro_rules! row_entries {
    () => {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn rows_avx2<const F: u8, const M: usize>(
            w: &[u8],
            n_rows: usize,
            a: &Acts,
            out: OutMat,
        ) {
            // SAFETY: features enabled by this function; bounds per caller.
            unsafe { rows::<F, false, M>(w, n_rows, a, out) }
        }

        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
        unsafe fn rows_avx512<const F: u8, const M: usize>(
            w: &[u8],
            n_rows: usize,
            a: &Acts,
            out: OutMat,
        ) {
            // SAFETY: features enabled by this function; bounds per caller.
            unsafe { rows::<F, true, M>(w, n_rows, a, out) }
        }

        type RowsFn = unsafe fn(&[u8], usize, &Acts, OutMat);
    };
}

/// An entry point of [`row_entries`] for format `$fmt` at 1 to 8
/// activation rows, indexed by rows − 1.
macro_rules! rows_table {
    ($f:ident, $fmt:expr) => {
        [
            $f::<$fmt, 1> as RowsFn,
            $f::<$fmt, 2>,
            $f::<$fmt, 3>,
            $f::<$fmt, 4>,
            $f::<$fmt, 5>,
            $f::<$fmt, 6>,
            $f::<$fmt, 7>,
            $f::<$fmt, 8>,
        ]
    };
}

pub mod acts;
pub(crate) mod amx;
pub(crate) mod bf16_panel;
pub mod dequant;
pub mod float;
pub mod gemm;
pub mod gemv;
pub mod kquants;
pub mod legacy;
mod pack_avx2;
mod tile_avx2;

use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};

/// Weight bytes to prefetch while a kernel works on the rows before them
/// (the next tile or row group: weight rows are adjacent); `len` 0 for none.
#[derive(Clone, Copy)]
pub(crate) struct Prefetch {
    base: *const u8,
    len: usize,
}

impl Prefetch {
    /// Bytes to prefetch per step when a tile takes `steps` steps.
    #[inline(always)]
    fn per_step(self, steps: usize) -> usize {
        if self.len == 0 {
            0
        } else {
            self.len.div_ceil(steps.max(1))
        }
    }

    /// Prefetches the lines of `base[from..from + n]` (clipped to `len`).
    #[inline(always)]
    fn lines(self, from: usize, n: usize) {
        let end = (from + n).min(self.len);
        let mut off = from;
        while off < end {
            // SAFETY: a prefetch never faults; the address is within the weights.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(self.base.wrapping_add(off) as *const i8);
            }
            off += 64;
        }
    }
}
