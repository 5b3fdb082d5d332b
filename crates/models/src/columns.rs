//! Column blocks of f32 activations, moved with the backend's row gather:
//! a `[m, n]` tensor is also the `[m·n/g, g]` tensor of its `g`-wide
//! chunks, so a block of columns whose start and width are multiples of
//! `g` is a set of chunk rows. Latent attention splits its fused
//! down-projection's output into blocks and joins its key's halves this way
//! ([`Blocks`]), and multiplies each head's columns by that head's own
//! matrix ([`linear_per_head`]), all on the device.
//!
//! Invariants: a gather copies values, so the moved columns are exact;
//! each output row depends on its own input row only (the per-head
//! products are the backend's batch-invariant `linear`), so the results
//! are batch-invariant wherever the backend's are.

use arbor_engine_core::{Backend, CoreError, DType, Result, Tensor};

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Tensors `[rows, w_i]` laid out one after another in one f32 buffer, so
/// that one gather fills them all from column blocks of a tensor
/// ([`Blocks::take`]) and one gather joins them side by side
/// ([`Blocks::join`]).
pub(crate) struct Blocks {
    /// The buffer, `[rows·Σw, 1]`.
    buf: Tensor,
    widths: Vec<usize>,
    rows: usize,
}

impl Blocks {
    /// Blocks of `rows` rows and the given widths (each at least 1).
    pub(crate) fn alloc(b: &dyn Backend, rows: usize, widths: &[usize]) -> Result<Self> {
        if widths.is_empty() || widths.contains(&0) {
            return Err(CoreError::invalid(format!(
                "column blocks of widths {widths:?}"
            )));
        }
        Ok(Self {
            buf: b.alloc(DType::F32, &[rows * widths.iter().sum::<usize>(), 1])?,
            widths: widths.to_vec(),
            rows,
        })
    }

    fn total(&self) -> usize {
        self.widths.iter().sum()
    }

    /// The buffer as `[·, g]` chunks.
    fn chunks(&self, g: usize) -> Result<Tensor> {
        self.buf.reshape(&[self.rows * self.total() / g, g])
    }

    /// Block `i`, `[rows, widths[i]]`.
    pub(crate) fn block(&self, i: usize) -> Result<Tensor> {
        let before: usize = self.widths[..i].iter().sum();
        self.buf
            .narrow(self.rows * before, self.rows * self.widths[i])?
            .reshape(&[self.rows, self.widths[i]])
    }

    /// Block `i` = `x[:, starts[i]..starts[i] + widths[i]]` for every block,
    /// from f32 `x` `[rows, n]`.
    pub(crate) fn take(&self, b: &dyn Backend, x: &Tensor, starts: &[usize]) -> Result<()> {
        let n = x.row_len();
        if x.dtype() != DType::F32
            || x.rows() != self.rows
            || starts.len() != self.widths.len()
            || starts.iter().zip(&self.widths).any(|(s, w)| s + w > n)
        {
            return Err(CoreError::invalid(format!(
                "take column blocks of widths {:?} at {starts:?} from {x:?}",
                self.widths
            )));
        }
        if self.rows == 0 {
            return Ok(());
        }
        let g = self.widths.iter().chain(starts).fold(n, |g, &v| gcd(g, v));
        let mut idx = Vec::with_capacity(self.rows * self.total() / g);
        for (&w, &start) in self.widths.iter().zip(starts) {
            for r in 0..self.rows {
                let first = (r * n + start) / g;
                idx.extend((first..first + w / g).map(|c| c as u32));
            }
        }
        b.gather_rows(
            &x.reshape(&[self.rows * n / g, g])?,
            &b.upload_u32(&[idx.len()], &idx)?,
            &self.chunks(g)?,
        )
    }

    /// `out = [block 0 | block 1 | ...]`, `out` f32 `[rows, Σ widths]`.
    pub(crate) fn join(&self, b: &dyn Backend, out: &Tensor) -> Result<()> {
        let total = self.total();
        if out.dtype() != DType::F32 || out.shape() != [self.rows, total] {
            return Err(CoreError::invalid(format!(
                "join column blocks of widths {:?} into {out:?}",
                self.widths
            )));
        }
        if self.rows == 0 {
            return Ok(());
        }
        let g = self.widths.iter().fold(0, |g, &w| gcd(g, w));
        let mut idx = Vec::with_capacity(self.rows * total / g);
        for r in 0..self.rows {
            let mut before = 0;
            for &w in &self.widths {
                let first = (self.rows * before + r * w) / g;
                idx.extend((first..first + w / g).map(|c| c as u32));
                before += w;
            }
        }
        b.gather_rows(
            &self.chunks(g)?,
            &b.upload_u32(&[idx.len()], &idx)?,
            &out.reshape(&[self.rows * total / g, g])?,
        )
    }
}

/// `out[:, h·k..(h+1)·k] = x[:, h·a..(h+1)·a] · w[h·k..(h+1)·k]ᵀ` for each
/// head `h` of `heads`: f32 `x` `[t, heads·a]` and `out` `[t, heads·k]`, a
/// weight `w` `[heads·k, a]` of any dtype the backend multiplies. The
/// inputs are gathered head by head into one `[heads·t, a]` tensor, each
/// head's rows meet its weight rows in one `linear`, and the results are
/// gathered back into token order.
pub(crate) fn linear_per_head(
    b: &dyn Backend,
    x: &Tensor,
    w: &Tensor,
    heads: usize,
    out: &Tensor,
) -> Result<()> {
    let t = x.rows();
    let bad = || {
        CoreError::invalid(format!(
            "{heads} per-head products of {x:?} by {w:?} into {out:?}"
        ))
    };
    if heads == 0
        || !x.row_len().is_multiple_of(heads)
        || !out.row_len().is_multiple_of(heads)
        || out.rows() != t
    {
        return Err(bad());
    }
    let (a, k) = (x.row_len() / heads, out.row_len() / heads);
    if w.shape() != [heads * k, a] {
        return Err(bad());
    }
    if t == 0 {
        return Ok(());
    }
    if heads == 1 {
        return b.linear(x, w, None, out);
    }
    let f32t = |shape: &[usize]| b.alloc(DType::F32, shape);
    // Head-major rows: row h·t + r is token r's head h.
    let to_heads: Vec<u32> = (0..heads)
        .flat_map(|h| (0..t).map(move |r| (r * heads + h) as u32))
        .collect();
    let xs = f32t(&[heads * t, a])?;
    b.gather_rows(
        &x.reshape(&[t * heads, a])?,
        &b.upload_u32(&[to_heads.len()], &to_heads)?,
        &xs,
    )?;
    let ys = f32t(&[heads * t, k])?;
    for h in 0..heads {
        b.linear(
            &xs.narrow(h * t, t)?,
            &w.narrow(h * k, k)?,
            None,
            &ys.narrow(h * t, t)?,
        )?;
    }
    let to_tokens: Vec<u32> = (0..t)
        .flat_map(|r| (0..heads).map(move |h| (h * t + r) as u32))
        .collect();
    b.gather_rows(
        &ys,
        &b.upload_u32(&[to_tokens.len()], &to_tokens)?,
        &out.reshape(&[t * heads, k])?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_backend_cpu::CpuBackend;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000)
            .map(|v| v as f32 / 250.0 - 2.0)
            .collect()
    }

    /// Blocks taken at offsets of every common divisor come back exact,
    /// and a block past the row is an error.
    #[test]
    fn blocks_take_columns() -> Result<()> {
        let b = CpuBackend::new(1)?;
        let b: &dyn Backend = &b;
        let (m, n) = (3, 12);
        let v = values(m * n, 7);
        let x = b.upload_f32(&[m, n], &v)?;
        let cols = |start: usize, w: usize| -> Vec<f32> {
            (0..m)
                .flat_map(|r| v[r * n + start..r * n + start + w].to_vec())
                .collect()
        };
        for (widths, starts) in [
            (vec![12], vec![0]),
            (vec![5, 3], vec![3, 0]),
            (vec![4, 8], vec![8, 0]),
            (vec![1, 2], vec![11, 4]),
        ] {
            let blocks = Blocks::alloc(b, m, &widths)?;
            blocks.take(b, &x, &starts)?;
            for (i, (&w, &start)) in widths.iter().zip(&starts).enumerate() {
                assert_eq!(b.download_f32(&blocks.block(i)?)?, cols(start, w));
            }
        }
        let blocks = Blocks::alloc(b, m, &[5])?;
        assert!(blocks.take(b, &x, &[8]).is_err());
        Ok(())
    }

    /// Blocks written one by one join into one row each, in order.
    #[test]
    fn blocks_join_their_columns() -> Result<()> {
        let b = CpuBackend::new(1)?;
        let b: &dyn Backend = &b;
        let (m, widths) = (3, [4, 6, 2]);
        let blocks = Blocks::alloc(b, m, &widths)?;
        let vals: Vec<Vec<f32>> = (0..3).map(|i| values(m * widths[i], i as u32)).collect();
        for (i, v) in vals.iter().enumerate() {
            b.write(
                &blocks.block(i)?,
                &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
            )?;
        }
        let out = b.alloc(DType::F32, &[m, 12])?;
        blocks.join(b, &out)?;
        let want: Vec<f32> = (0..m)
            .flat_map(|r| {
                (0..3).flat_map(move |i| (0..widths[i]).map(move |j| (i, r * widths[i] + j)))
            })
            .map(|(i, at)| vals[i][at])
            .collect();
        assert_eq!(b.download_f32(&out)?, want);
        assert!(blocks.join(b, &b.alloc(DType::F32, &[m, 11])?).is_err());
        Ok(())
    }

    /// Each head's columns meet that head's weight rows only, and a row's
    /// result does not depend on the other rows of the batch.
    #[test]
    fn linear_per_head_multiplies_each_head_by_its_own_matrix() -> Result<()> {
        let b = CpuBackend::new(2)?;
        let b: &dyn Backend = &b;
        let (t, heads, a, k) = (5, 3, 8, 6);
        let xv = values(t * heads * a, 3);
        let wv = values(heads * k * a, 11);
        let x = b.upload_f32(&[t, heads * a], &xv)?;
        let w = b.upload_f32(&[heads * k, a], &wv)?;
        let out = b.alloc(DType::F32, &[t, heads * k])?;
        linear_per_head(b, &x, &w, heads, &out)?;
        let got = b.download_f32(&out)?;
        for r in 0..t {
            for h in 0..heads {
                for j in 0..k {
                    let want: f64 = (0..a)
                        .map(|i| {
                            f64::from(xv[r * heads * a + h * a + i])
                                * f64::from(wv[(h * k + j) * a + i])
                        })
                        .sum();
                    let g = got[r * heads * k + h * k + j];
                    assert!(
                        (f64::from(g) - want).abs() < 1e-4,
                        "row {r} head {h} col {j}"
                    );
                }
            }
        }
        // Row 2 alone gives the same bits as in the batch of 5.
        let one = b.alloc(DType::F32, &[1, heads * k])?;
        linear_per_head(b, &x.narrow(2, 1)?, &w, heads, &one)?;
        assert_eq!(b.download_f32(&one)?, got[2 * heads * k..3 * heads * k]);
        let bad = b.alloc(DType::F32, &[t, heads * k + 1])?;
        assert!(linear_per_head(b, &x, &w, heads, &bad).is_err());
        Ok(())
    }
}
