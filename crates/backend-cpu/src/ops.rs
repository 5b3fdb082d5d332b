//! Elementwise and row-wise kernels: embedding lookup, RMSNorm (plain and
//! fused with the residual add), rotary embedding, SiLU-and-mul, residual add
//! and row gathering.
//!
//! Each kernel validates its tensors, then splits rows across the pool. A
//! thread only writes the rows of its share, so the raw output pointer is
//! accessed disjointly.

use crate::CpuBackend;
use crate::memory::SendPtr;
use crate::pool::share;
use arbor_engine_core::{CoreError, DType, Result, RopeDims, RopeStyle, Tensor};

/// Below this many elements a kernel runs on the calling thread only.
const PARALLEL_MIN: usize = 32 * 1024;

fn rows_parallel(
    b: &CpuBackend,
    rows: usize,
    row_len: usize,
    f: &(dyn Fn(usize, usize) + Sync),
) -> Result<()> {
    if rows * row_len < PARALLEL_MIN || rows == 1 {
        f(0, rows);
        return Ok(());
    }
    b.parallel(&|t, n| {
        let (r0, r1) = share(rows, t, n, 1);
        if r0 < r1 {
            f(r0, r1);
        }
    })
}

fn f32_rows(b: &CpuBackend, t: &Tensor) -> Result<(SendPtr<f32>, usize, usize)> {
    let v = b.view(t, DType::F32)?;
    Ok((SendPtr(v.ptr as *mut f32), t.rows(), t.row_len()))
}

pub fn embedding(b: &CpuBackend, table: &Tensor, ids: &Tensor, out: &Tensor) -> Result<()> {
    let [vocab, dim] = *table.shape() else {
        return Err(CoreError::invalid(format!(
            "embedding table {table:?} is not 2-D"
        )));
    };
    let ids_v = b.view(ids, DType::U32)?;
    let n = ids.numel();
    let (o, orows, olen) = f32_rows(b, out)?;
    if orows != n || olen != dim {
        return Err(CoreError::invalid(format!(
            "embedding of {n} ids into {out:?} (dim {dim})"
        )));
    }
    out.check_no_overlap(&[table, ids])?;
    // SAFETY: `ids_v` covers n u32 values, aligned (checked by view).
    let ids_s = unsafe { std::slice::from_raw_parts(ids_v.ptr as *const u32, n) };
    if let Some(bad) = ids_s.iter().find(|&&i| i as usize >= vocab) {
        return Err(CoreError::invalid(format!(
            "token id {bad} outside the embedding table of {vocab}"
        )));
    }
    let tv = b.bytes_of(table)?;
    let row_bytes = table.dtype().bytes_for(dim)?;
    let dtype = table.dtype();
    // SAFETY: the table view covers vocab * row_bytes bytes.
    let table_s = unsafe { std::slice::from_raw_parts(tv.ptr as *const u8, tv.bytes) };
    let err = std::sync::Mutex::new(None);
    rows_parallel(b, n, dim, &|r0, r1| {
        for (r, &id) in ids_s.iter().enumerate().take(r1).skip(r0) {
            let src = &table_s[id as usize * row_bytes..(id as usize + 1) * row_bytes];
            // SAFETY: row r of out lies inside the view; rows are disjoint per thread.
            let dst = unsafe { std::slice::from_raw_parts_mut(o.get().add(r * dim), dim) };
            if let Err(e) = arbor_quant::dequantize(dtype, src, dst) {
                *err.lock().unwrap_or_else(|p| p.into_inner()) = Some(CoreError::unsupported(
                    format!("embedding rows of {dtype}: {e}"),
                ));
            }
        }
    })?;
    match err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn norm_weight<'a>(b: &CpuBackend, w: &'a Tensor, dim: usize) -> Result<&'a [f32]> {
    if w.numel() != dim {
        return Err(CoreError::invalid(format!(
            "norm weight {w:?} for rows of {dim}"
        )));
    }
    let v = b.view(w, DType::F32)?;
    // SAFETY: dim aligned f32 values; the tensor borrow keeps the buffer alive.
    Ok(unsafe { std::slice::from_raw_parts(v.ptr as *const f32, dim) })
}

#[inline]
fn rms_scale(row: &[f32], eps: f32) -> f32 {
    let ss: f32 = crate::simd::dot(row, row);
    1.0 / (ss / row.len() as f32 + eps).sqrt()
}

pub fn rms_norm(b: &CpuBackend, x: &Tensor, w: &Tensor, eps: f32, out: &Tensor) -> Result<()> {
    x.check_same_shape(out)?;
    let in_place = x.buffer_id() == out.buffer_id() && x.offset() == out.offset();
    if !in_place {
        out.check_no_overlap(&[x, w])?;
    }
    let (xp, rows, dim) = f32_rows(b, x)?;
    let (op, _, _) = f32_rows(b, out)?;
    let ws = norm_weight(b, w, dim)?;
    rows_parallel(b, rows, dim, &|r0, r1| {
        for r in r0..r1 {
            // SAFETY: row r is inside both views; when in place, only the
            // output slice is created, so no aliasing references exist.
            unsafe {
                let o = std::slice::from_raw_parts_mut(op.get().add(r * dim), dim);
                if in_place {
                    let s = rms_scale(o, eps);
                    for (v, &g) in o.iter_mut().zip(ws) {
                        *v = *v * s * g;
                    }
                } else {
                    let xi = std::slice::from_raw_parts(xp.get().add(r * dim), dim);
                    let s = rms_scale(xi, eps);
                    for ((v, &a), &g) in o.iter_mut().zip(xi).zip(ws) {
                        *v = a * s * g;
                    }
                }
            }
        }
    })
}

pub fn add_rms_norm(
    b: &CpuBackend,
    residual: &Tensor,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
    out: &Tensor,
) -> Result<()> {
    residual.check_same_shape(x)?;
    residual.check_same_shape(out)?;
    out.check_no_overlap(&[residual, x, w])?;
    residual.check_no_overlap(&[x, w])?;
    let (rp, rows, dim) = f32_rows(b, residual)?;
    let (xp, _, _) = f32_rows(b, x)?;
    let (op, _, _) = f32_rows(b, out)?;
    let ws = norm_weight(b, w, dim)?;
    rows_parallel(b, rows, dim, &|r0, r1| {
        for r in r0..r1 {
            // SAFETY: row r of three non-overlapping views.
            unsafe {
                let res = std::slice::from_raw_parts_mut(rp.get().add(r * dim), dim);
                let xi = std::slice::from_raw_parts(xp.get().add(r * dim), dim);
                let o = std::slice::from_raw_parts_mut(op.get().add(r * dim), dim);
                for (a, &v) in res.iter_mut().zip(xi) {
                    *a += v;
                }
                let s = rms_scale(res, eps);
                for ((v, &a), &g) in o.iter_mut().zip(res.iter()).zip(ws) {
                    *v = a * s * g;
                }
            }
        }
    })
}

pub fn rope(
    b: &CpuBackend,
    x: &Tensor,
    positions: &Tensor,
    inv_freq: &Tensor,
    head_dim: usize,
    style: RopeStyle,
) -> Result<()> {
    let RopeDims {
        tokens,
        width,
        heads,
        half,
    } = RopeDims::check(x, positions, inv_freq, head_dim)?;
    let (xp, _, _) = f32_rows(b, x)?;
    let pv = b.view(positions, DType::U32)?;
    let fv = b.view(inv_freq, DType::F32)?;
    // SAFETY: aligned views of `tokens` u32 and `half` f32 values.
    let pos = unsafe { std::slice::from_raw_parts(pv.ptr as *const u32, tokens) };
    // SAFETY: as above.
    let freqs = unsafe { std::slice::from_raw_parts(fv.ptr as *const f32, half) };
    rows_parallel(b, tokens, width, &|r0, r1| {
        let mut cos = vec![0f32; half];
        let mut sin = vec![0f32; half];
        for (t, &p) in pos.iter().enumerate().take(r1).skip(r0) {
            let pf = p as f32;
            for i in 0..half {
                let a = pf * freqs[i];
                cos[i] = a.cos();
                sin[i] = a.sin();
            }
            // SAFETY: row t of x, disjoint per thread.
            let row = unsafe { std::slice::from_raw_parts_mut(xp.get().add(t * width), width) };
            for h in 0..heads {
                let v = &mut row[h * head_dim..(h + 1) * head_dim];
                match style {
                    RopeStyle::Neox => {
                        for i in 0..half {
                            let (a, c) = (v[i], v[i + half]);
                            v[i] = a * cos[i] - c * sin[i];
                            v[i + half] = c * cos[i] + a * sin[i];
                        }
                    }
                    RopeStyle::Interleaved => {
                        for i in 0..half {
                            let (a, c) = (v[2 * i], v[2 * i + 1]);
                            v[2 * i] = a * cos[i] - c * sin[i];
                            v[2 * i + 1] = c * cos[i] + a * sin[i];
                        }
                    }
                }
            }
        }
    })
}

pub fn silu_mul(b: &CpuBackend, gate: &Tensor, up: &Tensor, out: &Tensor) -> Result<()> {
    gate.check_same_shape(up)?;
    gate.check_same_shape(out)?;
    out.check_no_overlap(&[gate, up])?;
    let (gp, rows, dim) = f32_rows(b, gate)?;
    let (upp, _, _) = f32_rows(b, up)?;
    let (op, _, _) = f32_rows(b, out)?;
    rows_parallel(b, rows, dim, &|r0, r1| {
        let n = (r1 - r0) * dim;
        // SAFETY: rows r0..r1 of three non-overlapping views.
        unsafe {
            let g = std::slice::from_raw_parts(gp.get().add(r0 * dim), n);
            let u = std::slice::from_raw_parts(upp.get().add(r0 * dim), n);
            let o = std::slice::from_raw_parts_mut(op.get().add(r0 * dim), n);
            crate::simd::silu_mul(g, u, o);
        }
    })
}

pub fn add_assign(b: &CpuBackend, dst: &Tensor, src: &Tensor) -> Result<()> {
    dst.check_same_shape(src)?;
    dst.check_no_overlap(&[src])?;
    let (dp, rows, dim) = f32_rows(b, dst)?;
    let (sp, _, _) = f32_rows(b, src)?;
    rows_parallel(b, rows, dim, &|r0, r1| {
        let n = (r1 - r0) * dim;
        // SAFETY: rows r0..r1 of two non-overlapping views.
        unsafe {
            let d = std::slice::from_raw_parts_mut(dp.get().add(r0 * dim), n);
            let s = std::slice::from_raw_parts(sp.get().add(r0 * dim), n);
            for (d, &s) in d.iter_mut().zip(s) {
                *d += s;
            }
        }
    })
}

pub fn scatter_add_rows(
    b: &CpuBackend,
    out: &Tensor,
    rows: &Tensor,
    scales: &Tensor,
    x: &Tensor,
) -> Result<()> {
    let (xp, n, dim) = f32_rows(b, x)?;
    let (op, orows, odim) = f32_rows(b, out)?;
    if odim != dim || rows.numel() != n || scales.numel() != n {
        return Err(CoreError::invalid(format!(
            "scatter-add {x:?} into {out:?} at {rows:?} scaled by {scales:?}"
        )));
    }
    out.check_no_overlap(&[x, rows, scales])?;
    let rv = b.view(rows, DType::U32)?;
    let sv = b.view(scales, DType::F32)?;
    // SAFETY: n aligned u32 and f32 values.
    let (idx, sc) = unsafe {
        (
            std::slice::from_raw_parts(rv.ptr as *const u32, n),
            std::slice::from_raw_parts(sv.ptr as *const f32, n),
        )
    };
    if let Some(bad) = idx.iter().find(|&&r| r as usize >= orows) {
        return Err(CoreError::invalid(format!(
            "scatter-add row {bad} past {orows} rows"
        )));
    }
    for (i, (&r, &s)) in idx.iter().zip(sc).enumerate() {
        // SAFETY: row i of x and row r of out are inside their non-overlapping views.
        unsafe {
            let d = std::slice::from_raw_parts_mut(op.get().add(r as usize * dim), dim);
            let v = std::slice::from_raw_parts(xp.get().add(i * dim), dim);
            for (d, &v) in d.iter_mut().zip(v) {
                *d += s * v;
            }
        }
    }
    Ok(())
}

/// `out = [parts[0] | parts[1] | ...]`, each part's rows copied into its
/// block of `out`'s columns.
pub fn concat_cols(b: &CpuBackend, parts: &[&Tensor], out: &Tensor) -> Result<()> {
    let (rows, widths) = arbor_engine_core::columns::concat_dims(parts, out)?;
    let (op, _, total) = f32_rows(b, out)?;
    let mut offset = 0;
    for (part, &w) in parts.iter().zip(&widths) {
        let (pp, _, _) = f32_rows(b, part)?;
        for r in 0..rows {
            // SAFETY: row r of the part and columns offset..offset + w of row
            // r of out lie inside their views, which do not overlap
            // (`concat_dims` checked).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    pp.get().add(r * w),
                    op.get().add(r * total + offset),
                    w,
                );
            }
        }
        offset += w;
    }
    Ok(())
}

pub fn gather_rows(b: &CpuBackend, x: &Tensor, rows: &Tensor, out: &Tensor) -> Result<()> {
    let (xp, xrows, dim) = f32_rows(b, x)?;
    let (op, orows, odim) = f32_rows(b, out)?;
    let n = rows.numel();
    if odim != dim || orows != n {
        return Err(CoreError::invalid(format!(
            "gather {n} rows of {x:?} into {out:?}"
        )));
    }
    out.check_no_overlap(&[x, rows])?;
    let rv = b.view(rows, DType::U32)?;
    // SAFETY: n aligned u32 values.
    let idx = unsafe { std::slice::from_raw_parts(rv.ptr as *const u32, n) };
    if let Some(bad) = idx.iter().find(|&&r| r as usize >= xrows) {
        return Err(CoreError::invalid(format!(
            "gather row {bad} past {xrows} rows"
        )));
    }
    for (i, &r) in idx.iter().enumerate() {
        // SAFETY: row r of x and row i of out are inside their non-overlapping views.
        unsafe {
            std::ptr::copy_nonoverlapping(
                xp.get().add(r as usize * dim),
                op.get().add(i * dim),
                dim,
            );
        }
    }
    Ok(())
}

/// [`Backend::sample`](arbor_engine_core::Backend::sample) on host memory:
/// reads each logits row in place (no download) and draws it with
/// [`SampleRow::draw`](arbor_engine_core::backend::SampleRow::draw).
/// [`Backend::edit_logits`](arbor_engine_core::Backend::edit_logits) in place.
pub fn edit_logits(
    b: &CpuBackend,
    logits: &Tensor,
    edits: &arbor_engine_core::LogitEdits,
) -> Result<()> {
    let (lp, n, vocab) = f32_rows(b, logits)?;
    // SAFETY: the [n, vocab] f32 view of a live tensor, written only here.
    let values = unsafe { std::slice::from_raw_parts_mut(lp.get(), n * vocab) };
    edits.apply(values, vocab)
}

pub fn sample(
    b: &CpuBackend,
    logits: &Tensor,
    rows: &[arbor_engine_core::backend::SampleRow],
    out: &Tensor,
) -> Result<()> {
    let (lp, n, vocab) = f32_rows(b, logits)?;
    if n != rows.len() || out.dtype() != DType::U32 || out.numel() != n {
        return Err(CoreError::invalid(format!(
            "sample {} rows of {logits:?} into {out:?}",
            rows.len()
        )));
    }
    out.check_no_overlap(&[logits])?;
    let ov = b.view(out, DType::U32)?;
    // SAFETY: n aligned u32 values of a live tensor that overlaps nothing read here.
    let ids = unsafe { std::slice::from_raw_parts_mut(ov.ptr as *mut u32, n) };
    for (r, (row, id)) in rows.iter().zip(ids.iter_mut()).enumerate() {
        // SAFETY: row r of the [n, vocab] logits view.
        let values =
            unsafe { std::slice::from_raw_parts(lp.get().add(r * vocab) as *const f32, vocab) };
        *id = row.draw(values)?;
    }
    Ok(())
}
