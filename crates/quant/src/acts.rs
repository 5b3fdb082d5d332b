//! Activations prepared for dot products ([`PreparedActs`]).
//!
//! Owns the quantization of f32 activation rows into the "vec_dot type" that
//! ggml pairs with each weight format: f32 for f32/f16 and the scaled
//! blocks, bf16 for bf16 weights, Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for
//! Q4_1/Q5_1, Q8_K for the K-quants and F8E4M3 for W8A8 FP8 (`f8a8_s32`:
//! each run of 32 inputs rounded to E4M3 with the scale `max|x| / 448`, or
//! with the layer's static input scale, kept as the f32 values the codes
//! and scales stand for, in `f`). Activations prepared as bf16 keep
//! their f32 rows too: only the `Amx` level multiplies the rounded
//! values (AMX tiles, from `hp`, when `k` is a multiple of 32; else
//! `vdpbf16ps`, from `h`); the lower levels use the f32 rows, as for f16
//! weights. The values
//! are bit-identical to what ggml's x86 `quantize_row_q8_0/q8_1` (scale
//! `127/amax`, round half to even, scale stored as f16) and
//! `quantize_row_q8_K_ref` produce, but they are stored as a structure of
//! arrays (all quants of a row contiguous, scales and sums in their own
//! arrays) so that SIMD kernels can load them without shuffling.
//! [`PreparedActs::prepare_split`] leaves the quantization to a
//! [`SplitPrep`] whose parts (whole blocks) can run on several threads.
//!
//! Invariants (established by [`PreparedActs::prepare_into`], relied upon by
//! the unsafe kernels): `k` is a whole number of blocks of `dtype`;
//! `f.len() == m*k` for F32, BF16 and F8E4M3, `h.len() == m*k` for BF16 (each the
//! round-to-nearest-even bf16 of its `f`), otherwise `qs.len() == m*k` (and
//! `qs_pair.len()` is `m*k` or 0 for Q8_0/Q8_1), `d.len() == m*nb`,
//! `s.len() == isum.len() == m*nb` for Q8_0/Q8_1 and `bsums.len() == m*nb*16`
//! for Q8_K, where `nb = k / block_size`. Quant values lie in -127..=127.

use crate::{DType, QuantError, QuantMatmul, SimdLevel, formats::f16_round};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};

/// Parts a [`SplitPrep`] is cut into (whole blocks each).
const SPLIT_PARTS: usize = 16;

/// The quantization of one [`PreparedActs::prepare_split`], in
/// `SPLIT_PARTS` (16) parts of whole blocks that may run concurrently; it
/// borrows the activations and the buffers it fills. Each part runs once:
/// it is claimed before it runs, and dropping the value runs the parts
/// nobody claimed, so the activations are complete when the borrow ends.
pub struct SplitPrep<'a> {
    level: SimdLevel,
    dtype: DType,
    /// F8E4M3: the static scale of every run (`None`: each run's own).
    input_scale: Option<f32>,
    x: &'a [f32],
    /// Blocks to quantize or round (0 for F32 and BF16, prepared already).
    nb: usize,
    qs: *mut i8,
    /// F8E4M3: the rounded values (`f`).
    f: *mut f32,
    d: *mut f32,
    s: *mut f32,
    isum: *mut i32,
    bsums: *mut i16,
    claimed: [AtomicBool; SPLIT_PARTS],
    _acts: PhantomData<&'a mut PreparedActs>,
}

// SAFETY: the pointers are the buffers of the `PreparedActs` this value
// borrows mutably, sized for `nb` blocks; each part writes only its own
// block range, and a part runs at most once (claimed atomically), so
// concurrent `run` calls never write the same element.
unsafe impl Sync for SplitPrep<'_> {}
unsafe impl Send for SplitPrep<'_> {}

impl SplitPrep<'_> {
    /// Blocks left to quantize (a caller's measure of whether splitting
    /// pays).
    pub fn blocks(&self) -> usize {
        self.nb
    }

    /// Runs the parts `piece, piece + pieces, ...` not yet claimed (call it
    /// once per piece `0..pieces` on any threads).
    pub fn run(&self, piece: usize, pieces: usize) {
        for p in (piece..SPLIT_PARTS).step_by(pieces.max(1)) {
            self.part(p);
        }
    }

    /// Quantizes part `p` unless it was claimed already.
    fn part(&self, p: usize) {
        if self.claimed[p].swap(true, Ordering::AcqRel) {
            return;
        }
        let (b0, b1) = (p * self.nb / SPLIT_PARTS, (p + 1) * self.nb / SPLIT_PARTS);
        if b0 == b1 {
            return;
        }
        let n = b1 - b0;
        // SAFETY: blocks b0..b1 lie inside the buffers (sized for nb
        // blocks by `prepare_split_with`), no other part touches them, and
        // this part runs once (see the `Sync` impl).
        unsafe {
            use std::slice::from_raw_parts_mut as part;
            if self.dtype == DType::F8E4M3 {
                crate::scaled::round_input_e4m3(
                    &self.x[b0 * 32..b1 * 32],
                    self.input_scale,
                    part(self.f.add(b0 * 32), n * 32),
                );
            } else if self.dtype == DType::Q8_K {
                quantize_q8k_blocks(
                    self.level,
                    &self.x[b0 * 256..b1 * 256],
                    part(self.qs.add(b0 * 256), n * 256),
                    part(self.d.add(b0), n),
                    part(self.bsums.add(b0 * 16), n * 16),
                );
            } else {
                quantize_q8_blocks(
                    self.level,
                    &self.x[b0 * 32..b1 * 32],
                    part(self.qs.add(b0 * 32), n * 32),
                    part(self.d.add(b0), n),
                    part(self.s.add(b0), n),
                    part(self.isum.add(b0), n),
                    self.dtype == DType::Q8_1,
                );
            }
        }
    }
}

impl Drop for SplitPrep<'_> {
    fn drop(&mut self) {
        for p in 0..SPLIT_PARTS {
            self.part(p);
        }
    }
}

/// Activations prepared for dot products with weights of one dtype.
#[derive(Clone, Debug, Default)]
pub struct PreparedActs {
    pub(crate) dtype: Option<DType>,
    pub(crate) m: usize,
    pub(crate) k: usize,
    /// F32 (and BF16) activations, `m*k`.
    pub(crate) f: Vec<f32>,
    /// BF16: the bits of `f` rounded to bf16 (nearest even), `m*k`.
    pub(crate) h: Vec<u16>,
    /// BF16 on a CPU with the `Amx` level and `k % 32 == 0`: `h` packed in
    /// AMX's pair layout (`x86::amx::pack_acts`); empty otherwise.
    pub(crate) hp: Vec<u16>,
    /// Quantized values, `m*k`.
    pub(crate) qs: Vec<i8>,
    /// Q8_0/Q8_1: unused by [`crate::dot_rows`] (empty; the forced row
    /// kernels of [`crate::dot_rows_gemv_with`] build it on demand, see
    /// [`PreparedActs::pairs`]): `qs` reordered for the row kernels, `m*k`. Within each
    /// row, every full group of 8 blocks (256 bytes) holds, for j in 0..4,
    /// `[blk j lo16, blk j+4 lo16, blk j hi16, blk j+4 hi16]`; the blocks
    /// after the last full group keep their natural order.
    pub(crate) qs_pair: Vec<i8>,
    /// Block scales as f32 (f16-rounded for Q8_0/Q8_1), `m*nb`.
    pub(crate) d: Vec<f32>,
    /// Q8_1: ggml's `s`, f16(`amax/127 * sum(qs)`); Q8_0: `d * sum(qs)` with the
    /// stored `d` (not used by the kernels). `m*nb`.
    pub(crate) s: Vec<f32>,
    /// Q8_0/Q8_1: integer sum of each block's quants, `m*nb`.
    pub(crate) isum: Vec<i32>,
    /// Q8_K: sums of each 16 quants, `m*nb*16`.
    pub(crate) bsums: Vec<i16>,
}

/// The activation dtype ggml pairs with weights of dtype `weight`
/// (its `vec_dot_type`), or an error for dtypes that cannot be weights.
pub fn act_dtype_for(weight: DType) -> Result<DType, QuantError> {
    Ok(match weight {
        DType::BF16 => DType::BF16,
        DType::F32 | DType::F16 | DType::F8_S32 | DType::U4_S32 | DType::U8_S32 | DType::F4_S16 => {
            DType::F32
        }
        DType::F8A8_S32 => DType::F8E4M3,
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => DType::Q8_0,
        DType::Q4_1 | DType::Q5_1 => DType::Q8_1,
        DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K => DType::Q8_K,
        _ => {
            return Err(QuantError::Unsupported {
                op: "dot product with weights",
                dtype: weight,
            });
        }
    })
}

/// The activation dtype weights of dtype `weight` meet under `matmul`:
/// bf16 for the scaled block formats with f32 inputs under [`QuantMatmul::AmxBf16`]
/// (multiplied in AMX tiles at the `Amx` level, from the f32 rows below
/// it or where `k` is not a multiple of 32), else [`act_dtype_for`]'s.
pub fn act_dtype_with(weight: DType, matmul: QuantMatmul) -> Result<DType, QuantError> {
    let ad = act_dtype_for(weight)?;
    if matmul == QuantMatmul::AmxBf16 && weight.is_scaled_block() && ad == DType::F32 {
        Ok(DType::BF16)
    } else {
        Ok(ad)
    }
}

/// The [`QuantMatmul`] this CPU runs when `requested` is asked for:
/// [`QuantMatmul::AmxBf16`] needs the `Amx` level ([`crate::detected_level`])
/// and is [`QuantMatmul::F32`] below it.
pub fn quant_matmul_here(requested: QuantMatmul) -> QuantMatmul {
    if crate::detected_level() >= SimdLevel::Amx {
        requested
    } else {
        QuantMatmul::F32
    }
}

impl PreparedActs {
    /// An empty value, to be filled by [`PreparedActs::prepare_into`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Prepares `m` rows of `k` activations (`x.len() == m*k`) for weights of
    /// dtype `weight`, reusing this value's allocations.
    pub fn prepare_into(
        &mut self,
        weight: DType,
        x: &[f32],
        m: usize,
        k: usize,
    ) -> Result<(), QuantError> {
        self.prepare_into_with(crate::detected_level(), weight, x, m, k)
    }

    /// [`PreparedActs::prepare_into`] at an explicit SIMD level (at most
    /// [`crate::detected_level`]); every level produces identical values.
    pub fn prepare_into_with(
        &mut self,
        level: SimdLevel,
        weight: DType,
        x: &[f32],
        m: usize,
        k: usize,
    ) -> Result<(), QuantError> {
        // Dropping the split preparation quantizes every block here.
        let dtype = act_dtype_for(weight)?;
        self.prepare_split_with(level, weight, dtype, None, x, m, k)
            .map(drop)
    }

    /// [`PreparedActs::prepare_into`] whose quantization (the 8-bit
    /// formats) is left to the returned [`SplitPrep`]: its parts can run on
    /// several threads at once ([`SplitPrep::run`]), and whatever part has
    /// not run when it is dropped runs then. The values are the same bits
    /// as `prepare_into`'s (every block is quantized on its own).
    pub fn prepare_split<'a>(
        &'a mut self,
        weight: DType,
        x: &'a [f32],
        m: usize,
        k: usize,
    ) -> Result<SplitPrep<'a>, QuantError> {
        self.prepare_split_as(weight, QuantMatmul::F32, None, x, m, k)
    }

    /// [`PreparedActs::prepare_split`] for the activation dtype that
    /// `weight` meets under `matmul` ([`act_dtype_with`]); W8A8 FP8 weights
    /// (`f8a8_s32`) may take a static `input_scale` for every run of 32
    /// (finite and positive; see [`crate::scaled::round_input_e4m3`]).
    pub fn prepare_split_as<'a>(
        &'a mut self,
        weight: DType,
        matmul: QuantMatmul,
        input_scale: Option<f32>,
        x: &'a [f32],
        m: usize,
        k: usize,
    ) -> Result<SplitPrep<'a>, QuantError> {
        let dtype = act_dtype_with(weight, matmul)?;
        self.prepare_split_with(crate::detected_level(), weight, dtype, input_scale, x, m, k)
    }

    /// [`PreparedActs::prepare_split`] at an explicit SIMD level, as `dtype`.
    #[allow(clippy::too_many_arguments)]
    fn prepare_split_with<'a>(
        &'a mut self,
        level: SimdLevel,
        weight: DType,
        dtype: DType,
        input_scale: Option<f32>,
        x: &'a [f32],
        m: usize,
        k: usize,
    ) -> Result<SplitPrep<'a>, QuantError> {
        if level > crate::detected_level() {
            return Err(QuantError::LevelUnavailable(level));
        }
        match input_scale {
            Some(_) if dtype != DType::F8E4M3 => {
                return Err(QuantError::InputScale(format!(
                    "given for {weight} weights, whose inputs are not rounded to E4M3"
                )));
            }
            Some(s) if !(s.is_finite() && s > 0.0) => {
                return Err(QuantError::InputScale(format!(
                    "{s}: it must be finite and positive"
                )));
            }
            _ => {}
        }
        let wb = weight.block_size();
        if !k.is_multiple_of(wb) {
            return Err(QuantError::NotBlockMultiple {
                dtype: weight,
                k,
                block: wb,
            });
        }
        let total = m.checked_mul(k).ok_or(QuantError::Overflow("m*k"))?;
        if x.len() != total {
            return Err(QuantError::BadLength {
                what: "activations (m*k)",
                expected: total,
                got: x.len(),
                unit: "f32",
            });
        }
        self.dtype = Some(dtype);
        self.m = m;
        self.k = k;
        self.f.clear();
        self.h.clear();
        self.hp.clear();
        self.qs.clear();
        self.qs_pair.clear();
        self.d.clear();
        self.s.clear();
        self.isum.clear();
        self.bsums.clear();
        let block = match dtype {
            DType::F32 => {
                self.f.extend_from_slice(x);
                0
            }
            DType::BF16 => {
                self.f.extend_from_slice(x);
                self.h
                    .extend(x.iter().map(|&v| half::bf16::from_f32(v).to_bits()));
                // Packed whatever `level` is, so that the kernel a dot takes
                // depends only on the CPU and `k`.
                #[cfg(target_arch = "x86_64")]
                if crate::detected_level() >= SimdLevel::Amx
                    && k.is_multiple_of(crate::x86::amx::K_STEP)
                {
                    crate::x86::amx::pack_acts(&self.h, m, k, &mut self.hp);
                }
                0
            }
            DType::F8E4M3 => {
                self.f.resize(total, 0.0);
                32
            }
            DType::Q8_0 | DType::Q8_1 => {
                let nb = total / 32;
                self.qs.resize(total, 0);
                self.d.resize(nb, 0.0);
                self.s.resize(nb, 0.0);
                self.isum.resize(nb, 0);
                32
            }
            DType::Q8_K => {
                let nb = total / 256;
                self.qs.resize(total, 0);
                self.d.resize(nb, 0.0);
                self.bsums.resize(nb * 16, 0);
                256
            }
            _ => {
                return Err(QuantError::Unsupported {
                    op: "activation preparation",
                    dtype,
                });
            }
        };
        Ok(SplitPrep {
            level,
            dtype,
            input_scale,
            x,
            nb: total.checked_div(block).unwrap_or(0),
            qs: self.qs.as_mut_ptr(),
            f: self.f.as_mut_ptr(),
            d: self.d.as_mut_ptr(),
            s: self.s.as_mut_ptr(),
            isum: self.isum.as_mut_ptr(),
            bsums: self.bsums.as_mut_ptr(),
            claimed: std::array::from_fn(|_| AtomicBool::new(false)),
            _acts: PhantomData,
        })
    }

    /// The activation dtype (F32, BF16, F8E4M3, Q8_0, Q8_1 or Q8_K); `None` before preparation.
    pub fn dtype(&self) -> Option<DType> {
        self.dtype
    }

    /// Number of activation rows.
    pub fn m(&self) -> usize {
        self.m
    }

    /// Elements per activation row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// The activations in ggml's block layout (`block_q8_0`, `block_q8_1`,
    /// `block_q8_K`; little-endian f32 for F32 and F8E4M3, bf16 for BF16), rows one
    /// after another.
    pub fn to_ggml_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self.dtype {
            Some(DType::F32) | Some(DType::F8E4M3) => {
                for v in &self.f {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            Some(DType::BF16) => {
                for v in &self.h {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            Some(DType::Q8_0) | Some(DType::Q8_1) => {
                let q81 = self.dtype == Some(DType::Q8_1);
                for (b, q) in self.qs.chunks_exact(32).enumerate() {
                    out.extend_from_slice(&half::f16::from_f32(self.d[b]).to_bits().to_le_bytes());
                    if q81 {
                        out.extend_from_slice(
                            &half::f16::from_f32(self.s[b]).to_bits().to_le_bytes(),
                        );
                    }
                    out.extend(q.iter().map(|&v| v as u8));
                }
            }
            Some(DType::Q8_K) => {
                for (b, q) in self.qs.chunks_exact(256).enumerate() {
                    out.extend_from_slice(&self.d[b].to_le_bytes());
                    out.extend(q.iter().map(|&v| v as u8));
                    for s in &self.bsums[b * 16..b * 16 + 16] {
                        out.extend_from_slice(&s.to_le_bytes());
                    }
                }
            }
            _ => {}
        }
        out
    }
}

impl PreparedActs {
    /// Q8_0/Q8_1: the quants in the paired layout of the row kernels,
    /// borrowed when preparation built it, built here otherwise.
    pub(crate) fn pairs(&self) -> std::borrow::Cow<'_, [i8]> {
        if self.qs_pair.len() == self.qs.len() {
            std::borrow::Cow::Borrowed(&self.qs_pair)
        } else {
            let mut p = Vec::new();
            build_pairs(&self.qs, self.k, &mut p);
            std::borrow::Cow::Owned(p)
        }
    }
}

/// `dst` = `qs` (rows of `k`) in the paired layout of [`PreparedActs::qs_pair`].
fn build_pairs(qs: &[i8], k: usize, dst: &mut Vec<i8>) {
    dst.clear();
    dst.extend_from_slice(qs);
    if k > 0 {
        for (src, d) in qs.chunks_exact(k).zip(dst.chunks_exact_mut(k)) {
            pair_layout(src, d);
        }
    }
}

/// Writes the paired layout of one row's full groups of 8 blocks (see
/// [`PreparedActs::qs_pair`]); the tail is left as copied.
fn pair_layout(src: &[i8], dst: &mut [i8]) {
    for (g, d) in src.chunks_exact(256).zip(dst.chunks_exact_mut(256)) {
        for j in 0..4 {
            let (a, b) = (32 * j, 32 * (j + 4));
            d[64 * j..64 * j + 16].copy_from_slice(&g[a..a + 16]);
            d[64 * j + 16..64 * j + 32].copy_from_slice(&g[b..b + 16]);
            d[64 * j + 32..64 * j + 48].copy_from_slice(&g[a + 16..a + 32]);
            d[64 * j + 48..64 * j + 64].copy_from_slice(&g[b + 16..b + 32]);
        }
    }
}

/// Quantizes whole super-blocks to Q8_K (ggml's `quantize_row_q8_K_ref`).
fn quantize_q8k_blocks(
    level: SimdLevel,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    bsums: &mut [i16],
) {
    let scalar = crate::formats::kquants::quantize_block_q8k;
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        // SAFETY: level <= detected_level() (checked by the caller) implies
        // AVX2+FMA+F16C; the lengths are as documented (set up by the caller).
        unsafe { crate::x86::acts::quantize_q8k_blocks(x, q, d, bsums, scalar) };
        return;
    }
    let _ = level;
    for (((xb, qb), bs), db) in x
        .chunks_exact(256)
        .zip(q.chunks_exact_mut(256))
        .zip(bsums.chunks_exact_mut(16))
        .zip(d.iter_mut())
    {
        *db = scalar(xb, qb, bs);
    }
}

/// Quantizes one block of 32 values as ggml's x86 `quantize_row_q8_0`:
/// returns the f32 scale `amax/127` and the sum of the quants.
fn q8_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut s = 0i32;
    for (o, &v) in q.iter_mut().zip(x) {
        // Saturating float->int cast; values are within -127..=127 for finite input.
        let r = ((v * id).round_ties_even() as i32).clamp(-127, 127);
        *o = r as i8;
        s += r;
    }
    (amax / 127.0, s)
}

/// Quantizes whole blocks of 32 values (`x.len() == q.len() == 32*n`): quants
/// to `q`, and per block the f16-rounded scale to `d`, ggml's `s` to `s`
/// (Q8_1 when `round_s`: f16(`amax/127 * sum`); Q8_0: `d*sum`) and the sum of
/// the quants to `sum`.
fn quantize_q8_blocks(
    level: SimdLevel,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    sum: &mut [i32],
    round_s: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        // SAFETY: level <= detected_level() (checked by the caller) implies
        // AVX2+FMA+F16C; the lengths are as documented (set up by the caller).
        unsafe { crate::x86::acts::quantize_q8_blocks(x, q, d, s, sum, round_s, q8_block) };
        return;
    }
    let _ = level;
    for ((((xb, qb), db), sb), ib) in x
        .chunks_exact(32)
        .zip(q.chunks_exact_mut(32))
        .zip(d.iter_mut())
        .zip(s.iter_mut())
        .zip(sum.iter_mut())
    {
        let (dv, sv) = q8_block(xb, qb);
        let dr = f16_round(dv);
        *db = dr;
        *sb = if round_s {
            f16_round(dv * sv as f32)
        } else {
            dr * sv as f32
        };
        *ib = sv;
    }
}

/// Prepares `m` rows of `k` activations for weights of dtype `weight`.
pub fn prepare_acts(
    weight: DType,
    x: &[f32],
    m: usize,
    k: usize,
) -> Result<PreparedActs, QuantError> {
    let mut a = PreparedActs::new();
    a.prepare_into(weight, x, m, k)?;
    Ok(a)
}
