//! x86-64 SIMD kernels (AVX2, AVX-512 and AMX), selected at run time.
//!
//! Every function here is `unsafe` only because it requires CPU features:
//! callers in `lib.rs` check the level against [`crate::detected_level`] and
//! validate all lengths first. Kernels never allocate or keep state.
//! [`Prefetch`] is the weight prefetch the GEMV and float kernels share.

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
