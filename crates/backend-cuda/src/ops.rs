//! Elementwise and row-wise operations: embedding lookup, RMSNorm (plain and
//! fused with the residual add), rotary embedding, SiLU-and-mul, residual add,
//! row gathering and copies.
//!
//! Each validates its tensors exactly as the CPU backend does (dtypes, shapes,
//! overlap of outputs with inputs), resolves device addresses under the lock,
//! and queues one kernel; row counts go through [`State::rows`] so the op is
//! padded in a graph step. Index inputs that live on the device (token ids,
//! gathered rows) cannot be checked on the host: the kernels write zeros for
//! out-of-range indices instead of reading past a table.

use crate::CudaBackend;
use crate::exec::{Args, Op, State};
use crate::kernels::K;
use arbor_engine_core::{CoreError, DType, Result, RopeStyle, Tensor};

pub(crate) fn no_overlap(out: &Tensor, inputs: &[&Tensor]) -> Result<()> {
    for i in inputs {
        if out.overlaps(i) {
            return Err(CoreError::invalid(format!(
                "output {out:?} overlaps input {i:?}"
            )));
        }
    }
    Ok(())
}

pub(crate) fn same_shape(a: &Tensor, b: &Tensor) -> Result<()> {
    if a.numel() != b.numel() || a.row_len() != b.row_len() {
        return Err(CoreError::invalid(format!(
            "shape mismatch: {:?} vs {:?}",
            a.shape(),
            b.shape()
        )));
    }
    Ok(())
}

pub(crate) fn want(t: &Tensor, dtype: DType) -> Result<()> {
    if t.dtype() != dtype {
        return Err(CoreError::invalid(format!(
            "expected a {dtype} tensor, got {t:?}"
        )));
    }
    Ok(())
}

/// Threads for a row of `dim` elements reduced by one block.
fn row_block(dim: usize) -> u32 {
    (dim.div_ceil(8).next_multiple_of(32)).clamp(32, 1024) as u32
}

/// Blocks for a grid-stride loop over `n` elements.
pub(crate) fn stride_grid(b: &CudaBackend, n: usize) -> usize {
    n.div_ceil(256)
        .min(b.dev.props.sm_count as usize * 16)
        .max(1)
}

impl CudaBackend {
    /// Resolves `t` (f32/u32 need 4-byte alignment).
    pub(crate) fn p(&self, st: &State, t: &Tensor) -> Result<u64> {
        self.dev.ptr(st, t, t.dtype().block_bytes().min(4))
    }

    pub(crate) fn op_embedding(&self, table: &Tensor, ids: &Tensor, out: &Tensor) -> Result<()> {
        let [vocab, dim] = *table.shape() else {
            return Err(CoreError::invalid(format!(
                "embedding table {table:?} is not 2-D"
            )));
        };
        let k = match table.dtype() {
            DType::F32 => K::EmbeddingF32,
            DType::F16 => K::EmbeddingF16,
            DType::BF16 => K::EmbeddingBf16,
            other => {
                return Err(CoreError::unsupported(format!(
                    "CUDA embedding rows of {other}"
                )));
            }
        };
        want(ids, DType::U32)?;
        want(out, DType::F32)?;
        let n = ids.numel();
        if out.rows() != n || out.row_len() != dim {
            return Err(CoreError::invalid(format!(
                "embedding of {n} ids into {out:?} (dim {dim})"
            )));
        }
        no_overlap(out, &[table, ids])?;
        let mut st = self.dev.lock()?;
        let rows = st.rows(n, &[ids, out]);
        let args = Args::new()
            .p(self.p(&st, table)?)
            .p(self.p(&st, ids)?)
            .p(self.p(&st, out)?)
            .i(rows)
            .i(dim)
            .i(vocab);
        self.dev.launch(&mut st, k, [rows, 1, 1], 256, 0, args)
    }

    fn norm_weight(&self, w: &Tensor, dim: usize) -> Result<()> {
        want(w, DType::F32)?;
        if w.numel() != dim {
            return Err(CoreError::invalid(format!(
                "norm weight {w:?} for rows of {dim}"
            )));
        }
        Ok(())
    }

    pub(crate) fn op_rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, out: &Tensor) -> Result<()> {
        want(x, DType::F32)?;
        want(out, DType::F32)?;
        same_shape(x, out)?;
        let in_place = x.buffer_id() == out.buffer_id() && x.offset() == out.offset();
        if !in_place {
            no_overlap(out, &[x, w])?;
        }
        let dim = x.row_len();
        self.norm_weight(w, dim)?;
        let mut st = self.dev.lock()?;
        let rows = st.rows(x.rows(), &[x, out]);
        let args = Args::new()
            .p(self.p(&st, x)?)
            .p(self.p(&st, w)?)
            .p(self.p(&st, out)?)
            .i(rows)
            .i(dim)
            .f(eps);
        self.dev
            .launch(&mut st, K::RmsNorm, [rows, 1, 1], row_block(dim), 0, args)
    }

    pub(crate) fn op_add_rms_norm(
        &self,
        residual: &Tensor,
        x: &Tensor,
        w: &Tensor,
        eps: f32,
        out: &Tensor,
    ) -> Result<()> {
        for t in [residual, x, out] {
            want(t, DType::F32)?;
        }
        same_shape(residual, x)?;
        same_shape(residual, out)?;
        no_overlap(out, &[residual, x, w])?;
        no_overlap(residual, &[x, w])?;
        let dim = residual.row_len();
        self.norm_weight(w, dim)?;
        let mut st = self.dev.lock()?;
        let rows = st.rows(residual.rows(), &[residual, x, out]);
        let args = Args::new()
            .p(self.p(&st, residual)?)
            .p(self.p(&st, x)?)
            .p(self.p(&st, w)?)
            .p(self.p(&st, out)?)
            .i(rows)
            .i(dim)
            .f(eps);
        self.dev.launch(
            &mut st,
            K::AddRmsNorm,
            [rows, 1, 1],
            row_block(dim),
            0,
            args,
        )
    }

    pub(crate) fn op_rope(
        &self,
        x: &Tensor,
        positions: &Tensor,
        inv_freq: &Tensor,
        head_dim: usize,
        style: RopeStyle,
    ) -> Result<()> {
        want(x, DType::F32)?;
        want(positions, DType::U32)?;
        want(inv_freq, DType::F32)?;
        let (tokens, width) = (x.rows(), x.row_len());
        if head_dim == 0 || !width.is_multiple_of(head_dim) {
            return Err(CoreError::invalid(format!(
                "rope over rows of {width} with head_dim {head_dim}"
            )));
        }
        if positions.numel() != tokens {
            return Err(CoreError::invalid(format!(
                "rope: {} positions for {tokens} tokens",
                positions.numel()
            )));
        }
        let half = inv_freq.numel();
        if half == 0 || 2 * half > head_dim {
            return Err(CoreError::invalid(format!(
                "rope: {half} frequencies for head_dim {head_dim}"
            )));
        }
        no_overlap(x, &[positions, inv_freq])?;
        let mut st = self.dev.lock()?;
        let rows = st.rows(tokens, &[x, positions]);
        let args = Args::new()
            .p(self.p(&st, x)?)
            .p(self.p(&st, positions)?)
            .p(self.p(&st, inv_freq)?)
            .i(rows)
            .i(width / head_dim)
            .i(head_dim)
            .i(half)
            .i(match style {
                RopeStyle::Neox => 0,
                RopeStyle::Interleaved => 1,
            });
        self.dev
            .launch(&mut st, K::Rope, [rows, 1, 1], 256, 0, args)
    }

    pub(crate) fn op_silu_mul(&self, gate: &Tensor, up: &Tensor, out: &Tensor) -> Result<()> {
        for t in [gate, up, out] {
            want(t, DType::F32)?;
        }
        same_shape(gate, up)?;
        same_shape(gate, out)?;
        no_overlap(out, &[gate, up])?;
        let mut st = self.dev.lock()?;
        let n = st.rows(gate.numel(), &[gate, up, out]);
        let args = Args::new()
            .p(self.p(&st, gate)?)
            .p(self.p(&st, up)?)
            .p(self.p(&st, out)?)
            .l(n as u64);
        self.dev.launch(
            &mut st,
            K::SiluMul,
            [stride_grid(self, n), 1, 1],
            256,
            0,
            args,
        )
    }

    pub(crate) fn op_add_assign(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        want(dst, DType::F32)?;
        want(src, DType::F32)?;
        same_shape(dst, src)?;
        no_overlap(dst, &[src])?;
        let mut st = self.dev.lock()?;
        let n = st.rows(dst.numel(), &[dst, src]);
        let args = Args::new()
            .p(self.p(&st, dst)?)
            .p(self.p(&st, src)?)
            .l(n as u64);
        self.dev.launch(
            &mut st,
            K::AddAssign,
            [stride_grid(self, n), 1, 1],
            256,
            0,
            args,
        )
    }

    pub(crate) fn op_gather_rows(&self, x: &Tensor, rows: &Tensor, out: &Tensor) -> Result<()> {
        want(x, DType::F32)?;
        want(out, DType::F32)?;
        want(rows, DType::U32)?;
        let (xrows, dim) = (x.rows(), x.row_len());
        let n = rows.numel();
        if out.row_len() != dim || out.rows() != n {
            return Err(CoreError::invalid(format!(
                "gather {n} rows of {x:?} into {out:?}"
            )));
        }
        no_overlap(out, &[x, rows])?;
        let mut st = self.dev.lock()?;
        let m = st.rows(n, &[rows, out]);
        let args = Args::new()
            .p(self.p(&st, x)?)
            .p(self.p(&st, rows)?)
            .p(self.p(&st, out)?)
            .i(m)
            .i(dim)
            .i(xrows);
        self.dev
            .launch(&mut st, K::GatherRows, [m, 1, 1], 256, 0, args)
    }

    pub(crate) fn op_copy(&self, src: &Tensor, dst: &Tensor) -> Result<()> {
        if src.dtype() != dst.dtype() || src.numel() != dst.numel() {
            return Err(CoreError::invalid(format!("copy {src:?} into {dst:?}")));
        }
        no_overlap(dst, &[src])?;
        let bytes = src.byte_len()?;
        if bytes == 0 {
            return Ok(());
        }
        let mut st = self.dev.lock()?;
        let padded = match st.step_shape() {
            Some((b, bucket)) if st.rows(b, &[src, dst]) == bucket => st.padded_bytes(bytes),
            _ => bytes,
        };
        let op = Op::DtoD {
            dst: self.dev.ptr(&st, dst, 1)?,
            src: self.dev.ptr(&st, src, 1)?,
            bytes: padded,
        };
        self.dev.submit(&mut st, op)
    }
}
