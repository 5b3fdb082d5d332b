//! Linear layers: `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias)` for every weight
//! dtype, one at a time or several sharing one input (Q/K/V, gate/up).
//!
//! One path for every weight dtype and every `m`: activations are prepared
//! once per activation type for all `m` rows (quantized to Q8 for quantized
//! weights, as ggml does; copied as f32 for float weights; layers sharing an
//! input and a type share the preparation), and the weight rows of all the
//! layers form one range split across the pool, so a whole Q/K/V projection
//! is one parallel region. The scaled block formats meet f32 activations,
//! or bf16 ones under the backend's `QuantMatmul::AmxBf16` (packed for AMX
//! tiles; a bf16 weight and a scaled one then share the preparation); W8A8
//! FP8 weights (`f8a8_s32`) meet the input rounded to E4M3 per 32, or with
//! their static input scale (layers of one scale share the rounding). From
//! [`PAR_PREP_BLOCKS`] blocks on (a prefill
//! chunk) the quantization itself is one more region, split into whole
//! blocks (`arbor_quant::SplitPrep`). Each piece calls
//! `arbor_quant::dot_rows_raw` on its weight rows, which writes its output
//! columns in place (the tiled GEMM for the 32-element formats, whose
//! shares are whole 32-row panels; row kernels for the K-quants; tiled dot
//! kernels for float weights).
//!
//! Batch invariance: `dot_rows_raw` computes each output element with one
//! fixed sequence of operations whatever `m`, the other rows and the weight
//! rows a piece holds (see `arbor_quant`), activation blocks are quantized
//! one by one whatever thread takes them, and the bias is added per
//! element, so row `i` of the output is bit-identical for any batch it is
//! computed in and any thread split.

use crate::CpuBackend;
use crate::memory::SendPtr;
use crate::pool::share;
use arbor_engine_core::{CoreError, DType, LinearRef, Result, Tensor};
use arbor_quant::PreparedActs;
use std::sync::Mutex;

/// Row alignment of piece shares.
const ROW_ALIGN: usize = 16;
/// Row alignment of piece shares when a layer takes the tiled GEMM (its panel height).
const GEMM_ALIGN: usize = 32;
/// Blocks of activations from which their quantization runs on every
/// thread: a prefill chunk's (512 rows of `k = 576` are 9216 blocks; +8%
/// prefill on the default model), not a batch of 16 decodes' (288 to 768
/// blocks, where the extra parallel region costs what it saves).
const PAR_PREP_BLOCKS: usize = 1024;

thread_local! {
    /// Per-thread prepared activations (one per activation type of a call),
    /// reused across calls.
    static ACTS: std::cell::RefCell<Vec<PreparedActs>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One validated layer.
struct Job<'a> {
    dtype: DType,
    w: &'a [u8],
    row_bytes: usize,
    n: usize,
    out: SendPtr<f32>,
    bias: Option<&'a [f32]>,
    /// A W8A8 FP8 weight's static input scale.
    input_scale: Option<f32>,
}

pub fn linear(
    b: &CpuBackend,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
) -> Result<()> {
    linear_many(b, x, &[LinearRef::new(w, bias, out)])
}

pub fn linear_many(b: &CpuBackend, x: &Tensor, layers: &[LinearRef<'_>]) -> Result<()> {
    let xv = b.view(x, DType::F32)?;
    let k = x.row_len();
    let m = x.rows();
    // SAFETY: the view covers m * k aligned f32 values; `x` outlives this call.
    let xs = unsafe { std::slice::from_raw_parts(xv.ptr as *const f32, m * k) };
    let mut jobs = Vec::with_capacity(layers.len());
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
        if l.out.rows() != m || l.out.row_len() != n {
            return Err(CoreError::invalid(format!(
                "linear output {:?}, expected [{m}, {n}]",
                l.out
            )));
        }
        let mut inputs = vec![x, l.w];
        if let Some(bias) = l.bias {
            if bias.numel() != n {
                return Err(CoreError::invalid(format!("bias {bias:?} for {n} outputs")));
            }
            inputs.push(bias);
        }
        for other in &layers[..i] {
            inputs.push(other.out);
        }
        l.out.check_no_overlap(&inputs)?;
        let ov = b.view(l.out, DType::F32)?;
        let wv = b.bytes_of(l.w)?;
        let bias = match l.bias {
            Some(t) => {
                let bv = b.view(t, DType::F32)?;
                // SAFETY: n aligned f32 values.
                Some(unsafe { std::slice::from_raw_parts(bv.ptr as *const f32, n) })
            }
            None => None,
        };
        jobs.push(Job {
            dtype: l.w.dtype(),
            // SAFETY: the weight view; `l.w` outlives this call.
            w: unsafe { std::slice::from_raw_parts(wv.ptr as *const u8, wv.bytes) },
            row_bytes: l.w.dtype().bytes_for(k)?,
            n,
            out: SendPtr(ov.ptr as *mut f32),
            bias,
            input_scale: l.static_input_scale()?,
        });
    }
    let refs: Vec<&Job<'_>> = jobs.iter().collect();
    if m > 0 {
        row_kernels(b, xs, m, k, &refs)?;
    }
    for j in &jobs {
        if let Some(bs) = j.bias {
            for i in 0..m {
                // SAFETY: row i of this output; no other reference to it is live.
                let row = unsafe { std::slice::from_raw_parts_mut(j.out.get().add(i * j.n), j.n) };
                for (o, &bb) in row.iter_mut().zip(bs) {
                    *o += bb;
                }
            }
        }
    }
    Ok(())
}

fn first_error(err: &Mutex<Option<String>>, e: String) {
    let mut g = err.lock().unwrap_or_else(|p| p.into_inner());
    g.get_or_insert(e);
}

fn take_error(err: Mutex<Option<String>>) -> Result<()> {
    match err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(msg) => Err(CoreError::unsupported(format!("linear: {msg}"))),
        None => Ok(()),
    }
}

/// All `jobs` in one parallel region over the concatenation of their weight rows.
fn row_kernels(b: &CpuBackend, xs: &[f32], m: usize, k: usize, jobs: &[&Job<'_>]) -> Result<()> {
    // Reuse this thread's activation buffers (no allocation or page faults
    // per call); a nested call, which cannot happen today, gets fresh ones.
    ACTS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut pool) => row_kernels_with(b, xs, m, k, jobs, &mut pool),
        Err(_) => row_kernels_with(b, xs, m, k, jobs, &mut Vec::new()),
    })
}

fn row_kernels_with(
    b: &CpuBackend,
    xs: &[f32],
    m: usize,
    k: usize,
    jobs: &[&Job<'_>],
    pool: &mut Vec<PreparedActs>,
) -> Result<()> {
    // One preparation per activation type and static input scale (Q/K/V
    // or gate/up share theirs).
    let mut types: Vec<(DType, Option<u32>)> = Vec::new();
    let mut which = Vec::with_capacity(jobs.len());
    for j in jobs {
        let ad = arbor_quant::act_dtype_with(j.dtype, b.quant_matmul())
            .map_err(|e| CoreError::unsupported(format!("linear: {e}")))?;
        let key = (ad, j.input_scale.map(f32::to_bits));
        let idx = match types.iter().position(|t| *t == key) {
            Some(i) => i,
            None => {
                if pool.len() <= types.len() {
                    pool.push(PreparedActs::new());
                }
                let prep = pool[types.len()]
                    .prepare_split_as(j.dtype, b.quant_matmul(), j.input_scale, xs, m, k)
                    .map_err(CoreError::from)?;
                // Quantize on every thread when there is enough of it; the
                // parts left over (all of them below the threshold) run
                // here when `prep` is dropped.
                if prep.blocks() >= PAR_PREP_BLOCKS {
                    b.parallel(&|t, pieces| prep.run(t, pieces))?;
                }
                drop(prep);
                types.push(key);
                types.len() - 1
            }
        };
        which.push(idx);
    }
    let prepared = &pool[..types.len()];
    let total: usize = jobs.iter().map(|j| j.n).sum();
    // Whole 32-row panels for the tiled GEMM; 16 rows are enough otherwise
    // (alignment only affects speed, never a result).
    let align = if jobs.iter().any(|j| arbor_quant::gemm_supported(j.dtype)) {
        GEMM_ALIGN
    } else {
        ROW_ALIGN
    };
    let err: Mutex<Option<String>> = Mutex::new(None);
    b.parallel(&|t, pieces| {
        let (g0, g1) = share(total, t, pieces, align);
        let mut base = 0;
        for (j, &ai) in jobs.iter().zip(&which) {
            let (lo, hi) = (g0.max(base), g1.min(base + j.n));
            base += j.n;
            if lo >= hi {
                continue;
            }
            let (r0, rows) = (lo - (base - j.n), hi - lo);
            let wrows = &j.w[r0 * j.row_bytes..(r0 + rows) * j.row_bytes];
            // SAFETY: the output is [m, n] f32 (validated view); this piece
            // alone writes its columns r0..r0+rows of every row, and
            // dot_rows_raw writes nothing else.
            let res = unsafe {
                arbor_quant::dot_rows_raw(
                    j.dtype,
                    wrows,
                    rows,
                    k,
                    &prepared[ai],
                    j.out.get().add(r0),
                    j.n,
                )
            };
            if let Err(e) = res {
                first_error(&err, e.to_string());
                return;
            }
        }
    })?;
    take_error(err)
}
