//! Linear layers: `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias)` for every weight
//! dtype the backend lists.
//!
//! Float weights (f32, f16, bf16) and the scaled blocks of HF quantized
//! checkpoints (`f8_s32`, `u4_s32`, `u8_s32`, `f4_s16`, dequantized element by element
//! with the CPU's formulas) are multiplied with f32 activations and f32
//! accumulation (`matmul_f.wgsl`). Block-quantized weights (Q8_0, Q4_0, Q4_1)
//! are multiplied as ggml and the CPU backend do: the activations are first
//! quantized to Q8 blocks (`quant_act.wgsl`, once per input even when several
//! layers share it), then each block contributes an integer dot product scaled
//! by the two block scales (`matmul_q.wgsl`). W8A8 FP8 weights (`f8a8_s32`)
//! multiply the inputs rounded to E4M3 per run of 32, or with the layer's
//! static input scale (`round_act_e4m3.wgsl`, once per input and scale), as
//! `f8_s32` weights multiply f32 ones.
//!
//! Each kernel invocation computes a register tile of TM activation rows by
//! TN weight rows with no shared memory (the fastest form on lavapipe, and
//! simple on GPUs), generated as straight-line code ([`crate::matmul_gen`]):
//! decode batches (m <= 8) use TM = m, TN = 4; larger batches 8 x 4 tiles. A
//! weight larger than one storage binding is processed in chunks of rows.

use crate::context::{Access, Params, View};
use crate::kernels::{self, Kernel};
use crate::{WgpuBackend, u32_of};
use arbor_engine_core::{CoreError, DType, LinearRef, Result, Tensor};

/// Largest batch multiplied with one activation row-tile per invocation.
const SMALL_M: usize = 8;
/// Weight rows per invocation for those batches.
const SMALL_TN: usize = 4;
/// Tile of the larger batches (8 x 4 measured fastest on lavapipe: ~6 GFLOP/s
/// for Q4_1 prefill, against ~2 for 1 x 1 tiles).
const BIG_TM: usize = 8;
const BIG_TN: usize = 4;

fn tiles(m: usize) -> (usize, usize) {
    if m <= SMALL_M {
        (m.max(1), SMALL_TN)
    } else {
        (BIG_TM, BIG_TN)
    }
}

pub fn linear_many(b: &WgpuBackend, x: &Tensor, layers: &[LinearRef<'_>]) -> Result<()> {
    let (m, k) = (x.rows(), x.row_len());
    for l in layers {
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
        if l.out.dtype() != DType::F32 || l.out.rows() != m || l.out.row_len() != n {
            return Err(CoreError::invalid(format!(
                "linear output {:?}, expected [{m}, {n}]",
                l.out
            )));
        }
        kernels::weight_code(l.w.dtype())?;
        l.w.dtype().bytes_for(k)?;
        let mut inputs = vec![x, l.w];
        if let Some(bias) = l.bias {
            if bias.numel() != n || bias.dtype() != DType::F32 {
                return Err(CoreError::invalid(format!("bias {bias:?} for {n} outputs")));
            }
            inputs.push(bias);
        }
        l.out.check_no_overlap(&inputs)?;
    }
    if m == 0 {
        return Ok(());
    }
    let xv = b.view(x, DType::F32, Access::Read)?;
    // Q8 activations, shared by every quantized layer of this input, and
    // the E4M3-rounded ones, shared by the W8A8 FP8 layers of one input
    // scale (a static one, or none).
    let mut acts: Option<(Tensor, Tensor)> = None;
    let mut rounded: Vec<(Option<u32>, Tensor)> = Vec::new();
    let mut scales = Vec::with_capacity(layers.len());
    for l in layers {
        if kernels::uses_q8_acts(kernels::weight_code(l.w.dtype())?) && acts.is_none() {
            acts = Some(quantize_acts(b, &xv, m, k)?);
        }
        let input_scale = l.static_input_scale()?;
        let key = input_scale.map(f32::to_bits);
        if l.w.dtype() == DType::F8A8_S32 && !rounded.iter().any(|r| r.0 == key) {
            rounded.push((key, round_acts_e4m3(b, &xv, m, k, input_scale)?));
        }
        scales.push(key);
    }
    let rviews = rounded
        .iter()
        .map(|(key, t)| Ok((*key, b.view(t, DType::F32, Access::Read)?)))
        .collect::<Result<Vec<_>>>()?;
    for (l, key) in layers.iter().zip(&scales) {
        let n = l.w.shape()[0];
        let row_bytes = l.w.dtype().bytes_for(k)?;
        // Rows per chunk so that one chunk fits a storage binding.
        let max_binding = b.gpu().limits.max_storage_buffer_binding_size as usize;
        let per_chunk = ((max_binding.saturating_sub(256)) / row_bytes.max(1)).max(1);
        let mut c0 = 0;
        while c0 < n {
            let rows = per_chunk.min(n - c0);
            let w = l.w.narrow(c0, rows)?;
            let bias = l.bias.map(|t| t.narrow(c0, rows)).transpose()?;
            match &acts {
                Some((q, meta)) if kernels::uses_q8_acts(kernels::weight_code(w.dtype())?) => {
                    matmul_q(b, q, meta, &w, bias.as_ref(), l.out, (m, n, k), c0)?
                }
                _ => {
                    let rounded = rviews.iter().find(|r| r.0 == *key);
                    let x = match rounded {
                        Some((_, rv)) if w.dtype() == DType::F8A8_S32 => rv,
                        _ => &xv,
                    };
                    matmul_f(b, x, &w, bias.as_ref(), l.out, (m, n, k), c0)?
                }
            }
            c0 += rows;
        }
    }
    Ok(())
}

/// Quantizes `x` `[m, k]` to Q8 blocks: (packed quants, per-block meta).
fn quantize_acts(b: &WgpuBackend, xv: &View, m: usize, k: usize) -> Result<(Tensor, Tensor)> {
    let blocks = act_blocks(m, k, "quantized")?;
    let q = b.alloc_uninit(DType::U32, &[blocks * 8])?;
    let meta = b.alloc_uninit(DType::F32, &[blocks * 4])?;
    let qv = b.view(&q, DType::U32, Access::Write)?;
    let mv = b.view(&meta, DType::F32, Access::Write)?;
    per_act_block(b, Kernel::QuantAct, xv, blocks, k, &[&qv, &mv], &[])?;
    Ok((q, meta))
}

/// `x` `[m, k]` with each run of 32 inputs rounded to E4M3 (the inputs of
/// W8A8 FP8 weights; with a static input scale and its reciprocal computed
/// here, as the CPU does, or a scale per run), as a dense f32 `[m, k]`.
fn round_acts_e4m3(
    b: &WgpuBackend,
    xv: &View,
    m: usize,
    k: usize,
    input_scale: Option<f32>,
) -> Result<Tensor> {
    let blocks = act_blocks(m, k, "W8A8 FP8")?;
    let y = b.alloc_uninit(DType::F32, &[m * k])?;
    let yv = b.view(&y, DType::F32, Access::Write)?;
    let (inv, scale) = input_scale.map_or((0.0, 0.0), |s| (1.0 / s, s));
    per_act_block(
        b,
        Kernel::RoundActE4m3,
        xv,
        blocks,
        k,
        &[&yv],
        &[inv, scale],
    )?;
    Ok(y)
}

/// The blocks of 32 inputs of `x` `[m, k]`; an error naming the `kind` of
/// linear unless `k` is a multiple of 32.
fn act_blocks(m: usize, k: usize, kind: &str) -> Result<usize> {
    if !k.is_multiple_of(32) {
        return Err(CoreError::invalid(format!(
            "{kind} linear with k = {k}, not a multiple of 32"
        )));
    }
    Ok(m * k / 32)
}

/// Runs `kernel`, one invocation per block of 32 inputs of `x` (rows of
/// `k`), writing `outs`; `tail` follows the block parameters in the
/// kernel's uniform.
fn per_act_block(
    b: &WgpuBackend,
    kernel: Kernel,
    xv: &View,
    blocks: usize,
    k: usize,
    outs: &[&View],
    tail: &[f32],
) -> Result<()> {
    let gpu = b.gpu();
    let pipe = gpu.kernel(&kernel)?;
    let params = Params::new()
        .u(u32_of(blocks, "activation blocks")?)
        .us(k / 32)?
        .u(xv.word_off())
        .us(k)?;
    let params = tail.iter().fold(params, |p, &v| p.f(v));
    let groups = kernels::grid_threads(blocks, gpu.limits.max_compute_workgroups_per_dimension)?;
    let views: Vec<&View> = std::iter::once(xv).chain(outs.iter().copied()).collect();
    gpu.dispatch(&pipe, &params, &views, groups)
}

fn groups(b: &WgpuBackend, m: usize, n: usize, tm: usize, tn: usize) -> Result<(u32, u32, u32)> {
    let gx = n.div_ceil(tn).div_ceil(kernels::WG as usize);
    let gy = m.div_ceil(tm);
    let max = b.gpu().limits.max_compute_workgroups_per_dimension as usize;
    if gx > max || gy > max {
        return Err(CoreError::unsupported(format!(
            "a linear of [{m}, {n}] needs more workgroups than one dispatch allows"
        )));
    }
    Ok((gx as u32, gy as u32, 1))
}

/// One chunk of weight rows (`w`, `n_chunk` rows) writing output columns `c0..`.
#[allow(clippy::too_many_arguments)]
fn matmul_q(
    b: &WgpuBackend,
    q: &Tensor,
    meta: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
    (m, n, k): (usize, usize, usize),
    c0: usize,
) -> Result<()> {
    let rows = w.shape()[0];
    let (tm, tn) = tiles(m);
    let code = kernels::weight_code(w.dtype())?;
    let qv = b.view(q, DType::U32, Access::Read)?;
    let mv = b.view(meta, DType::F32, Access::Read)?;
    let wv = b.view_any(w, Access::Read)?;
    if !wv.off.is_multiple_of(2) {
        return Err(CoreError::invalid(format!("weight {w:?} at an odd offset")));
    }
    let row_bytes = w.dtype().bytes_for(k)?;
    let aligned = wv.off.is_multiple_of(4) && row_bytes.is_multiple_of(4);
    let ov = b.view(out, DType::F32, Access::Write)?;
    let bv = bias
        .map(|t| b.view(t, DType::F32, Access::Read))
        .transpose()?;
    let gpu = b.gpu();
    let pair = aligned && (k / 32).is_multiple_of(2);
    let pipe = gpu.kernel(&Kernel::MatmulQ {
        tm,
        tn,
        wdt: code,
        aligned,
        pair,
        bias: bv.is_some(),
    })?;
    let params = Params::new()
        .us(m)?
        .us(rows)?
        .us(k / 32)?
        .us(row_bytes)?
        .u(wv.off)
        .u(ov.word_off() + u32_of(c0, "output column")?)
        .us(n)?
        .u(bv.as_ref().map_or(0, |v| v.word_off()));
    let g = groups(b, m, rows, tm, tn)?;
    match &bv {
        Some(bv) => gpu.dispatch(&pipe, &params, &[&qv, &mv, &wv, &ov, bv], g),
        None => gpu.dispatch(&pipe, &params, &[&qv, &mv, &wv, &ov], g),
    }
}

fn matmul_f(
    b: &WgpuBackend,
    xv: &View,
    w: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
    (m, n, k): (usize, usize, usize),
    c0: usize,
) -> Result<()> {
    let rows = w.shape()[0];
    let (tm, tn) = tiles(m);
    let code = kernels::weight_code(w.dtype())?;
    let wv = b.view_any(w, Access::Read)?;
    if !wv.off.is_multiple_of(2) {
        return Err(CoreError::invalid(format!("weight {w:?} at an odd offset")));
    }
    let fast = k.is_multiple_of(4) && wv.off.is_multiple_of(4);
    let ov = b.view(out, DType::F32, Access::Write)?;
    let bv = bias
        .map(|t| b.view(t, DType::F32, Access::Read))
        .transpose()?;
    let gpu = b.gpu();
    let pipe = gpu.kernel(&Kernel::MatmulF {
        tm,
        tn,
        wdt: code,
        fast,
        bias: bv.is_some(),
    })?;
    let params = Params::new()
        .us(m)?
        .us(rows)?
        .us(k)?
        .u(wv.off)
        .u(xv.word_off())
        .u(ov.word_off() + u32_of(c0, "output column")?)
        .us(n)?
        .u(bv.as_ref().map_or(0, |v| v.word_off()));
    let g = groups(b, m, rows, tm, tn)?;
    match &bv {
        Some(bv) => gpu.dispatch(&pipe, &params, &[xv, &wv, &ov, bv], g),
        None => gpu.dispatch(&pipe, &params, &[xv, &wv, &ov], g),
    }
}
