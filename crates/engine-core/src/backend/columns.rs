//! Column operations on f32 activations built from a backend's row ops:
//! the portable forms of [`Backend::linear_heads`] and
//! [`Backend::concat_cols`] (their default implementations, which a
//! backend with a native form falls back to for what that form does not
//! take), and [`take_cols`], which cuts a block of columns into a tensor of
//! its own.
//!
//! They rest on one fact: a `[m, n]` tensor is also the `[m·n/g, g]` tensor
//! of its `g`-wide chunks, so a block of columns whose start and width are
//! multiples of `g` is a set of chunk rows, moved by `gather_rows`.
//!
//! Invariants: a gather copies values, so moved columns are exact; every
//! output row depends on its own input row only (the per-head products are
//! the backend's batch-invariant `linear`), so the results are
//! batch-invariant wherever the backend's `linear` is. Every result is a
//! whole tensor of its own, never a view into a shared buffer.

use crate::backend::Backend;
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::tensor::{HostTensor, Tensor};

/// Row indices uploaded as a u32 tensor.
fn indices<B: Backend + ?Sized>(b: &B, idx: &[u32]) -> Result<Tensor> {
    b.upload(&HostTensor {
        dtype: DType::U32,
        shape: vec![idx.len()],
        data: idx
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>()
            .into(),
    })
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The shape of `heads` per-head products of `x` `[t, heads·a]` by `w`
/// `[heads·k, a]` into `out` `[t, heads·k]` (f32 activations): `(t, a, k)`,
/// or an error naming the operands.
pub fn heads_dims(
    x: &Tensor,
    w: &Tensor,
    heads: usize,
    out: &Tensor,
) -> Result<(usize, usize, usize)> {
    let bad = || {
        CoreError::invalid(format!(
            "{heads} per-head products of {x:?} by {w:?} into {out:?}"
        ))
    };
    if heads == 0
        || x.dtype() != DType::F32
        || out.dtype() != DType::F32
        || !x.row_len().is_multiple_of(heads)
        || !out.row_len().is_multiple_of(heads)
        || out.rows() != x.rows()
    {
        return Err(bad());
    }
    let (a, k) = (x.row_len() / heads, out.row_len() / heads);
    if w.shape() != [heads * k, a] {
        return Err(bad());
    }
    Ok((x.rows(), a, k))
}

/// [`Backend::linear_heads`] from row gathers and `linear`: the inputs are
/// gathered head by head into one `[heads·t, a]` tensor, each head's rows
/// meet its weight rows in one `linear`, and the results are gathered back
/// into token order. Takes any weight dtype the backend's `linear` takes.
pub fn linear_heads_by_rows<B: Backend + ?Sized>(
    b: &B,
    x: &Tensor,
    w: &Tensor,
    heads: usize,
    out: &Tensor,
) -> Result<()> {
    let (t, a, k) = heads_dims(x, w, heads, out)?;
    if t == 0 {
        return Ok(());
    }
    if heads == 1 {
        return b.linear(x, w, None, out);
    }
    // Head-major rows: row h·t + r is token r's head h.
    let to_heads: Vec<u32> = (0..heads)
        .flat_map(|h| (0..t).map(move |r| (r * heads + h) as u32))
        .collect();
    let xs = b.alloc(DType::F32, &[heads * t, a])?;
    b.gather_rows(&x.reshape(&[t * heads, a])?, &indices(b, &to_heads)?, &xs)?;
    let ys = b.alloc(DType::F32, &[heads * t, k])?;
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
        &indices(b, &to_tokens)?,
        &out.reshape(&[t * heads, k])?,
    )
}

/// The row count and widths of `parts` joined side by side into `out`
/// (all f32, every part as many rows as `out`, the widths summing to
/// `out`'s), or an error naming them.
pub fn concat_dims(parts: &[&Tensor], out: &Tensor) -> Result<(usize, Vec<usize>)> {
    let widths: Vec<usize> = parts.iter().map(|p| p.row_len()).collect();
    if parts.is_empty()
        || out.dtype() != DType::F32
        || parts
            .iter()
            .any(|p| p.dtype() != DType::F32 || p.rows() != out.rows() || p.row_len() == 0)
        || widths.iter().sum::<usize>() != out.row_len()
    {
        return Err(CoreError::invalid(format!(
            "join the columns of {parts:?} into {out:?}"
        )));
    }
    out.check_no_overlap(parts)?;
    Ok((out.rows(), widths))
}

/// [`Backend::concat_cols`] from copies and one row gather: the parts are
/// copied one after another into one buffer (`[rows·w_i]` each, so part `i`
/// is a run of `w_i/g`-chunk rows) and gathered into `out`'s rows.
pub fn concat_cols_by_rows<B: Backend + ?Sized>(
    b: &B,
    parts: &[&Tensor],
    out: &Tensor,
) -> Result<()> {
    let (rows, widths) = concat_dims(parts, out)?;
    if rows == 0 {
        return Ok(());
    }
    let total = out.row_len();
    let buf = b.alloc(DType::F32, &[rows * total])?;
    let mut before = 0;
    for (p, &w) in parts.iter().zip(&widths) {
        b.copy(p, &buf.narrow(rows * before, rows * w)?.reshape(p.shape())?)?;
        before += w;
    }
    let g = widths.iter().fold(0, |g, &w| gcd(g, w));
    let mut idx = Vec::with_capacity(rows * total / g);
    for r in 0..rows {
        let mut before = 0;
        for &w in &widths {
            let first = (rows * before + r * w) / g;
            idx.extend((first..first + w / g).map(|c| c as u32));
            before += w;
        }
    }
    b.gather_rows(
        &buf.reshape(&[rows * total / g, g])?,
        &indices(b, &idx)?,
        &out.reshape(&[rows * total / g, g])?,
    )
}

/// `x[:, start..start + width]` of f32 `x` `[rows, n]` as a new `[rows,
/// width]` tensor, moved by one row gather on the device.
pub fn take_cols<B: Backend + ?Sized>(
    b: &B,
    x: &Tensor,
    start: usize,
    width: usize,
) -> Result<Tensor> {
    let (rows, n) = (x.rows(), x.row_len());
    if x.dtype() != DType::F32 || width == 0 || start + width > n {
        return Err(CoreError::invalid(format!(
            "take columns {start}..{} of {x:?}",
            start + width
        )));
    }
    let out = b.alloc(DType::F32, &[rows, width])?;
    if rows == 0 {
        return Ok(out);
    }
    let g = gcd(gcd(n, start), width);
    let idx: Vec<u32> = (0..rows)
        .flat_map(|r| {
            let first = (r * n + start) / g;
            (first..first + width / g).map(|c| c as u32)
        })
        .collect();
    b.gather_rows(
        &x.reshape(&[rows * n / g, g])?,
        &indices(b, &idx)?,
        &out.reshape(&[rows * width / g, g])?,
    )?;
    Ok(out)
}
