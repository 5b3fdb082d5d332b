//! Row-wise and elementwise operations: embedding lookup, RMSNorm (plain and
//! fused with the residual add), rotary embedding, SiLU-and-mul, residual add
//! and row gathering.
//!
//! Each function validates its tensors on the host exactly as the CPU backend
//! does, then records one dispatch. Offsets passed to kernels are in 4-byte
//! words for f32/u32 tensors and in bytes for weight tables.

use crate::context::{Access, Params};
use crate::kernels::{self, Kernel, grid, grid_threads};
use crate::{WgpuBackend, u32_of};
use arbor_engine_core::{CoreError, DType, Result, RopeDims, RopeStyle, Tensor};

pub fn embedding(b: &WgpuBackend, table: &Tensor, ids: &Tensor, out: &Tensor) -> Result<()> {
    let [vocab, dim] = *table.shape() else {
        return Err(CoreError::invalid(format!(
            "embedding table {table:?} is not 2-D"
        )));
    };
    let n = ids.numel();
    if out.dtype() != DType::F32 || out.rows() != n || out.row_len() != dim {
        return Err(CoreError::invalid(format!(
            "embedding of {n} ids into {out:?} (dim {dim})"
        )));
    }
    out.check_no_overlap(&[table, ids])?;
    let dt = kernels::weight_code(table.dtype())?;
    if dt > 5 {
        return Err(CoreError::unsupported(format!(
            "{} embedding tables on the wgpu backend",
            table.dtype()
        )));
    }
    let row_bytes = table.dtype().bytes_for(dim)?;
    let tv = b.view_any(table, Access::Read)?;
    let iv = b.view(ids, DType::U32, Access::Read)?;
    let ov = b.view(out, DType::F32, Access::Write)?;
    let gpu = b.gpu();
    let pipe = gpu.kernel(&Kernel::Embedding { dt })?;
    let params = Params::new()
        .us(n)?
        .us(dim)?
        .us(vocab)?
        .us(row_bytes)?
        .u(tv.off)
        .u(iv.word_off())
        .u(ov.word_off())
        .u(0);
    let groups = grid_threads(n * dim, gpu.limits.max_compute_workgroups_per_dimension)?;
    gpu.dispatch(&pipe, &params, &[&tv, &iv, &ov], groups)
}

/// RMSNorm of `x` into `out`; with a residual, `residual += x` first and the
/// sum is normalized. Without one, `out` may be `x` itself.
pub fn rms_norm(
    b: &WgpuBackend,
    residual: Option<&Tensor>,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
    out: &Tensor,
) -> Result<()> {
    x.check_same_shape(out)?;
    match residual {
        Some(r) => {
            r.check_same_shape(x)?;
            out.check_no_overlap(&[r, x, w])?;
            r.check_no_overlap(&[x, w])?;
        }
        None => {
            let in_place = x.buffer_id() == out.buffer_id() && x.offset() == out.offset();
            if !in_place {
                out.check_no_overlap(&[x, w])?;
            }
        }
    }
    let (rows, dim) = (x.rows(), x.row_len());
    if w.numel() != dim {
        return Err(CoreError::invalid(format!(
            "norm weight {w:?} for rows of {dim}"
        )));
    }
    let xv = b.view(x, DType::F32, Access::Read)?;
    let wv = b.view(w, DType::F32, Access::Read)?;
    let ov = b.view(out, DType::F32, Access::Write)?;
    let rv = residual
        .map(|r| b.view(r, DType::F32, Access::Write))
        .transpose()?;
    let gpu = b.gpu();
    let add = residual.is_some();
    let pipe = gpu.kernel(&Kernel::RmsNorm { add })?;
    let params = Params::new()
        .us(rows)?
        .us(dim)?
        .u(xv.word_off())
        .u(wv.word_off())
        .u(ov.word_off())
        .u(rv.as_ref().map_or(0, |r| r.word_off()))
        .f(eps)
        .u(0);
    let groups = grid(rows, gpu.limits.max_compute_workgroups_per_dimension)?;
    match &rv {
        Some(r) => gpu.dispatch(&pipe, &params, &[&xv, &wv, &ov, r], groups),
        None => gpu.dispatch(&pipe, &params, &[&xv, &wv, &ov], groups),
    }
}

pub fn rope(
    b: &WgpuBackend,
    x: &Tensor,
    positions: &Tensor,
    inv_freq: &Tensor,
    head_dim: usize,
    style: RopeStyle,
) -> Result<()> {
    let RopeDims {
        tokens,
        width,
        half,
        ..
    } = RopeDims::check(x, positions, inv_freq, head_dim)?;
    let xv = b.view(x, DType::F32, Access::Write)?;
    let pv = b.view(positions, DType::U32, Access::Read)?;
    let fv = b.view(inv_freq, DType::F32, Access::Read)?;
    let gpu = b.gpu();
    let pipe = gpu.kernel(&Kernel::Rope)?;
    let params = Params::new()
        .us(tokens)?
        .us(width)?
        .us(head_dim)?
        .us(half)?
        .u(xv.word_off())
        .u(pv.word_off())
        .u(fv.word_off())
        .u(match style {
            RopeStyle::Neox => 0,
            RopeStyle::Interleaved => 1,
        });
    let threads = tokens * (width / head_dim) * half;
    let groups = grid_threads(threads, gpu.limits.max_compute_workgroups_per_dimension)?;
    gpu.dispatch(&pipe, &params, &[&xv, &pv, &fv], groups)
}

pub fn silu_mul(b: &WgpuBackend, gate: &Tensor, up: &Tensor, out: &Tensor) -> Result<()> {
    gate.check_same_shape(up)?;
    gate.check_same_shape(out)?;
    out.check_no_overlap(&[gate, up])?;
    let gv = b.view(gate, DType::F32, Access::Read)?;
    let uv = b.view(up, DType::F32, Access::Read)?;
    let ov = b.view(out, DType::F32, Access::Write)?;
    let gpu = b.gpu();
    let pipe = gpu.kernel(&Kernel::SiluMul)?;
    let n = gate.numel();
    let params = Params::new()
        .u(u32_of(n, "silu_mul size")?)
        .u(gv.word_off())
        .u(uv.word_off())
        .u(ov.word_off());
    let groups = grid_threads(n, gpu.limits.max_compute_workgroups_per_dimension)?;
    gpu.dispatch(&pipe, &params, &[&gv, &uv, &ov], groups)
}

pub fn add_assign(b: &WgpuBackend, dst: &Tensor, src: &Tensor) -> Result<()> {
    dst.check_same_shape(src)?;
    dst.check_no_overlap(&[src])?;
    let sv = b.view(src, DType::F32, Access::Read)?;
    let dv = b.view(dst, DType::F32, Access::Write)?;
    let gpu = b.gpu();
    let pipe = gpu.kernel(&Kernel::Add)?;
    let n = dst.numel();
    let params = Params::new()
        .u(u32_of(n, "add size")?)
        .u(sv.word_off())
        .u(dv.word_off())
        .u(0);
    let groups = grid_threads(n, gpu.limits.max_compute_workgroups_per_dimension)?;
    gpu.dispatch(&pipe, &params, &[&sv, &dv], groups)
}

pub fn gather_rows(b: &WgpuBackend, x: &Tensor, rows: &Tensor, out: &Tensor) -> Result<()> {
    let (xrows, dim) = (x.rows(), x.row_len());
    let n = rows.numel();
    if out.row_len() != dim || out.rows() != n {
        return Err(CoreError::invalid(format!(
            "gather {n} rows of {x:?} into {out:?}"
        )));
    }
    out.check_no_overlap(&[x, rows])?;
    let xv = b.view(x, DType::F32, Access::Read)?;
    let rv = b.view(rows, DType::U32, Access::Read)?;
    let ov = b.view(out, DType::F32, Access::Write)?;
    let gpu = b.gpu();
    let pipe = gpu.kernel(&Kernel::Gather)?;
    let params = Params::new()
        .us(n)?
        .us(dim)?
        .us(xrows)?
        .u(xv.word_off())
        .u(rv.word_off())
        .u(ov.word_off())
        .u(0)
        .u(0);
    let groups = grid_threads(n * dim, gpu.limits.max_compute_workgroups_per_dimension)?;
    gpu.dispatch(&pipe, &params, &[&xv, &rv, &ov], groups)
}
