//! The feed-forward step of data-parallel attention (SGLang's
//! `--enable-dp-attention`): each rank's attention ran on its own tokens;
//! [`feed_forward_over_ranks`] gathers every rank's rows (in rank order),
//! runs the sharded feed-forward on all of them, and hands each rank its
//! own rows of the reduced result.
//!
//! Invariants: every rank calls it once per layer, a rank with no tokens
//! too (it contributes no rows and takes none back, but its shard of the
//! feed-forward still runs on the others' rows, which their reduction
//! needs); the gathered rows are the same on every rank, so the experts'
//! routing and the all-to-all blocks agree across ranks.

use arbor_engine_core::comm::Communicator;
use arbor_engine_core::{Backend, CoreError, DType, Result, Tensor};

/// Runs `ffn` (input rows, output rows; it reduces over the ranks itself)
/// on every rank's rows of `x` gathered in rank order, and writes this
/// rank's rows of the result to `out` (`[rows of x, width]`).
pub(crate) fn feed_forward_over_ranks(
    b: &dyn Backend,
    comm: &dyn Communicator,
    x: &Tensor,
    out: &Tensor,
    ffn: impl FnOnce(&Tensor, &Tensor) -> Result<()>,
) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let width = x.row_len();
    let got = comm.all_to_all(&vec![x.clone(); world])?;
    if got.len() != world || got.iter().any(|g| g.row_len() != width && g.rows() > 0) {
        return Err(CoreError::Internal(format!(
            "rank {rank}: the gathered rows of the feed-forward do not match {x:?}"
        )));
    }
    let total: usize = got.iter().map(Tensor::rows).sum();
    let offset: usize = got[..rank].iter().map(Tensor::rows).sum();
    if total == 0 {
        // No rank has a token: nobody enters the feed-forward's collectives.
        return Ok(());
    }
    let all_in = b.alloc(DType::F32, &[total, width])?;
    let mut at = 0;
    for g in got.iter().filter(|g| g.rows() > 0) {
        b.copy(g, &all_in.narrow(at, g.rows())?)?;
        at += g.rows();
    }
    let all_out = b.alloc(DType::F32, &[total, out.row_len()])?;
    ffn(&all_in, &all_out)?;
    if x.rows() > 0 {
        b.copy(&all_out.narrow(offset, x.rows())?, out)?;
    }
    Ok(())
}
