//! GGUF (ggml) weight block formats and their CPU dot-product kernels, and
//! the quantization methods of HF checkpoints ([`methods`]: FP8, AWQ, GPTQ,
//! compressed-tensors) with the in-band block formats they load into.
//!
//! Owns: the byte layouts of F32/F16/BF16 and ggml's block formats (Q4_0,
//! Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K..Q6_K, Q8_K; GGUF tensor data is used
//! as is), reference quantizers, dequantizers, activation preparation
//! ([`prepare_acts`]) and [`dot_rows`] used by the CPU backend: a tiled GEMM
//! (`gemm` module) for the 32-element formats, row kernels for the K-quants
//! and tiled dot kernels for float weights, with runtime SIMD dispatch
//! ([`SimdLevel`]) and a portable scalar path.
//!
//! Batch invariance: at a given SIMD level, [`dot_rows`] computes output
//! `(i, r)` bit for bit the same whatever `m` is, whatever the other
//! activation rows hold and however the caller splits the weight rows (a
//! position's logits then do not depend on the shape of the batch it is
//! computed in). Every kernel applies one fixed sequence of operations per
//! output element: the 32-element formats take the tiled GEMM at every `m`
//! (AVX-512; on AVX2, below 4 rows, a GEMV that reproduces the GEMM's
//! per-element arithmetic, see `x86::gemv`), the K-quant row kernels and
//! the float kernels use one accumulator layout per element for every tile
//! shape, the scalar level computes each element on its own, and each
//! activation row is prepared on its own. The scaled block formats take
//! f32 activations, or bf16 ones prepared for [`QuantMatmul::AmxBf16`]
//! ([`PreparedActs::prepare_split_as`]), which the `Amx` level multiplies
//! in AMX tiles against bf16 panels of the dequantized weights: a second
//! path chosen by the caller once, not by `m`. W8A8 FP8 (`f8a8_s32`, the
//! `f8_s32` blocks) always meets its input rounded to E4M3 per run of 32
//! (activation type F8E4M3, [`scaled::round_input_e4m3`]), each row on its own.
//!
//! Invariants: every public function validates dtypes and buffer lengths
//! before any kernel runs and returns [`QuantError`] on bad input (it never
//! panics or reads out of bounds); kernels are reentrant and the only global
//! state is the cached CPU feature detection. Quantized dot products follow
//! ggml: activations are quantized to the weight's `vec_dot_type` (Q8_0,
//! Q8_1 or Q8_K), integer dots per block, f32 scaling and accumulation.
//!
//! ```
//! use arbor_quant::{DType, dot_rows, prepare_acts, quantize, row_bytes};
//! let (n_rows, k, m) = (3, 64, 2);
//! let w_f32: Vec<f32> = (0..n_rows * k).map(|i| (i % 7) as f32 - 3.0).collect();
//! let mut w = vec![0u8; row_bytes(DType::Q4_1, n_rows * k)?];
//! quantize(DType::Q4_1, &w_f32, &mut w)?;
//! let x: Vec<f32> = (0..m * k).map(|i| (i % 5) as f32 * 0.25).collect();
//! // Prepare once per activation matrix; reuse for every weight of the same vec_dot type.
//! let acts = prepare_acts(DType::Q4_1, &x, m, k)?;
//! let mut out = vec![0.0f32; m * n_rows];
//! dot_rows(DType::Q4_1, &w, n_rows, k, &acts, &mut out, n_rows)?;
//! # Ok::<(), arbor_quant::QuantError>(())
//! ```
#![allow(unsafe_code)]
// Index loops mirror ggml's C so the ports can be checked side by side.
#![allow(clippy::needless_range_loop)]

mod acts;
mod error;
mod formats;
mod gemm;
pub mod methods;
mod simd;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use acts::{
    PreparedActs, SplitPrep, act_dtype_for, act_dtype_with, prepare_acts, quant_matmul_here,
};
pub use arbor_engine_core::{DType, QuantMatmul};
pub use error::QuantError;
/// The E4M3 element and the in-band scaled weight blocks (`f8_s32`, `u4_s32`).
pub use formats::scaled;
use gemm::OutMat;
pub use gemm::gemm_supported;
pub use simd::{SimdLevel, detected_level};

/// True if `dtype` can be stored, dequantized and quantized by this crate.
pub fn is_supported(dtype: DType) -> bool {
    !matches!(dtype, DType::I32 | DType::U32 | DType::U8)
}

/// True if [`dot_rows`] accepts weights of `dtype`.
pub fn is_dot_supported(dtype: DType) -> bool {
    act_dtype_for(dtype).is_ok()
}

/// Every weight dtype [`dot_rows`] multiplies (those [`is_dot_supported`]
/// accepts), floats first, then ggml's block formats, then the scaled
/// blocks of HF quantized checkpoints.
pub const DOT_WEIGHT_DTYPES: [DType; 18] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::F8_S32,
    DType::F8A8_S32,
    DType::U4_S32,
    DType::U8_S32,
    DType::F4_S16,
];

fn check_supported(dtype: DType, op: &'static str) -> Result<(), QuantError> {
    if is_supported(dtype) {
        Ok(())
    } else {
        Err(QuantError::Unsupported { op, dtype })
    }
}

/// Bytes of one row of `k` elements of `dtype`; errors unless `k` is a whole
/// number of blocks.
pub fn row_bytes(dtype: DType, k: usize) -> Result<usize, QuantError> {
    let bs = dtype.block_size();
    if !k.is_multiple_of(bs) {
        return Err(QuantError::NotBlockMultiple {
            dtype,
            k,
            block: bs,
        });
    }
    (k / bs)
        .checked_mul(dtype.block_bytes())
        .ok_or(QuantError::Overflow("row bytes"))
}

fn check_level(level: SimdLevel) -> Result<(), QuantError> {
    if level > detected_level() {
        Err(QuantError::LevelUnavailable(level))
    } else {
        Ok(())
    }
}

/// Dequantizes whole blocks of `dtype` in `src` to f32 in `dst`
/// (`dst.len()` must be the number of elements `src` holds).
pub fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    dequantize_with(detected_level(), dtype, src, dst)
}

/// [`dequantize`] at an explicit SIMD level (at most [`detected_level`]).
pub fn dequantize_with(
    level: SimdLevel,
    dtype: DType,
    src: &[u8],
    dst: &mut [f32],
) -> Result<(), QuantError> {
    check_level(level)?;
    check_supported(dtype, "dequantize")?;
    let dtype = dtype.storage();
    let bb = dtype.block_bytes();
    let bs = dtype.block_size();
    if !src.len().is_multiple_of(bb) {
        return Err(QuantError::BadLength {
            what: "source (whole blocks)",
            expected: src.len() / bb * bb,
            got: src.len(),
            unit: "bytes",
        });
    }
    let n = (src.len() / bb)
        .checked_mul(bs)
        .ok_or(QuantError::Overflow("elements"))?;
    if dst.len() != n {
        return Err(QuantError::BadLength {
            what: "dequantize destination",
            expected: n,
            got: dst.len(),
            unit: "f32",
        });
    }
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        // SAFETY: level <= detected_level() implies AVX2+FMA+F16C; src holds
        // whole blocks and dst exactly their elements (checked above).
        if unsafe { x86::dequant::dequantize(dtype, src, dst) } {
            return Ok(());
        }
    }
    dequantize_scalar(dtype, src, dst);
    Ok(())
}

fn dequantize_scalar(dtype: DType, src: &[u8], dst: &mut [f32]) {
    let bb = dtype.block_bytes();
    let bs = dtype.block_size();
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => formats::float::dequantize(dtype, src, dst),
        DType::F8E4M3
        | DType::F8E5M2
        | DType::F8_S32
        | DType::U4_S32
        | DType::U8_S32
        | DType::F4_S16 => formats::scaled::dequantize(dtype, src, dst),
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::Q8_1 => {
            for (b, y) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(bs)) {
                formats::legacy::dequantize_block(dtype, b, y);
            }
        }
        _ => {
            for (b, y) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(bs)) {
                formats::kquants::dequantize_block(dtype, b, y);
            }
        }
    }
}

/// Quantizes `src` (a whole number of blocks) into `dst` with ggml's
/// reference quantizers (`quantize_row_*_ref`); float dtypes are converted.
pub fn quantize(dtype: DType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    check_supported(dtype, "quantize")?;
    let dtype = dtype.storage();
    let need = row_bytes(dtype, src.len())?;
    if dst.len() != need {
        return Err(QuantError::BadLength {
            what: "quantize destination",
            expected: need,
            got: dst.len(),
            unit: "bytes",
        });
    }
    let bb = dtype.block_bytes();
    let bs = dtype.block_size();
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => formats::float::quantize(dtype, src, dst),
        DType::F8E4M3
        | DType::F8E5M2
        | DType::F8_S32
        | DType::U4_S32
        | DType::U8_S32
        | DType::F4_S16 => formats::scaled::quantize(dtype, src, dst),
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::Q8_1 => {
            for (x, y) in src.chunks_exact(bs).zip(dst.chunks_exact_mut(bb)) {
                formats::legacy::quantize_block(dtype, x, y);
            }
        }
        _ => {
            for (x, y) in src.chunks_exact(bs).zip(dst.chunks_exact_mut(bb)) {
                formats::kquant_ref::quantize_block(dtype, x, y);
            }
        }
    }
    Ok(())
}

/// `out[i * out_stride + r] = dot(weight row r, activation row i)` for
/// `r < n_rows`, `i < acts.m()`. `w` holds exactly `n_rows` rows of `k`
/// elements of `weight`; `acts` must come from [`prepare_acts`] for the same
/// weight dtype (or one with the same [`act_dtype_for`]) and `k`.
///
/// Formats the tiled GEMM handles ([`gemm_supported`]) take it at the
/// AVX-512 level for every `m`; at the AVX2 level, below 4 rows, a GEMV
/// that reproduces the GEMM's per-element arithmetic exactly. Either way
/// each output element is independent of `m` and of the other rows.
pub fn dot_rows(
    weight: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    acts: &PreparedActs,
    out: &mut [f32],
    out_stride: usize,
) -> Result<(), QuantError> {
    dot_rows_with(
        detected_level(),
        weight,
        w,
        n_rows,
        k,
        acts,
        out,
        out_stride,
    )
}

/// [`dot_rows`] at an explicit SIMD level (at most [`detected_level`]).
#[allow(clippy::too_many_arguments)]
pub fn dot_rows_with(
    level: SimdLevel,
    weight: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    acts: &PreparedActs,
    out: &mut [f32],
    out_stride: usize,
) -> Result<(), QuantError> {
    dot_slice(
        level,
        Path::Auto,
        weight,
        w,
        n_rows,
        k,
        acts,
        out,
        out_stride,
    )
}

/// [`dot_rows_with`] forced onto the GEMV-style row kernels, whatever
/// `acts.m()` (for tests and benchmarks). For the 32-element formats these
/// are the older row kernels, which [`dot_rows`] no longer uses: their
/// per-element summation order differs from the GEMM's, so they agree with
/// [`dot_rows`] only to rounding.
#[allow(clippy::too_many_arguments)]
pub fn dot_rows_gemv_with(
    level: SimdLevel,
    weight: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    acts: &PreparedActs,
    out: &mut [f32],
    out_stride: usize,
) -> Result<(), QuantError> {
    dot_slice(
        level,
        Path::Rows,
        weight,
        w,
        n_rows,
        k,
        acts,
        out,
        out_stride,
    )
}

/// [`dot_rows_with`] forced onto the tiled GEMM path, whatever `acts.m()`;
/// an error for dtypes without one ([`gemm_supported`]) and at the scalar
/// level. For tests and benchmarks.
#[allow(clippy::too_many_arguments)]
pub fn gemm_with(
    level: SimdLevel,
    weight: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    acts: &PreparedActs,
    out: &mut [f32],
    out_stride: usize,
) -> Result<(), QuantError> {
    if !gemm_supported(weight) || level == SimdLevel::Scalar {
        return Err(QuantError::Unsupported {
            op: "tiled GEMM (at this SIMD level)",
            dtype: weight,
        });
    }
    dot_slice(
        level,
        Path::Tiled,
        weight,
        w,
        n_rows,
        k,
        acts,
        out,
        out_stride,
    )
}

/// Which kernels [`dot_unchecked`] runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    /// The batch-invariant dispatch of [`dot_rows`].
    Auto,
    /// The row kernels (for tests and benchmarks).
    Rows,
    /// The tiled GEMM (for tests and benchmarks; `gemm_supported` formats).
    Tiled,
}

/// Checks `out` against the validated shape, then runs the kernels.
#[allow(clippy::too_many_arguments)]
fn dot_slice(
    level: SimdLevel,
    path: Path,
    weight: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    acts: &PreparedActs,
    out: &mut [f32],
    out_stride: usize,
) -> Result<(), QuantError> {
    if !check_dot(level, weight, w, n_rows, k, acts, out_stride)? {
        return Ok(());
    }
    let need_out = (acts.m - 1)
        .checked_mul(out_stride)
        .and_then(|v| v.checked_add(n_rows))
        .ok_or(QuantError::Overflow("output length"))?;
    if out.len() < need_out {
        return Err(QuantError::BadLength {
            what: "output ((m-1)*out_stride + n_rows)",
            expected: need_out,
            got: out.len(),
            unit: "f32",
        });
    }
    let o = OutMat {
        ptr: out.as_mut_ptr(),
        stride: out_stride,
    };
    // SAFETY: the shape was validated and `out` (exclusively borrowed) holds
    // every element (i, r), i < m, r < n_rows.
    unsafe { dot_unchecked(level, path, weight, w, n_rows, k, acts, o) };
    Ok(())
}

/// [`dot_rows`] writing through a raw pointer, for callers that split the
/// columns of one output matrix between threads: element `(i, r)` goes to
/// `out.add(i * out_stride + r)` for `i < acts.m()`, `r < n_rows`, and
/// nothing else is written. Every other argument is validated as in
/// [`dot_rows`].
///
/// # Safety
/// For every `i < acts.m()` and `r < n_rows`, `out.add(i * out_stride + r)`
/// must be valid for writes (and reads) of an f32, and no other thread may
/// access those elements during the call.
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_rows_raw(
    weight: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    acts: &PreparedActs,
    out: *mut f32,
    out_stride: usize,
) -> Result<(), QuantError> {
    let level = detected_level();
    if !check_dot(level, weight, w, n_rows, k, acts, out_stride)? {
        return Ok(());
    }
    (acts.m - 1)
        .checked_mul(out_stride)
        .and_then(|v| v.checked_add(n_rows))
        .ok_or(QuantError::Overflow("output length"))?;
    let o = OutMat {
        ptr: out,
        stride: out_stride,
    };
    // SAFETY: the shape was validated; the output elements are valid and
    // exclusively ours per this function's contract.
    unsafe { dot_unchecked(level, Path::Auto, weight, w, n_rows, k, acts, o) };
    Ok(())
}

/// Validates everything but the output buffer; false if there is nothing
/// to compute (`m == 0` or `n_rows == 0`).
fn check_dot(
    level: SimdLevel,
    weight: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    acts: &PreparedActs,
    out_stride: usize,
) -> Result<bool, QuantError> {
    check_level(level)?;
    let ad = act_dtype_for(weight)?;
    let bf16_scaled = acts.dtype == Some(DType::BF16)
        && matches!(
            act_dtype_with(weight, QuantMatmul::AmxBf16),
            Ok(DType::BF16)
        );
    if acts.dtype != Some(ad) && !bf16_scaled {
        return Err(QuantError::ActsMismatch(format!(
            "weights of type {weight} need activations prepared as {ad}, got {}",
            acts.dtype.map_or("nothing".to_string(), |d| d.to_string())
        )));
    }
    if acts.k != k {
        return Err(QuantError::ActsMismatch(format!(
            "activations have k = {}, weights k = {k}",
            acts.k
        )));
    }
    let rb = row_bytes(weight, k)?;
    let need = n_rows
        .checked_mul(rb)
        .ok_or(QuantError::Overflow("weight bytes"))?;
    if w.len() != need {
        return Err(QuantError::BadLength {
            what: "weights (n_rows * row bytes)",
            expected: need,
            got: w.len(),
            unit: "bytes",
        });
    }
    if acts.m == 0 || n_rows == 0 {
        return Ok(false);
    }
    if acts.m > 1 && out_stride < n_rows {
        return Err(QuantError::BadStride {
            stride: out_stride,
            n_rows,
        });
    }
    Ok(true)
}

/// Runs the kernels on validated input.
///
/// # Safety
/// `check_dot` accepted the arguments and `out` is valid for `acts.m` rows
/// of `n_rows` columns that nothing else accesses.
#[allow(clippy::too_many_arguments)]
unsafe fn dot_unchecked(
    level: SimdLevel,
    path: Path,
    weight: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    acts: &PreparedActs,
    out: OutMat,
) {
    // `f8a8_s32` blocks are `f8_s32`'s; their inputs were rounded (F8E4M3).
    let weight = weight.storage();
    if k == 0 {
        for i in 0..acts.m {
            for r in 0..n_rows {
                // SAFETY: (i, r) is inside the output (contract).
                unsafe { out.set(i, r, 0.0) };
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        let avx512 = level >= SimdLevel::Avx512;
        // SAFETY: level <= detected_level() was checked, so the CPU has the
        // features; all lengths were validated by check_dot.
        if path == Path::Auto && !avx512 {
            // SAFETY: as above (AVX2); false unless a 32-element format
            // with fewer rows than the AVX2 GEMM threshold.
            if unsafe { x86::gemv::dot_rows(weight, w, n_rows, k, acts, out) } {
                return;
            }
        }
        // SAFETY: as above.
        if path != Path::Rows && unsafe { x86::gemm::gemm(avx512, weight, w, n_rows, k, acts, out) }
        {
            return;
        }
        // SAFETY: as above.
        if unsafe { dot_rows_x86(level, weight, w, n_rows, k, acts, out) } {
            return;
        }
    }
    let _ = path;
    // SAFETY: per this function's contract.
    unsafe { dot_rows_scalar(weight, w, n_rows, k, acts, out) };
}

/// Runs the SIMD row kernel for `weight` if there is one; false otherwise.
///
/// # Safety
/// As [`dot_unchecked`], with `Avx2 <= level <= detected_level()`.
#[cfg(target_arch = "x86_64")]
unsafe fn dot_rows_x86(
    level: SimdLevel,
    weight: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    acts: &PreparedActs,
    out: OutMat,
) -> bool {
    let avx512 = level >= SimdLevel::Avx512;
    match weight {
        // bf16 weights times the bf16-rounded activations.
        DType::BF16 if level >= SimdLevel::Amx => {
            // SAFETY: per this function's contract (the CPU has AVX-512 BF16
            // and AMX, with the tile permission); `hp` holds the packed rows
            // whenever `k` is a multiple of 32.
            unsafe {
                if acts.hp.is_empty() {
                    x86::float::dot_rows_bf16(w, n_rows, k, &acts.h, acts.m, out)
                } else {
                    x86::amx::dot_rows(w, n_rows, k, &acts.hp, acts.m, out)
                }
            };
            true
        }
        // Scaled weights with activations prepared as bf16
        // (`QuantMatmul::AmxBf16`): bf16 panels through AMX tiles.
        DType::F8_S32 | DType::U4_S32 | DType::U8_S32 | DType::F4_S16
            if level >= SimdLevel::Amx && !acts.hp.is_empty() =>
        {
            // SAFETY: per this function's contract (AMX with the tile
            // permission); `hp` is non-empty only for bf16 activations with
            // `k % 32 == 0`.
            unsafe { x86::bf16_panel::dot_rows(weight, w, n_rows, k, &acts.hp, acts.m, out) };
            true
        }
        // Float and scaled weights below that level (or with f32
        // activations, or a `k` AMX does not tile): f32 activations.
        _ if matches!(act_dtype_for(weight), Ok(DType::F32 | DType::BF16)) => {
            // SAFETY: per this function's contract.
            unsafe { x86::float::dot_rows(avx512, weight, w, n_rows, k, &acts.f, acts.m, out) };
            true
        }
        DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K => {
            // SAFETY: as above.
            unsafe { x86::kquants::dot_rows(avx512, weight, w, n_rows, k, acts, out) }
        }
        // SAFETY: as above.
        _ => unsafe { x86::legacy::dot_rows(avx512, weight, w, n_rows, k, acts, out) },
    }
}

/// # Safety
/// As [`dot_unchecked`].
unsafe fn dot_rows_scalar(
    weight: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    acts: &PreparedActs,
    out: OutMat,
) {
    let rb = w.len() / n_rows.max(1);
    for (r, wr) in w.chunks_exact(rb).enumerate() {
        for i in 0..acts.m {
            let v = match weight {
                DType::F32 | DType::F16 | DType::BF16 => {
                    formats::float::dot_row(weight, wr, &acts.f[i * k..(i + 1) * k])
                }
                DType::F8_S32 | DType::U4_S32 | DType::U8_S32 | DType::F4_S16 => {
                    formats::scaled::dot_row(weight, wr, &acts.f[i * k..(i + 1) * k])
                }
                DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => {
                    let nb = k / 32;
                    formats::legacy::dot_row(
                        weight,
                        wr,
                        &acts.qs[i * k..(i + 1) * k],
                        &acts.d[i * nb..(i + 1) * nb],
                        &acts.s[i * nb..(i + 1) * nb],
                    )
                }
                _ => {
                    let nb = k / 256;
                    formats::kquants::dot_row(
                        weight,
                        wr,
                        &acts.qs[i * k..(i + 1) * k],
                        &acts.d[i * nb..(i + 1) * nb],
                        &acts.bsums[i * nb * 16..(i + 1) * nb * 16],
                    )
                }
            };
            // SAFETY: i < m, r < n_rows (contract).
            unsafe { out.set(i, r, v) };
        }
    }
}
