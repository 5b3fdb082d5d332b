//! Linear layers through cuBLAS: `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias)`.
//!
//! Numerics: f32 weights multiply f32 activations exactly as an f32 GEMM
//! (`cublasGemmEx`, f32 inputs, `CUBLAS_COMPUTE_32F`, no TF32). For f16 and
//! bf16 weights the f32 activations are first rounded to the weight's type
//! (round to nearest even) in a scratch buffer, then multiplied on tensor
//! cores with f32 accumulation and an f32 output; this is the precision of a
//! PyTorch bf16/f16 model, whose activations are already in that type. Biases
//! are added in f32 by a separate kernel. The scaled blocks of HF quantized
//! checkpoints (`f8_s32`, `u4_s32`, `u8_s32`, `f4_s16`) stay packed in device
//! memory. On NVIDIA sm_80+ they are multiplied where they lie by the
//! tensor-core GEMM of kernels/gemm.cu ([`scaled_gemm_kernel`]: each block's
//! codes exact in bf16, the f32 input split into a bf16 high part and
//! remainder, a block's sum times its scale accumulated in f32; about 16 bits
//! of each input, and a row's outputs do not depend on the batch); elsewhere
//! (AMD, older NVIDIA, or when told not to) they are dequantized to an f32
//! scratch before each GEMM (exactly the CPU's values) and multiplied as f32
//! weights. W8A8 FP8 weights (`f8a8_s32`, the `w8a8_fp8` method) multiply
//! the input quantized to E4M3 per row and 32-input block (or with the
//! layer's static input scale, [`LinearRef::input_scale`]): on sm_89+ its
//! codes on FP8 tensor cores ([`w8a8_gemm_kernel`]), elsewhere (or with the
//! tensor-core linears off) the values those codes stand for
//! (`round_act_e4m3`) through the `f8_s32` paths above.
//! [`GpuBackend::op_linear_many`] rounds or quantizes the shared input once
//! for all its layers (Q/K/V, gate/up) of one input scale. Per-head
//! products (`linear_heads`, latent attention's up-projections) of float
//! weights are one strided-batched GEMM over the heads' column blocks.

use crate::GpuBackend;
use crate::driver::Gemm;
use crate::exec::{Args, Op, State};
use crate::kernels::{K, nvidia_sm};
use crate::ops::stride_grid;
use arbor_engine_core::{CoreError, DType, LinearRef, Result, Tensor, columns};
use std::sync::atomic::Ordering;

/// The kernel that dequantizes a scaled weight dtype to f32, if it is one.
fn dequant_kernel(dtype: DType) -> Option<K> {
    match dtype {
        DType::F8_S32 => Some(K::DequantF8S32),
        DType::U4_S32 => Some(K::DequantU4S32),
        DType::U8_S32 => Some(K::DequantU8S32),
        DType::F4_S16 => Some(K::DequantF4S16),
        _ => None,
    }
}

/// Rows at most this many take the GEMMs' 16 x 32 tiles, more their 64 x 64.
const SCALED_GEMM_SMALL_ROWS: usize = 16;

/// Whether `rows` take the small tiles, and the tile (rows, columns).
fn scaled_tile(rows: usize) -> (bool, [usize; 2]) {
    if rows <= SCALED_GEMM_SMALL_ROWS {
        (true, [16, 32])
    } else {
        (false, [64, 64])
    }
}

/// The tensor-core GEMM of a scaled weight dtype for `rows` input rows and
/// its tile (rows, columns), where it applies: an NVIDIA target of sm_80 or
/// newer (`arch` as `sm_90` or `compute_90`). 128 threads, static shared
/// memory only.
pub(crate) fn scaled_gemm_kernel(dtype: DType, rows: usize, arch: &str) -> Option<(K, [usize; 2])> {
    if nvidia_sm(arch)? < 80 {
        return None;
    }
    let (small, tile) = scaled_tile(rows);
    let kernel = match (dtype, small) {
        (DType::F8_S32, true) => K::GemmF8S32M16,
        (DType::F8_S32, false) => K::GemmF8S32M64,
        (DType::U4_S32, true) => K::GemmU4S32M16,
        (DType::U4_S32, false) => K::GemmU4S32M64,
        (DType::U8_S32, true) => K::GemmU8S32M16,
        (DType::U8_S32, false) => K::GemmU8S32M64,
        (DType::F4_S16, true) => K::GemmF4S16M16,
        (DType::F4_S16, false) => K::GemmF4S16M64,
        _ => return None,
    };
    Some((kernel, tile))
}

/// The W8A8 FP8 GEMM (E4M3 inputs quantized per 32, kernels/gemm.cu) of
/// `f8a8_s32` weights for `rows` rows and its tile, where it applies: an
/// NVIDIA target of sm_89 or newer.
pub(crate) fn w8a8_gemm_kernel(dtype: DType, rows: usize, arch: &str) -> Option<(K, [usize; 2])> {
    if dtype != DType::F8A8_S32 || nvidia_sm(arch)? < 89 {
        return None;
    }
    let (small, tile) = scaled_tile(rows);
    let kernel = if small {
        K::GemmF8S32W8a8M16
    } else {
        K::GemmF8S32W8a8M64
    };
    Some((kernel, tile))
}

impl GpuBackend {
    pub(crate) fn op_linear_many(&self, x: &Tensor, layers: &[LinearRef<'_>]) -> Result<()> {
        x.check_dtype(DType::F32)?;
        let (m, k) = (x.rows(), x.row_len());
        for (i, l) in layers.iter().enumerate() {
            let [n, wk] = *l.w.shape() else {
                return Err(CoreError::invalid(format!(
                    "linear weight {:?} is not 2-D",
                    l.w
                )));
            };
            if wk != k {
                return Err(CoreError::invalid(format!(
                    "linear input {x:?} does not match weight {:?}",
                    l.w
                )));
            }
            l.out.check_dtype(DType::F32)?;
            if l.out.rows() != m || l.out.row_len() != n {
                return Err(CoreError::invalid(format!(
                    "linear output {:?}, expected [{m}, {n}]",
                    l.out
                )));
            }
            if !matches!(l.w.dtype(), DType::F32 | DType::F16 | DType::BF16)
                && dequant_kernel(l.w.dtype().storage()).is_none()
            {
                return Err(CoreError::unsupported(format!(
                    "CUDA linear with {} weights",
                    l.w.dtype()
                )));
            }
            let mut inputs = vec![x, l.w];
            if let Some(b) = l.bias {
                b.check_dtype(DType::F32)?;
                if b.numel() != n {
                    return Err(CoreError::invalid(format!("bias {b:?} for {n} outputs")));
                }
                inputs.push(b);
            }
            for other in &layers[..i] {
                inputs.push(other.out);
            }
            l.out.check_no_overlap(&inputs)?;
        }
        if layers.is_empty() || m == 0 {
            return Ok(());
        }
        let mut st = self.dev.lock()?;
        let mut row_tensors = vec![x];
        row_tensors.extend(layers.iter().map(|l| l.out));
        let rows = st.rows(m, &row_tensors);
        let xp = self.p(&st, x)?;
        // The rounded input, when some weight is 16-bit (one rounding per type).
        let mut half_in: Option<(DType, u64, Tensor)> = None;
        // The E4M3 input codes and scales, when some layer runs W8A8 on FP8
        // tensor cores, and the values they stand for, when one runs it
        // elsewhere: one of each per static input scale (or none).
        let mut fp8_in: Vec<(Option<u32>, [u64; 2], [Tensor; 2])> = Vec::new();
        let mut rounded_in: Vec<(Option<u32>, u64, Tensor)> = Vec::new();
        for l in layers {
            let input_scale = l.static_input_scale()?;
            let key = input_scale.map(f32::to_bits);
            let n = l.w.shape()[0];
            let out = self.p(&st, l.out)?;
            // Packed blocks multiplied where they lie: W8A8 FP8, else the bf16 split.
            let target = self.kernel_target();
            let tensor_cores = self.tensor_core_linear.load(Ordering::Relaxed);
            let w8a8 = w8a8_gemm_kernel(l.w.dtype(), rows, target).filter(|_| tensor_cores);
            let storage = l.w.dtype().storage();
            let split = scaled_gemm_kernel(storage, rows, target).filter(|_| tensor_cores);
            // The f32 input of the other paths: W8A8 FP8 weights take it rounded to E4M3.
            let x_f32 = if l.w.dtype() == DType::F8A8_S32 && w8a8.is_none() {
                match rounded_in.iter().find(|r| r.0 == key) {
                    Some(r) => r.1,
                    None => {
                        let (yp, y) = self.round_input_e4m3(&mut st, xp, rows, k, input_scale)?;
                        rounded_in.push((key, yp, y));
                        yp
                    }
                }
            } else {
                xp
            };
            let packed = match (w8a8, split) {
                (Some(kernel), _) => {
                    let inputs = match fp8_in.iter().find(|q| q.0 == key) {
                        Some(q) => q.1,
                        None => {
                            let (p, t) =
                                self.quantize_input_e4m3(&mut st, xp, rows, k, input_scale)?;
                            fp8_in.push((key, p, t));
                            p
                        }
                    };
                    Some((kernel, inputs.to_vec()))
                }
                (None, Some(kernel)) => Some((kernel, vec![x_f32])),
                (None, None) => None,
            };
            if let Some(((kernel, [bm, bn]), inputs)) = packed {
                let args = inputs.into_iter().fold(Args::new(), Args::p);
                let args = args.p(self.p(&st, l.w)?).p(out).i(rows).i(n).i(k);
                let grid = [n.div_ceil(bn), rows.div_ceil(bm), 1];
                self.dev.launch(&mut st, kernel, grid, 128, 0, args)?;
                self.add_bias(&mut st, l, rows, n)?;
                continue;
            }
            // Scaled blocks: dequantized to an f32 scratch (exact), then the f32 GEMM.
            let mut wd = storage;
            let mut wp = self.p(&st, l.w)?;
            let _scratch = match dequant_kernel(wd) {
                Some(kernel) => {
                    let scratch = self.alloc_in(&mut st, DType::F32, &[n * k], false)?;
                    let sp = self.p(&st, &scratch)?;
                    let args = Args::new().p(wp).p(sp).l((n * k) as u64);
                    self.dev.launch(
                        &mut st,
                        kernel,
                        [stride_grid(self, n * k), 1, 1],
                        256,
                        0,
                        args,
                    )?;
                    (wd, wp) = (DType::F32, sp);
                    Some(scratch)
                }
                None => None,
            };
            let xin = if wd == DType::F32 {
                x_f32
            } else {
                if half_in.as_ref().map(|h| h.0) != Some(wd) {
                    let (sp, scratch) = self.cast_input(&mut st, xp, wd, rows * k)?;
                    half_in = Some((wd, sp, scratch));
                }
                half_in.as_ref().map(|h| h.1).unwrap_or(xp)
            };
            let op = Op::Gemm(Gemm {
                dtype: wd,
                m: rows,
                n,
                k,
                heads: 1,
                w: wp,
                x: xin,
                out,
            });
            self.dev.submit(&mut st, op)?;
            self.add_bias(&mut st, l, rows, n)?;
        }
        Ok(())
    }

    /// [`arbor_engine_core::Backend::linear_heads`]: the heads' products as
    /// one strided-batched GEMM over `x` and `out` where they lie (rows
    /// padded with the step, so a padded decode step keeps its graph);
    /// f16/bf16 weights meet the input rounded to their type, as in
    /// `linear`. Weights of other dtypes take the portable form
    /// ([`columns::linear_heads_by_rows`]).
    pub(crate) fn op_linear_heads(
        &self,
        x: &Tensor,
        w: &Tensor,
        heads: usize,
        out: &Tensor,
    ) -> Result<()> {
        let (t, a, k) = columns::heads_dims(x, w, heads, out)?;
        let wd = w.dtype();
        if !matches!(wd, DType::F32 | DType::F16 | DType::BF16) {
            return columns::linear_heads_by_rows(self, x, w, heads, out);
        }
        out.check_no_overlap(&[x, w])?;
        if t == 0 {
            return Ok(());
        }
        let mut st = self.dev.lock()?;
        let rows = st.rows(t, &[x, out]);
        let xp = self.p(&st, x)?;
        let (xin, _scratch) = if wd == DType::F32 {
            (xp, None)
        } else {
            let (sp, scratch) = self.cast_input(&mut st, xp, wd, rows * heads * a)?;
            (sp, Some(scratch))
        };
        let op = Op::Gemm(Gemm {
            dtype: wd,
            m: rows,
            n: k,
            k: a,
            heads,
            w: self.p(&st, w)?,
            x: xin,
            out: self.p(&st, out)?,
        });
        self.dev.submit(&mut st, op)
    }

    /// The `n` f32 inputs at `xp` rounded to `dtype` (f16 or bf16, round to
    /// nearest even) in a scratch: its address, and the scratch (alive while
    /// the address is used).
    fn cast_input(&self, st: &mut State, xp: u64, dtype: DType, n: usize) -> Result<(u64, Tensor)> {
        let scratch = self.alloc_in(st, dtype, &[n], false)?;
        let sp = self.p(st, &scratch)?;
        let cast = if dtype == DType::BF16 {
            K::CastBf16
        } else {
            K::CastF16
        };
        let args = Args::new().p(xp).p(sp).l(n as u64);
        self.dev
            .launch(st, cast, [stride_grid(self, n), 1, 1], 256, 0, args)?;
        Ok((sp, scratch))
    }

    /// `x` (at `xp`, `rows` x `k`) quantized to E4M3 per 32 inputs by
    /// `quant_act_e4m3` (with `input_scale` for every run where a layer has
    /// a static one): the codes' and scales' addresses, and their scratch
    /// tensors (alive while the addresses are used).
    fn quantize_input_e4m3(
        &self,
        st: &mut State,
        xp: u64,
        rows: usize,
        k: usize,
        input_scale: Option<f32>,
    ) -> Result<([u64; 2], [Tensor; 2])> {
        let q = self.alloc_in(st, DType::F8E4M3, &[rows * k], false)?;
        let s = self.alloc_in(st, DType::F32, &[rows * k / 32], false)?;
        let p = [self.p(st, &q)?, self.p(st, &s)?];
        self.launch_e4m3_blocks(st, K::QuantActE4m3, xp, &p, rows, k, input_scale)?;
        Ok((p, [q, s]))
    }

    /// `x` (at `xp`, `rows` x `k`) rounded to E4M3 per 32 inputs by
    /// `round_act_e4m3` (the codes of [`Self::quantize_input_e4m3`] times
    /// their scales, in f32): its address and scratch tensor.
    fn round_input_e4m3(
        &self,
        st: &mut State,
        xp: u64,
        rows: usize,
        k: usize,
        input_scale: Option<f32>,
    ) -> Result<(u64, Tensor)> {
        if !k.is_multiple_of(32) {
            return Err(CoreError::invalid(format!(
                "W8A8 FP8 linear with k = {k}, not a multiple of 32"
            )));
        }
        let y = self.alloc_in(st, DType::F32, &[rows * k], false)?;
        let yp = self.p(st, &y)?;
        self.launch_e4m3_blocks(st, K::RoundActE4m3, xp, &[yp], rows, k, input_scale)?;
        Ok((yp, y))
    }

    /// Launches `kernel` (`quant_act_e4m3` or `round_act_e4m3`: `x`, its
    /// outputs `outs`, `rows`, `k`, then a static input scale's reciprocal,
    /// computed here as the CPU does (`arbor_quant::scaled`), and the scale;
    /// zeros for a scale per run of 32) over the runs of `x` at `xp`.
    #[allow(clippy::too_many_arguments)]
    fn launch_e4m3_blocks(
        &self,
        st: &mut State,
        kernel: K,
        xp: u64,
        outs: &[u64],
        rows: usize,
        k: usize,
        input_scale: Option<f32>,
    ) -> Result<()> {
        let (inv, scale) = input_scale.map_or((0.0, 0.0), |s| (1.0 / s, s));
        let args = outs.iter().fold(Args::new().p(xp), |a, &p| a.p(p));
        let args = args.i(rows).i(k).f(inv).f(scale);
        let grid = [stride_grid(self, rows * k), 1, 1];
        self.dev.launch(st, kernel, grid, 256, 0, args)
    }

    /// Adds `l`'s bias (if any) to its `rows` x `n` output.
    fn add_bias(&self, st: &mut State, l: &LinearRef<'_>, rows: usize, n: usize) -> Result<()> {
        let Some(b) = l.bias else { return Ok(()) };
        let args = Args::new()
            .p(self.p(st, l.out)?)
            .p(self.p(st, b)?)
            .i(rows)
            .i(n);
        let grid = [stride_grid(self, rows * n), 1, 1];
        self.dev.launch(st, K::AddBias, grid, 256, 0, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tensor_core_gemm_applies_to_scaled_blocks_on_sm80_and_newer() {
        let small = scaled_gemm_kernel(DType::F8_S32, 16, "sm_90");
        assert_eq!(small, Some((K::GemmF8S32M16, [16, 32])));
        let large = scaled_gemm_kernel(DType::F4_S16, 17, "compute_80");
        assert_eq!(large, Some((K::GemmF4S16M64, [64, 64])));
        assert!(scaled_gemm_kernel(DType::U4_S32, 1, "sm_86").is_some());
        assert!(scaled_gemm_kernel(DType::U8_S32, 1, "sm_75").is_none());
        assert!(scaled_gemm_kernel(DType::F8_S32, 1, "gfx90a").is_none());
        for float in [DType::F32, DType::F16, DType::BF16] {
            assert!(scaled_gemm_kernel(float, 1, "sm_90").is_none());
        }
    }

    #[test]
    fn w8a8_applies_to_fp8_blocks_on_sm89_and_newer() {
        let small = w8a8_gemm_kernel(DType::F8A8_S32, 16, "sm_89");
        assert_eq!(small, Some((K::GemmF8S32W8a8M16, [16, 32])));
        let large = w8a8_gemm_kernel(DType::F8A8_S32, 17, "compute_90");
        assert_eq!(large, Some((K::GemmF8S32W8a8M64, [64, 64])));
        assert!(w8a8_gemm_kernel(DType::F8A8_S32, 1, "sm_86").is_none());
        assert!(w8a8_gemm_kernel(DType::F8A8_S32, 1, "gfx942").is_none());
        // Weight-only FP8 keeps f32 inputs.
        assert!(w8a8_gemm_kernel(DType::F8_S32, 1, "sm_90").is_none());
        assert!(w8a8_gemm_kernel(DType::U4_S32, 1, "sm_90").is_none());
    }
}
