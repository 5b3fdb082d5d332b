//! Admission order of waiting requests (SGLang's schedule policies).
//!
//! - `fcfs`: arrival order (retracted requests go back to the front).
//! - `lpm`: longest cached prefix first; falls back to `fcfs` when the queue is
//!   longer than `lpm_fallback_queue_len`, since matching every request each
//!   iteration would cost more than it saves.
//! - `dfs-weight`: depth-first over the prefix tree of the waiting requests,
//!   heavier subtrees first, so requests sharing a prefix run together.
//! - `lof`: longest output (`max_new_tokens`) first.
//! - `priority`: higher `priority` first, then arrival order.
//! - `random`: a seeded shuffle.
//!
//! Ordering never changes the cache: `lpm` uses `peek_prefix`.

use super::request::Req;
use crate::error::{CoreError, Result};
use crate::kv::prefix_cache::PrefixCache;
use crate::sampling::SeqRng;
use std::collections::VecDeque;
use std::str::FromStr;

/// How waiting requests are ordered for admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulePolicy {
    Fcfs,
    Lpm,
    DfsWeight,
    Lof,
    Priority,
    Random,
}

impl SchedulePolicy {
    /// Every policy name.
    pub const NAMES: [&'static str; 6] = ["fcfs", "lpm", "dfs-weight", "lof", "priority", "random"];

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            SchedulePolicy::Fcfs => "fcfs",
            SchedulePolicy::Lpm => "lpm",
            SchedulePolicy::DfsWeight => "dfs-weight",
            SchedulePolicy::Lof => "lof",
            SchedulePolicy::Priority => "priority",
            SchedulePolicy::Random => "random",
        }
    }
}

impl FromStr for SchedulePolicy {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "fcfs" => SchedulePolicy::Fcfs,
            "lpm" => SchedulePolicy::Lpm,
            "dfs-weight" | "dfs_weight" => SchedulePolicy::DfsWeight,
            "lof" => SchedulePolicy::Lof,
            "priority" => SchedulePolicy::Priority,
            "random" => SchedulePolicy::Random,
            other => {
                return Err(CoreError::Config(format!(
                    "schedule_policy '{other}' is unknown (one of {})",
                    Self::NAMES.join(", ")
                )));
            }
        })
    }
}

/// Indices into `waiting`, in admission order.
pub(crate) fn order(
    policy: SchedulePolicy,
    waiting: &VecDeque<Req>,
    cache: &dyn PrefixCache,
    lpm_fallback: usize,
    rng: &mut SeqRng,
) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..waiting.len()).collect();
    match policy {
        SchedulePolicy::Fcfs => {}
        SchedulePolicy::Lpm => {
            if waiting.len() <= lpm_fallback {
                let matched: Vec<usize> = waiting
                    .iter()
                    .map(|r| {
                        let t = r.tokens();
                        cache.peek_prefix(&r.ns, &t[..t.len().saturating_sub(1)])
                    })
                    .collect();
                idx.sort_by_key(|&i| std::cmp::Reverse(matched[i]));
            }
        }
        SchedulePolicy::DfsWeight => {
            let seqs: Vec<Vec<u32>> = waiting.iter().map(Req::tokens).collect();
            idx.sort_by(|&a, &b| seqs[a].cmp(&seqs[b]));
            let mut out = Vec::with_capacity(idx.len());
            dfs(&seqs, &mut idx, 0, &mut out);
            idx = out;
        }
        SchedulePolicy::Lof => {
            idx.sort_by_key(|&i| std::cmp::Reverse(waiting[i].token_limit()));
        }
        SchedulePolicy::Priority => {
            idx.sort_by_key(|&i| std::cmp::Reverse(waiting[i].priority));
        }
        SchedulePolicy::Random => {
            for i in (1..idx.len()).rev() {
                let j = (rng.next_u64() % (i as u64 + 1)) as usize;
                idx.swap(i, j);
            }
        }
    }
    idx
}

/// Depth-first order over lexicographically sorted sequences sharing `depth`
/// tokens: sequences ending here first, then child groups, heaviest first.
fn dfs(seqs: &[Vec<u32>], group: &mut [usize], depth: usize, out: &mut Vec<usize>) {
    if group.len() <= 1 {
        out.extend_from_slice(group);
        return;
    }
    // Skip the prefix the whole (sorted) group shares.
    let first = &seqs[group[0]];
    let last = &seqs[group[group.len() - 1]];
    let lcp = first
        .iter()
        .zip(last.iter())
        .skip(depth)
        .take_while(|(a, b)| a == b)
        .count();
    let depth = depth + lcp;
    let mut children: Vec<(usize, usize)> = Vec::new(); // (start, end) in group
    let mut i = 0;
    while i < group.len() {
        let key = seqs[group[i]].get(depth);
        let mut j = i + 1;
        while j < group.len() && seqs[group[j]].get(depth) == key {
            j += 1;
        }
        if key.is_none() {
            out.extend_from_slice(&group[i..j]);
        } else {
            children.push((i, j));
        }
        i = j;
    }
    children.sort_by_key(|&(a, b)| std::cmp::Reverse(b - a));
    for (a, b) in children {
        dfs(seqs, &mut group[a..b], depth + 1, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dfs_groups_shared_prefixes_heaviest_first() {
        let seqs = vec![
            vec![9, 1],
            vec![1, 2, 3],
            vec![9, 2],
            vec![1, 2, 4],
            vec![1, 5],
            vec![9, 1, 7],
            vec![9, 3],
        ];
        let mut idx: Vec<usize> = (0..seqs.len()).collect();
        idx.sort_by(|&a, &b| seqs[a].cmp(&seqs[b]));
        let mut out = Vec::new();
        dfs(&seqs, &mut idx, 0, &mut out);
        // Group 9 (4 requests) before group 1 (3); inside 1, [1,2,*] (2) before [1,5].
        assert_eq!(out, vec![0, 5, 2, 6, 1, 3, 4]);
    }

    #[test]
    fn names_round_trip() {
        for n in SchedulePolicy::NAMES {
            assert_eq!(n.parse::<SchedulePolicy>().unwrap().name(), n);
        }
        assert!("lifo".parse::<SchedulePolicy>().is_err());
    }
}
