//! Mixture-of-experts as the core sees it: how the ranks of a group share a
//! layer's experts ([`ExpertSharding`], part of a rank's `ShardSpec`) and the
//! per-expert token counts a model reports ([`ExpertLoad`]). The routing and
//! expert computation themselves belong to the models (`arbor-models`'
//! `moe::routing`).

/// How the ranks of a tensor-parallel group share a MoE layer's routed
/// experts (SGLang's `--ep-size` and `--moe-a2a-backend`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertSharding {
    /// Each rank holds a slice of every expert's width (tensor
    /// parallelism); every rank routes every token and the partial outputs
    /// are all-reduced.
    #[default]
    Split,
    /// Rank `r` of `w` holds experts `[r·E/w, (r+1)·E/w)` whole (expert
    /// parallelism); every rank routes every token, computes its experts'
    /// share, and the shares are all-reduced (`--moe-a2a-backend none`).
    PartitionedAllReduce,
    /// Experts partitioned as above; each rank routes only its block of the
    /// tokens and sends each (token, expert) row to the expert's rank and
    /// the result back (all-to-all dispatch and combine,
    /// `--moe-a2a-backend all-to-all`); the tokens' outputs are then
    /// gathered on every rank.
    PartitionedAllToAll,
}

impl ExpertSharding {
    /// True when each rank holds whole experts (a partition of them).
    pub fn partitioned(self) -> bool {
        self != Self::Split
    }
}

/// Tokens routed to each expert of one MoE layer since start-up (the input
/// of expert-parallel load balancing).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertLoad {
    /// The decoder layer.
    pub layer: usize,
    /// Tokens per expert (each token counts once per expert it is routed to).
    pub tokens: Vec<u64>,
}
