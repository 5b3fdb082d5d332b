//! x86-64 SIMD kernels (AVX2 and AVX-512), selected at run time.
//!
//! Every function here is `unsafe` only because it requires CPU features:
//! callers in `lib.rs` check the level against [`crate::detected_level`] and
//! validate all lengths first. Kernels never allocate or keep state.

pub mod acts;
pub mod dequant;
pub mod float;
pub mod gemm;
pub mod gemv;
pub mod kquants;
pub mod legacy;
