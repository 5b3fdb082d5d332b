//! Elementwise and row-wise operations: embedding lookup, RMSNorm (plain and
//! fused with the residual add), rotary embedding, SiLU-and-mul, residual add,
//! row gathering, column blocks and copies.
//!
//! Each validates its tensors exactly as the CPU backend does (dtypes, shapes,
//! overlap of outputs with inputs), resolves device addresses under the lock,
//! and queues one kernel; row counts go through [`State::rows`] so the op is
//! padded in a graph step. Index inputs that live on the device (token ids,
//! gathered rows) cannot be checked on the host: the kernels write zeros for
//! out-of-range indices instead of reading past a table.

use crate::GpuBackend;
use crate::exec::{Args, Op, State};
use crate::kernels::K;
use arbor_engine_core::{CoreError, DType, Result, RopeDims, RopeStyle, Tensor, columns};

/// Threads for a row of `dim` elements reduced by one block.
fn row_block(dim: usize) -> u32 {
    (dim.div_ceil(8).next_multiple_of(32)).clamp(32, 1024) as u32
}

/// Blocks for a grid-stride loop over `n` elements.
pub(crate) fn stride_grid(b: &GpuBackend, n: usize) -> usize {
    n.div_ceil(256)
        .min(b.dev.props().compute_units as usize * 16)
        .max(1)
}

impl GpuBackend {
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
        ids.check_dtype(DType::U32)?;
        out.check_dtype(DType::F32)?;
        let n = ids.numel();
        if out.rows() != n || out.row_len() != dim {
            return Err(CoreError::invalid(format!(
                "embedding of {n} ids into {out:?} (dim {dim})"
            )));
        }
        out.check_no_overlap(&[table, ids])?;
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
        w.check_dtype(DType::F32)?;
        if w.numel() != dim {
            return Err(CoreError::invalid(format!(
                "norm weight {w:?} for rows of {dim}"
            )));
        }
        Ok(())
    }

    pub(crate) fn op_rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, out: &Tensor) -> Result<()> {
        x.check_dtype(DType::F32)?;
        out.check_dtype(DType::F32)?;
        x.check_same_shape(out)?;
        let in_place = x.buffer_id() == out.buffer_id() && x.offset() == out.offset();
        if !in_place {
            out.check_no_overlap(&[x, w])?;
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
            t.check_dtype(DType::F32)?;
        }
        residual.check_same_shape(x)?;
        residual.check_same_shape(out)?;
        out.check_no_overlap(&[residual, x, w])?;
        residual.check_no_overlap(&[x, w])?;
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
        x.check_dtype(DType::F32)?;
        positions.check_dtype(DType::U32)?;
        inv_freq.check_dtype(DType::F32)?;
        let RopeDims {
            tokens,
            heads,
            half,
            ..
        } = RopeDims::check(x, positions, inv_freq, head_dim)?;
        let mut st = self.dev.lock()?;
        let rows = st.rows(tokens, &[x, positions]);
        let args = Args::new()
            .p(self.p(&st, x)?)
            .p(self.p(&st, positions)?)
            .p(self.p(&st, inv_freq)?)
            .i(rows)
            .i(heads)
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
            t.check_dtype(DType::F32)?;
        }
        gate.check_same_shape(up)?;
        gate.check_same_shape(out)?;
        out.check_no_overlap(&[gate, up])?;
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
        dst.check_dtype(DType::F32)?;
        src.check_dtype(DType::F32)?;
        dst.check_same_shape(src)?;
        dst.check_no_overlap(&[src])?;
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

    /// [`arbor_engine_core::Backend::concat_cols`]: each part written into
    /// its block of `out`'s columns by one `copy_cols` launch (rows padded
    /// with the step).
    pub(crate) fn op_concat_cols(&self, parts: &[&Tensor], out: &Tensor) -> Result<()> {
        let (rows, widths) = columns::concat_dims(parts, out)?;
        if rows == 0 {
            return Ok(());
        }
        let total = out.row_len();
        let mut st = self.dev.lock()?;
        let op = self.p(&st, out)?;
        let mut offset = 0;
        for (part, &w) in parts.iter().zip(&widths) {
            let m = st.rows(rows, &[part, out]);
            let args = Args::new()
                .p(self.p(&st, part)?)
                .p(op)
                .i(m)
                .i(w)
                .i(total)
                .i(offset);
            let grid = [stride_grid(self, m * w), 1, 1];
            self.dev.launch(&mut st, K::CopyCols, grid, 256, 0, args)?;
            offset += w;
        }
        Ok(())
    }

    pub(crate) fn op_gather_rows(&self, x: &Tensor, rows: &Tensor, out: &Tensor) -> Result<()> {
        x.check_dtype(DType::F32)?;
        out.check_dtype(DType::F32)?;
        rows.check_dtype(DType::U32)?;
        let (xrows, dim) = (x.rows(), x.row_len());
        let n = rows.numel();
        if out.row_len() != dim || out.rows() != n {
            return Err(CoreError::invalid(format!(
                "gather {n} rows of {x:?} into {out:?}"
            )));
        }
        out.check_no_overlap(&[x, rows])?;
        let mut st = self.dev.lock()?;
        let m = st.rows(n, &[rows, out]);
        // The bound on the indices: a whole step buffer's rows (a multiple
        // of the step's sequences) scale with the step, so a padded step's
        // launch is the same for every batch of its bucket.
        let xrows = match st.step_shape() {
            Some((b, _)) if xrows.is_multiple_of(b) => st.rows(xrows, &[x]),
            _ => xrows,
        };
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
        dst.check_no_overlap(&[src])?;
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
