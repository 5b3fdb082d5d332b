//! Linear layers: `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias)` for every weight dtype.
//!
//! Small batches (decode, `m <= SMALL_M`) are memory-bound: activations are
//! prepared once for the weight format (quantized to Q8 for quantized weights,
//! as ggml does) and each thread streams its share of weight rows through the
//! quant crate's row kernels. Large batches (prefill) are compute-bound: each
//! thread takes tiles of weight rows, dequantizes them to f32 when needed, and
//! multiplies them with an f32 GEMM, writing its own output columns.

use crate::memory::SendPtr;
use crate::pool::share;
use crate::{CpuBackend, no_overlap};
use arbor_engine_core::{CoreError, DType, Result, Tensor};
use std::sync::Mutex;

/// Largest batch that takes the row-kernel (GEMV) path.
const SMALL_M: usize = 8;
/// Weight rows per GEMM tile.
const TILE_ROWS: usize = 64;
thread_local! {
    /// Per-thread f32 tile of dequantized weight rows, reused across calls.
    static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Row alignment of thread shares (keeps shares on cache-line boundaries).
const ROW_ALIGN: usize = 16;

pub fn linear(
    b: &CpuBackend,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
) -> Result<()> {
    let [n, k] = *w.shape() else {
        return Err(CoreError::invalid(format!(
            "linear weight {w:?} is not 2-D"
        )));
    };
    let xv = b.view(x, DType::F32)?;
    if x.row_len() != k {
        return Err(CoreError::invalid(format!(
            "linear input {x:?} does not match weight {w:?}"
        )));
    }
    let m = x.rows();
    let ov = b.view(out, DType::F32)?;
    if out.rows() != m || out.row_len() != n {
        return Err(CoreError::invalid(format!(
            "linear output {out:?}, expected [{m}, {n}]"
        )));
    }
    let mut inputs = vec![x, w];
    if let Some(bias) = bias {
        inputs.push(bias);
        if bias.numel() != n {
            return Err(CoreError::invalid(format!("bias {bias:?} for {n} outputs")));
        }
    }
    no_overlap(out, &inputs)?;
    let wv = b.bytes_of(w)?;
    let dtype = w.dtype();
    let row_bytes = dtype.bytes_for(k)?;
    // SAFETY: views checked above; the tensors outlive this call.
    let xs = unsafe { std::slice::from_raw_parts(xv.ptr as *const f32, m * k) };
    // SAFETY: as above.
    let ws = unsafe { std::slice::from_raw_parts(wv.ptr as *const u8, wv.bytes) };
    let op = SendPtr(ov.ptr as *mut f32);
    let err: Mutex<Option<String>> = Mutex::new(None);
    let fail = |e: String| {
        let mut g = err.lock().unwrap_or_else(|p| p.into_inner());
        g.get_or_insert(e);
    };

    if m <= SMALL_M || dtype.is_quantized() {
        // Activations in blocks of SMALL_M rows, prepared once for the weight format
        // (quantized weights always take this path, as in ggml: integer dots).
        let blocks: Vec<(usize, arbor_quant::PreparedActs)> = (0..m)
            .step_by(SMALL_M)
            .map(|i0| {
                let mb = SMALL_M.min(m - i0);
                arbor_quant::prepare_acts(dtype, &xs[i0 * k..(i0 + mb) * k], mb, k).map(|a| (i0, a))
            })
            .collect::<Result<_, _>>()
            .map_err(|e| CoreError::unsupported(format!("linear with {dtype} weights: {e}")))?;
        b.parallel(&|t, threads| {
            let (r0, r1) = share(n, t, threads, ROW_ALIGN);
            if r0 >= r1 {
                return;
            }
            let rows = r1 - r0;
            let wrows = &ws[r0 * row_bytes..r1 * row_bytes];
            if m == 1 {
                // SAFETY: columns r0..r1 of the single output row, disjoint per thread.
                let o = unsafe { std::slice::from_raw_parts_mut(op.get().add(r0), rows) };
                if let Err(e) = arbor_quant::dot_rows(dtype, wrows, rows, k, &blocks[0].1, o, rows) {
                    fail(e.to_string());
                }
                return;
            }
            let mut tmp = vec![0f32; SMALL_M * rows];
            for (i0, acts) in &blocks {
                let mb = acts.m();
                if let Err(e) =
                    arbor_quant::dot_rows(dtype, wrows, rows, k, acts, &mut tmp[..mb * rows], rows)
                {
                    fail(e.to_string());
                    return;
                }
                for i in 0..mb {
                    // SAFETY: row i0 + i, columns r0..r1: disjoint per thread.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            tmp.as_ptr().add(i * rows),
                            op.get().add((i0 + i) * n + r0),
                            rows,
                        );
                    }
                }
            }
        })?;
    } else {
        let xp = SendPtr(xs.as_ptr() as *mut f32);
        b.parallel(&|t, threads| {
            let (r0, r1) = share(n, t, threads, ROW_ALIGN);
            TILE.with(|cell| {
                let mut tile = cell.borrow_mut();
                if tile.len() < TILE_ROWS * k {
                    tile.resize(TILE_ROWS * k, 0.0);
                }
                let mut c0 = r0;
                while c0 < r1 {
                    let nb = TILE_ROWS.min(r1 - c0);
                    let src = &ws[c0 * row_bytes..(c0 + nb) * row_bytes];
                    let rhs: *const f32 = if dtype == DType::F32 {
                        src.as_ptr() as *const f32
                    } else {
                        if let Err(e) = arbor_quant::dequantize(dtype, src, &mut tile[..nb * k]) {
                            fail(e.to_string());
                            return;
                        }
                        tile.as_ptr()
                    };
                    // SAFETY: lhs is x [m, k] (row stride k), rhs is the tile viewed as
                    // [k, nb] (column stride k), dst is columns c0..c0+nb of out
                    // [m, n] (row stride n): those columns belong to this thread only.
                    unsafe {
                        gemm::gemm(
                            m,
                            nb,
                            k,
                            op.get().add(c0),
                            1,
                            n as isize,
                            false,
                            xp.get() as *const f32,
                            1,
                            k as isize,
                            rhs,
                            k as isize,
                            1,
                            0.0f32,
                            1.0f32,
                            false,
                            false,
                            false,
                            gemm::Parallelism::None,
                        );
                    }
                    c0 += nb;
                }
            });
        })?;
    }
    if let Some(msg) = err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(CoreError::unsupported(format!(
            "linear with {dtype} weights: {msg}"
        )));
    }
    if let Some(bias) = bias {
        let bv = b.view(bias, DType::F32)?;
        // SAFETY: n aligned f32 values.
        let bs = unsafe { std::slice::from_raw_parts(bv.ptr as *const f32, n) };
        for i in 0..m {
            // SAFETY: row i of out; no other reference to it is live.
            let row = unsafe { std::slice::from_raw_parts_mut(op.get().add(i * n), n) };
            for (o, &bb) in row.iter_mut().zip(bs) {
                *o += bb;
            }
        }
    }
    Ok(())
}
