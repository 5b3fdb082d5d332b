//! Checkpoint views the hybrid loader reads through, so it names every
//! tensor one way (`model.layers.{i}...` with Qwen3.5's split projections):
//!
//! - [`LanguageModelSource`]: a ConditionalGeneration checkpoint's text half
//!   (`model.language_model.*`) under `model.*`; `lm_head.*` as it is and
//!   `model.visual.*` never read.
//! - [`FusedProjections`]: Qwen3-Next's fused `in_proj_qkvz` and
//!   `in_proj_ba` (grouped per query/key head) as Qwen3.5's `in_proj_qkv`,
//!   `in_proj_z`, `in_proj_b` and `in_proj_a` (every head's queries, then
//!   keys, then values), by moving whole rows: exact for any element type
//!   whose rows are whole bytes; a block-quantized fused projection is
//!   refused naming the tensor.

use arbor_engine_core::{CoreError, HostTensor, Result, WeightSource};
use std::borrow::Cow;

/// A ConditionalGeneration checkpoint's language model under `model.*`.
pub(crate) struct LanguageModelSource<'a> {
    pub(crate) inner: &'a dyn WeightSource,
}

impl WeightSource for LanguageModelSource<'_> {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn tensor(&self, name: &str) -> Result<Option<HostTensor<'_>>> {
        match name.strip_prefix("model.") {
            Some(rest) => self.inner.tensor(&format!("model.language_model.{rest}")),
            None => self.inner.tensor(name),
        }
    }
}

/// The head geometry the fused projections are grouped by.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedGeometry {
    pub(crate) k_heads: usize,
    pub(crate) k_dim: usize,
    /// Value heads per query/key head.
    pub(crate) group: usize,
    pub(crate) v_dim: usize,
}

/// Qwen3-Next's fused projections, presented split.
pub(crate) struct FusedProjections<'a> {
    pub(crate) inner: &'a dyn WeightSource,
    pub(crate) geometry: FusedGeometry,
}

/// Which split projection a name asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Qkv,
    Z,
    B,
    A,
}

impl FusedProjections<'_> {
    /// Rows of the fused tensor, in the split tensor's order.
    fn rows(&self, part: Part) -> Vec<usize> {
        let FusedGeometry {
            k_heads,
            k_dim,
            group,
            v_dim,
        } = self.geometry;
        let vg = group * v_dim;
        let per = 2 * k_dim + 2 * vg;
        let head_rows = |h: usize, off: usize, n: usize| h * per + off..h * per + off + n;
        match part {
            Part::Qkv => (0..k_heads)
                .flat_map(|h| head_rows(h, 0, k_dim))
                .chain((0..k_heads).flat_map(|h| head_rows(h, k_dim, k_dim)))
                .chain((0..k_heads).flat_map(|h| head_rows(h, 2 * k_dim, vg)))
                .collect(),
            Part::Z => (0..k_heads)
                .flat_map(|h| head_rows(h, 2 * k_dim + vg, vg))
                .collect(),
            Part::B => (0..k_heads)
                .flat_map(|h| h * 2 * group..h * 2 * group + group)
                .collect(),
            Part::A => (0..k_heads)
                .flat_map(|h| h * 2 * group + group..(h + 1) * 2 * group)
                .collect(),
        }
    }
}

impl WeightSource for FusedProjections<'_> {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn tensor(&self, name: &str) -> Result<Option<HostTensor<'_>>> {
        let split = [
            (
                ".linear_attn.in_proj_qkv.weight",
                ".linear_attn.in_proj_qkvz.weight",
                Part::Qkv,
            ),
            (
                ".linear_attn.in_proj_z.weight",
                ".linear_attn.in_proj_qkvz.weight",
                Part::Z,
            ),
            (
                ".linear_attn.in_proj_b.weight",
                ".linear_attn.in_proj_ba.weight",
                Part::B,
            ),
            (
                ".linear_attn.in_proj_a.weight",
                ".linear_attn.in_proj_ba.weight",
                Part::A,
            ),
        ];
        let Some((layer, fused, part)) = split
            .iter()
            .find_map(|(s, f, p)| name.strip_suffix(s).map(|l| (l, *f, *p)))
        else {
            return self.inner.tensor(name);
        };
        let fused_name = format!("{layer}{fused}");
        let Some(t) = self.inner.tensor(&fused_name)? else {
            return Ok(None);
        };
        let rows = self.rows(part);
        let (n, width) = match t.shape.as_slice() {
            [n, w] => (*n, *w),
            s => {
                return Err(CoreError::load(format!(
                    "{}: tensor '{fused_name}' has shape {s:?}, expected 2 dimensions",
                    self.describe()
                )));
            }
        };
        let expected = match part {
            Part::Qkv | Part::Z => self.rows(Part::Qkv).len() + self.rows(Part::Z).len(),
            Part::B | Part::A => 2 * self.rows(Part::B).len(),
        };
        if n != expected || t.dtype.block_size() != 1 {
            return Err(CoreError::load(format!(
                "{}: tensor '{fused_name}' ({} {:?}) cannot be split into {expected} rows of \
                 whole {} elements",
                self.describe(),
                t.dtype,
                t.shape,
                if t.dtype.block_size() == 1 {
                    ""
                } else {
                    "(unquantized)"
                }
            )));
        }
        let row_bytes = t.dtype.bytes_for(width)?;
        let mut data = Vec::with_capacity(rows.len() * row_bytes);
        for r in &rows {
            data.extend_from_slice(&t.data[r * row_bytes..(r + 1) * row_bytes]);
        }
        Ok(Some(HostTensor {
            dtype: t.dtype,
            shape: vec![rows.len(), width],
            data: Cow::Owned(data),
        }))
    }
}
