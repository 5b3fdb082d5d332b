//! The fused LoRA kernel ([`Backend::lora_add`](arbor_engine_core::Backend::lora_add)):
//! every adapter segment of a step in one parallel pass.
//!
//! Per row: `t = A x` (r dot products of length `in`), then
//! `out += t[k] · Bᵀ[k]` for k in order (r vector updates of the row, read
//! from the transposed expand factor).
//! Rows of one adapter are processed together, one factor row at a time, so
//! each row of A and Bᵀ is read once per group while it is in cache.
//! The work is split by (row, column range): rows across threads when there
//! are enough of them, else each row's columns across threads (each thread
//! then computes the row's `t` itself, identically). A row's result depends
//! only on that row's values and the fixed [`simd::dot`] order, never on the
//! split, so it is batch-invariant. Threads write disjoint (row, column)
//! ranges of `out`.

use crate::memory::SendPtr;
use crate::pool::share;
use crate::{CpuBackend, simd};
use arbor_engine_core::{CoreError, DType, LoraRows, Result, Tensor};

/// Below this many multiply-adds the kernel runs on the calling thread.
const PARALLEL_MIN: usize = 64 * 1024;

struct Entry {
    rows: std::ops::Range<usize>,
    a: SendPtr<f32>,
    bt: SendPtr<f32>,
    rank: usize,
}

pub fn lora_add(b: &CpuBackend, x: &Tensor, out: &Tensor, entries: &[LoraRows<'_>]) -> Result<()> {
    let (t, inp, outd) = (x.rows(), x.row_len(), out.row_len());
    if out.rows() != t {
        return Err(CoreError::invalid(format!(
            "LoRA on {x:?} into {out:?}: the row counts differ"
        )));
    }
    let mut list = Vec::with_capacity(entries.len());
    let mut end = 0;
    for e in entries {
        let r = e.a.rows();
        if e.a.row_len() != inp || e.bt.shape() != [r, outd] {
            return Err(CoreError::invalid(format!(
                "LoRA factors {:?} and {:?} do not fit {x:?} -> {out:?}",
                e.a, e.b
            )));
        }
        if e.rows.start < end || e.rows.end > t {
            return Err(CoreError::invalid(format!(
                "LoRA rows {:?} overlap or leave a batch of {t} rows",
                e.rows
            )));
        }
        end = e.rows.end;
        out.check_no_overlap(&[x, e.a, e.bt])?;
        list.push(Entry {
            rows: e.rows.clone(),
            a: SendPtr(b.view(e.a, DType::F32)?.ptr as *mut f32),
            bt: SendPtr(b.view(e.bt, DType::F32)?.ptr as *mut f32),
            rank: r,
        });
    }
    let xp = SendPtr(b.view(x, DType::F32)?.ptr as *mut f32);
    let op = SendPtr(b.view(out, DType::F32)?.ptr as *mut f32);
    let rows: Vec<(usize, &Entry)> = list
        .iter()
        .flat_map(|e| e.rows.clone().map(move |r| (r, e)))
        .collect();
    let max_rank = list.iter().map(|e| e.rank).max().unwrap_or(0);
    // Rows `r0..r1` of the list, output columns `c0..c1` of each. Rows of one
    // adapter go together, factor row by factor row, so each row of A and Bᵀ
    // is read once per group while it is in cache; per output row the
    // operations and their order are those of the row alone.
    let run = |r0: usize, r1: usize, c0: usize, c1: usize| {
        let mut shrunk: Vec<f32> = Vec::new();
        let mut g0 = r0;
        while g0 < r1 {
            let e = rows[g0].1;
            let mut g1 = g0 + 1;
            while g1 < r1 && std::ptr::eq(rows[g1].1, e) {
                g1 += 1;
            }
            let group = &rows[g0..g1];
            let r = e.rank;
            shrunk.clear();
            shrunk.resize(group.len() * r, 0.0);
            // SAFETY: x, A and Bᵀ are read-only views of their full extents;
            // this call alone writes columns c0..c1 of these rows of `out`.
            unsafe {
                let a = std::slice::from_raw_parts(e.a.get(), r * inp);
                let bt = std::slice::from_raw_parts(e.bt.get(), r * outd);
                for k in 0..r {
                    let ak = &a[k * inp..(k + 1) * inp];
                    for (i, &(row, _)) in group.iter().enumerate() {
                        let xr = std::slice::from_raw_parts(xp.get().add(row * inp), inp);
                        shrunk[i * r + k] = simd::dot(ak, xr);
                    }
                }
                for k in 0..r {
                    let bk = &bt[k * outd + c0..k * outd + c1];
                    for (i, &(row, _)) in group.iter().enumerate() {
                        let o =
                            std::slice::from_raw_parts_mut(op.get().add(row * outd + c0), c1 - c0);
                        simd::axpy(shrunk[i * r + k], bk, o);
                    }
                }
            }
            g0 = g1;
        }
    };
    let n = rows.len();
    let work = n * max_rank * (inp + outd);
    let threads = b.threads();
    if work < PARALLEL_MIN || threads <= 1 {
        run(0, n, 0, outd);
        return Ok(());
    }
    if n >= threads {
        return b.parallel(&|i, k| {
            let (r0, r1) = share(n, i, k, 1);
            if r0 < r1 {
                run(r0, r1, 0, outd);
            }
        });
    }
    // Few rows: split each row's columns.
    b.parallel(&|i, k| {
        let (c0, c1) = share(outd, i, k, 16);
        if c0 < c1 {
            run(0, n, c0, c1);
        }
    })
}
