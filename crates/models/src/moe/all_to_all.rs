//! Expert parallelism with all-to-all dispatch and combine
//! ([`ExpertSharding::PartitionedAllToAll`](super::ExpertSharding), SGLang's
//! `--moe-a2a-backend`): each rank routes only its block of a batch's
//! tokens ([`token_block`]), sends every (token, expert) row to the rank
//! that holds the expert ([`expert_rank`]), which runs each of its experts
//! once over the rows every rank sent it, and sends the results back; each
//! rank then sums its tokens' expert outputs, and [`all_gather_rows`] gives
//! every rank the whole batch's output.
//!
//! Wire format, per destination rank `j` (one [`Communicator::all_to_all`]
//! each): the counts of rows for each of `j`'s experts (`[1, E/w]` f32, exact
//! below 2^24), then the rows themselves (`[n_j, hidden]`), grouped by expert
//! in ascending id and, within an expert, in ascending token order; the
//! combine returns `[n_j, hidden]` in the same order. A rank's rows for its
//! own experts do not go through the communicator (it sends itself an
//! empty block).
//!
//! Invariants: every (token, slot) pair of the routing is computed exactly
//! once, by the expert's rank, in one GEMM per projection per expert over
//! that expert's rows from all sources, stacked contiguously in ascending
//! global token order (token blocks are contiguous in rank order); the
//! token's rank adds a token's outputs weighted, in ascending
//! expert id, with the same [`Backend::scatter_add_rows`] sequence as
//! [`run_experts`](super::run_experts) on one device. So with a
//! batch-invariant linear a token's routed output is bit-identical to the
//! one-device block's, for any world size and any split of the batch.

use super::routing::{ExpertCounter, ExpertWeights, MoeRouting};
use arbor_engine_core::comm::Communicator;
use arbor_engine_core::{Backend, CoreError, DType, Result, Tensor};
use std::ops::Range;

/// The tokens of a `tokens`-row batch that rank `rank` of `world` routes:
/// contiguous blocks in rank order, their sizes differing by at most one.
pub fn token_block(tokens: usize, rank: usize, world: usize) -> Range<usize> {
    let w = world.max(1);
    tokens * rank / w..tokens * (rank + 1) / w
}

/// The rank that holds expert `expert` of `num_experts` partitioned over
/// `world` ranks (contiguous ranges of `num_experts / world`).
pub fn expert_rank(expert: usize, num_experts: usize, world: usize) -> usize {
    expert / (num_experts / world.max(1)).max(1)
}

/// `x` rows `rows` as a new `[rows.len(), hidden]` tensor.
fn select_rows(b: &dyn Backend, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
    let out = b.alloc(DType::F32, &[rows.len(), x.row_len()])?;
    if !rows.is_empty() {
        let idx = b.upload_u32(&[rows.len()], rows)?;
        b.gather_rows(x, &idx, &out)?;
    }
    Ok(out)
}

/// `out = Σ_k weight_k · expert_k(x)` for this rank's tokens `x` (`[t,
/// hidden]` f32) routed by `routing` (global expert ids), with the experts
/// partitioned over `comm`'s ranks: `experts[e]` must hold every expert of
/// this rank (`None` elsewhere). Every rank of the group calls it for the
/// same layer, with its own tokens (possibly none). `load`, when given,
/// counts the rows this rank's experts computed. Overwrites `out`.
pub fn run_experts_all_to_all(
    b: &dyn Backend,
    comm: &dyn Communicator,
    x: &Tensor,
    routing: &MoeRouting,
    experts: &[Option<ExpertWeights>],
    load: Option<&ExpertCounter>,
    out: &Tensor,
) -> Result<()> {
    let (world, rank) = (comm.world_size(), comm.rank());
    let (t, h) = (x.rows(), x.row_len());
    let n_exp = routing.num_experts;
    routing.check_batch(x, out)?;
    if experts.len() != n_exp || !n_exp.is_multiple_of(world) {
        return Err(CoreError::invalid(format!(
            "{} expert slots, {n_exp} experts over {world} ranks",
            experts.len()
        )));
    }
    let per = n_exp / world;
    let mine = rank * per..(rank + 1) * per;
    let local = mine
        .clone()
        .map(|e| {
            experts[e].as_ref().ok_or_else(|| {
                CoreError::invalid(format!("rank {rank} does not hold its expert {e}"))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    // Dispatch: each destination's rows, by expert then token.
    let groups = routing.groups();
    let mut send_rows: Vec<Vec<u32>> = vec![Vec::new(); world];
    let mut send_counts: Vec<Vec<f32>> = vec![vec![0.0; per]; world];
    for g in &groups {
        let j = expert_rank(g.expert, n_exp, world);
        send_rows[j].extend_from_slice(&g.rows);
        send_counts[j][g.expert % per] = g.rows.len() as f32;
    }
    let count_blocks = send_counts
        .iter()
        .map(|c| b.upload_f32(&[1, per], c))
        .collect::<Result<Vec<_>>>()?;
    // This rank's own rows stay here; it sends itself an empty block.
    let row_blocks = send_rows
        .iter()
        .enumerate()
        .map(|(j, rows)| select_rows(b, x, if j == rank { &[] } else { rows }))
        .collect::<Result<Vec<_>>>()?;
    let recv_counts = comm.all_to_all(&count_blocks)?;
    let mut recv_rows = comm.all_to_all(&row_blocks)?;
    recv_rows[rank] = select_rows(b, x, &send_rows[rank])?;
    // counts[s][le]: rows source `s` sent for local expert `le`.
    let mut counts = Vec::with_capacity(world);
    for (s, (c, r)) in recv_counts.iter().zip(&recv_rows).enumerate() {
        let n = b
            .download_f32(c)?
            .iter()
            .map(|&n| {
                if n < 0.0 || n.fract() != 0.0 {
                    Err(CoreError::invalid(format!(
                        "rank {s} sent rank {rank} a bad expert count {n}"
                    )))
                } else {
                    Ok(n as usize)
                }
            })
            .collect::<Result<Vec<usize>>>()?;
        if n.len() != per || n.iter().sum::<usize>() != r.rows() || r.row_len() != h {
            return Err(CoreError::invalid(format!(
                "rank {s} sent rank {rank} {r:?} for counts {n:?}"
            )));
        }
        counts.push(n);
    }
    let (yr, placed) = compute_received(b, &local, mine.start, &recv_rows, &counts, load)?;
    // Combine: each source's rows go back in the order they came.
    let mut back = Vec::with_capacity(world);
    for (s, spans) in placed.iter().enumerate() {
        back.push(if s == rank {
            b.alloc(DType::F32, &[0, h])?
        } else {
            in_source_order(b, &yr, spans)?
        });
    }
    let mut results = comm.all_to_all(&back)?;
    results[rank] = in_source_order(b, &yr, &placed[rank])?;
    for (j, (r, sent)) in results.iter().zip(&send_rows).enumerate() {
        if r.rows() != sent.len() || r.row_len() != h {
            return Err(CoreError::invalid(format!(
                "rank {j} returned {r:?} for {} rows",
                sent.len()
            )));
        }
    }
    // Destinations in rank order hold ascending experts: the groups, in
    // order, are consecutive rows of the results, added group by group as
    // `run_experts` does.
    let acc = b.alloc(DType::F32, &[t, h])?;
    let (mut j, mut at) = (0, 0);
    for g in &groups {
        let dest = expert_rank(g.expert, n_exp, world);
        if dest != j {
            (j, at) = (dest, 0);
        }
        let n = g.rows.len();
        let rows = b.upload_u32(&[n], &g.rows)?;
        let scales = b.upload_f32(&[n], &g.weights)?;
        b.scatter_add_rows(&acc, &rows, &scales, &results[j].narrow(at, n)?)?;
        at += n;
    }
    b.copy(&acc, out)
}

/// Runs this rank's experts over the rows every source sent (`rows[s]`,
/// `counts[s][le]` rows for local expert `le`, in expert order): the rows
/// are stacked expert by expert (sources in rank order within an expert,
/// so in ascending global token order), and each expert runs once over its
/// contiguous rows. Returns the outputs in that stacked order and where
/// each source's rows of each expert sit in it (`[source][local expert]`).
fn compute_received(
    b: &dyn Backend,
    local: &[&ExpertWeights],
    first: usize,
    rows: &[Tensor],
    counts: &[Vec<usize>],
    load: Option<&ExpertCounter>,
) -> Result<(Tensor, Vec<Vec<Range<usize>>>)> {
    let h = rows.first().map_or(0, Tensor::row_len);
    let total: usize = rows.iter().map(Tensor::rows).sum();
    let xr = b.alloc(DType::F32, &[total, h])?;
    let yr = b.alloc(DType::F32, &[total, h])?;
    let mut offsets = vec![0usize; rows.len()];
    let mut placed = vec![Vec::with_capacity(local.len()); rows.len()];
    let (mut at, mut per_expert) = (0, Vec::with_capacity(local.len()));
    for (le, _) in local.iter().enumerate() {
        let start = at;
        for (s, r) in rows.iter().enumerate() {
            let n = counts[s][le];
            if n > 0 {
                b.copy(&r.narrow(offsets[s], n)?, &xr.narrow(at, n)?)?;
            }
            placed[s].push(at..at + n);
            offsets[s] += n;
            at += n;
        }
        per_expert.push(start..at);
    }
    for (w, span) in local.iter().zip(&per_expert) {
        if span.is_empty() {
            continue;
        }
        w.forward(
            b,
            &xr.narrow(span.start, span.len())?,
            &yr.narrow(span.start, span.len())?,
        )?;
    }
    if let Some(l) = load {
        let mut n = vec![0u64; first];
        n.extend(per_expert.iter().map(|span| span.len() as u64));
        l.add(&n);
    }
    Ok((yr, placed))
}

/// One source's rows of the stacked outputs `yr` (at `spans`, one per local
/// expert), back in the order the source sent them.
fn in_source_order(b: &dyn Backend, yr: &Tensor, spans: &[Range<usize>]) -> Result<Tensor> {
    let total = spans.iter().map(Range::len).sum();
    let out = b.alloc(DType::F32, &[total, yr.row_len()])?;
    let mut at = 0;
    for r in spans.iter().filter(|r| !r.is_empty()) {
        b.copy(&yr.narrow(r.start, r.len())?, &out.narrow(at, r.len())?)?;
        at += r.len();
    }
    Ok(out)
}

/// Every rank's `own` block of rows (rank `r`'s are rows
/// [`token_block`]`(out.rows(), r, world)`) gathered into `out` on every
/// rank.
pub fn all_gather_rows(
    b: &dyn Backend,
    comm: &dyn Communicator,
    own: &Tensor,
    out: &Tensor,
) -> Result<()> {
    let (world, rank) = (comm.world_size(), comm.rank());
    let (t, d) = (out.rows(), out.row_len());
    if own.rows() != token_block(t, rank, world).len() || own.row_len() != d {
        return Err(CoreError::invalid(format!(
            "rank {rank}'s block {own:?} of {out:?}"
        )));
    }
    let blocks = vec![own.clone(); world];
    let got = comm.all_to_all(&blocks)?;
    for (s, g) in got.iter().enumerate() {
        let r = token_block(t, s, world);
        if g.rows() != r.len() || g.row_len() != d {
            return Err(CoreError::invalid(format!(
                "rank {s} sent {g:?} for rows {r:?} of {out:?}"
            )));
        }
        if !r.is_empty() {
            b.copy(g, &out.narrow(r.start, r.len())?)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_batch_in_rank_order() {
        for world in 1..=4 {
            for tokens in 0..=9 {
                let mut next = 0;
                for rank in 0..world {
                    let r = token_block(tokens, rank, world);
                    assert_eq!(r.start, next);
                    assert!(r.len() <= tokens / world + 1);
                    next = r.end;
                }
                assert_eq!(next, tokens);
            }
        }
        assert_eq!(expert_rank(5, 8, 2), 1);
        assert_eq!(expert_rank(3, 8, 2), 0);
        assert_eq!(expert_rank(7, 8, 4), 3);
    }
}
