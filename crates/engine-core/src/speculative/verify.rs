//! Verification of drafts against the target's rows, the rules every
//! executor applies (the host path, and the device path's greedy walk).
//!
//! Verification (greedy): walk the drafts from the root; while the target's
//! token at the current row equals a draft child, accept it and move there;
//! the first disagreement (or the end) contributes the target's own token.
//! Verification (temperature > 0): recursive rejection sampling at each row
//! ([`verify_row`]): a child drawn from the drafter's `q` is accepted with
//! probability `min(1, p(d) / q(d))`, a deterministic one (a point mass)
//! with probability `p(d)`; after a rejection `p` keeps only the residual
//! and the next child is tried; when no child is accepted, the token is
//! drawn from what is left of `p`. The output distribution is then exactly
//! that of plain sampling.

use crate::sampling::{SamplingParams, SeqRng, argmax, filtered_candidates};
use crate::step::{SeqOutput, SeqPlan};

/// The children (row indices within the sampled rows) of row `at`, in order.
pub(crate) fn children(s: &SeqPlan, at: usize) -> Vec<usize> {
    let n = s.sampled_rows().len();
    let base = s.tokens.len() - n;
    match &s.tree {
        Some(parents) => (at + 1..n)
            .filter(|&j| parents[base + j] == (base + at) as i32)
            .collect(),
        None if at + 1 < n => vec![at + 1],
        None => Vec::new(),
    }
}

/// Output of a sequence from the target's token at each sampled row (greedy
/// verification, or a single sampled row).
pub(crate) fn verify_ids(s: &SeqPlan, ids: &[u32]) -> SeqOutput {
    if let [id] = ids {
        // One sampled row: nothing to verify.
        return SeqOutput {
            tokens: smallvec::smallvec![*id],
            ..SeqOutput::default()
        };
    }
    let base = s.tokens.len() - ids.len();
    let mut out = SeqOutput::default();
    let mut at = 0;
    while let Some(&t) = ids.get(at) {
        out.tokens.push(t);
        let next = children(s, at)
            .into_iter()
            .find(|&c| s.tokens[base + c] == t);
        match next {
            Some(c) => {
                out.accepted += 1;
                if s.tree.is_some() {
                    out.extra_mut().accepted_path.push(base + c);
                }
                at = c;
            }
            None => break,
        }
    }
    out
}

/// Verification of one row's draft children (`drafts`, in order) by
/// recursive rejection sampling, which keeps the token's law exactly `p`,
/// the standard sampler's filtered distribution of `logits`. Child `x` is
/// accepted with probability `min(1, p(x) / q(x))`; on rejection `p`
/// becomes `max(0, p - q)` normalized and `q` loses `x` (renormalized), so
/// children drawn from `q` without replacement, in order, are each checked
/// against the law they were drawn from (Leviathan et al. for one child;
/// Jeon et al.'s recursive speculative decoding for several). Without `q`,
/// or for a child that `q` does not hold, the child is a point mass:
/// accepted with probability `p(x)`, after which `p` loses `x` (SGLang's
/// target-only verification). Returns the token and the index of the
/// accepted child (`None`: drawn from what is left of `p`).
pub(crate) fn verify_row(
    logits: &[f32],
    params: &SamplingParams,
    drafts: &[u32],
    q_dist: Option<&[(f32, u32)]>,
    rng: &mut SeqRng,
) -> (u32, Option<usize>) {
    let point = |t: u32| (t, drafts.iter().position(|&d| d == t));
    let Some(cand) = filtered_candidates(logits, params) else {
        // Nothing finite: the plain sampler takes the argmax; so does this.
        return point(argmax(logits));
    };
    // Dense over the vocabulary: each rejection updates every entry.
    let mut p = vec![0f32; logits.len()];
    for (w, t) in cand {
        if let Some(x) = p.get_mut(t as usize) {
            *x = w;
        }
    }
    if !normalize(&mut p) {
        return point(argmax(logits));
    }
    let mut q = Vec::new();
    if let Some(dist) = q_dist {
        q = vec![0f32; logits.len()];
        for &(w, t) in dist {
            if let Some(x) = q.get_mut(t as usize) {
                *x = w;
            }
        }
        if !normalize(&mut q) {
            q.clear();
        }
    }
    for (i, &d) in drafts.iter().enumerate() {
        let pd = p.get(d as usize).copied().unwrap_or(0.0);
        let qd = q.get(d as usize).copied().unwrap_or(0.0);
        // q(d) = 0: d cannot have come from q; it counts as a point mass.
        let accept = if qd > 0.0 { (pd / qd).min(1.0) } else { pd };
        if rng.next_f32() < accept {
            return (d, Some(i));
        }
        // The residual; nothing only through rounding (p = q accepts
        // surely, as does p = δ_d): then p stays.
        if qd > 0.0 {
            let mass: f32 = p.iter().zip(&q).map(|(x, y)| (x - y).max(0.0)).sum();
            if mass > 0.0 && mass.is_finite() {
                for (x, y) in p.iter_mut().zip(&q) {
                    *x = (*x - y).max(0.0) / mass;
                }
            }
        } else if let Some(x) = p.get_mut(d as usize) {
            let pd = std::mem::take(x);
            if !normalize(&mut p) {
                p[d as usize] = pd;
            }
        }
        if let Some(x) = q.get_mut(d as usize) {
            *x = 0.0;
            if !normalize(&mut q) {
                q.clear();
            }
        }
    }
    let mut r = rng.next_f32();
    let mut last = 0;
    for (t, &x) in p.iter().enumerate() {
        if x > 0.0 {
            r -= x;
            last = t;
            if r < 0.0 {
                break;
            }
        }
    }
    (last as u32, None)
}

/// Scales `d` to sum to 1; false when it sums to nothing.
fn normalize(d: &mut [f32]) -> bool {
    let total: f32 = d.iter().sum();
    if total.is_nan() || total <= 0.0 {
        return false;
    }
    for x in d.iter_mut() {
        *x /= total;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Draws `k` distinct tokens from `q` without replacement, in order.
    fn draws(q: &[f32], k: usize, rng: &mut SeqRng) -> Vec<u32> {
        let mut left = q.to_vec();
        let mut out = Vec::new();
        for _ in 0..k {
            let total: f32 = left.iter().sum();
            let mut r = rng.next_f32() * total;
            let mut pick = left.len() - 1;
            for (i, &w) in left.iter().enumerate() {
                if w > 0.0 {
                    pick = i;
                    r -= w;
                    if r < 0.0 {
                        break;
                    }
                }
            }
            out.push(pick as u32);
            left[pick] = 0.0;
        }
        out
    }

    /// Token frequencies and acceptance rate of `n` verifications of `k`
    /// children drawn from `q` (or point masses at `fixed` when set).
    fn run(p: &[f32], q: &[f32], k: usize, fixed: Option<&[u32]>, n: usize) -> (Vec<f64>, f64) {
        let logits: Vec<f32> = p.iter().map(|x| x.ln()).collect();
        let params = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        let dist: Vec<(f32, u32)> = q.iter().enumerate().map(|(t, &w)| (w, t as u32)).collect();
        let mut counts = vec![0usize; p.len()];
        let mut accepted = 0usize;
        let mut rng = SeqRng::new(11);
        for _ in 0..n {
            let (drafts, q) = match fixed {
                Some(f) => (f.to_vec(), None),
                None => (draws(q, k, &mut rng), Some(&dist[..])),
            };
            let (t, acc) = verify_row(&logits, &params, &drafts, q, &mut rng);
            if let Some(i) = acc {
                assert_eq!(drafts[i], t);
                accepted += 1;
            }
            counts[t as usize] += 1;
        }
        let f = counts.iter().map(|&c| c as f64 / n as f64).collect();
        (f, accepted as f64 / n as f64)
    }

    fn assert_close(f: &[f64], p: &[f32]) {
        for (x, &y) in f.iter().zip(p) {
            assert!((x - f64::from(y)).abs() < 0.005, "{f:?} against {p:?}");
        }
    }

    #[test]
    fn one_child_drawn_from_q_keeps_the_distribution() {
        // p = (0.5, 0.3, 0.2); the child drawn from q = (0.1, 0.6, 0.3).
        let p = [0.5f32, 0.3, 0.2];
        let (f, a) = run(&p, &[0.1, 0.6, 0.3], 1, None, 200_000);
        assert_close(&f, &p);
        // Acceptance is sum(min(p, q)) = 0.1 + 0.3 + 0.2 = 0.6.
        assert!((a - 0.6).abs() < 0.005, "accept rate {a}");
    }

    #[test]
    fn children_drawn_without_replacement_keep_the_distribution() {
        let p = [0.4f32, 0.05, 0.25, 0.2, 0.1];
        let q = [0.05f32, 0.4, 0.1, 0.15, 0.3];
        let (f1, a1) = run(&p, &q, 1, None, 200_000);
        assert_close(&f1, &p);
        let (f3, a3) = run(&p, &q, 3, None, 200_000);
        assert_close(&f3, &p);
        // More children drawn from q accept more often.
        assert!(a3 > a1 + 0.1, "1 child {a1}, 3 children {a3}");
        let (f5, a5) = run(&p, &q, 5, None, 100_000);
        assert_close(&f5, &p);
        // All of the vocabulary drawn: one child is always accepted.
        assert!(a5 > 0.99, "3 children {a3}, all 5 {a5}");
    }

    #[test]
    fn point_mass_children_keep_the_distribution() {
        let p = [0.5f32, 0.3, 0.2];
        let (f, a) = run(&p, &[], 1, Some(&[1]), 200_000);
        assert_close(&f, &p);
        assert!((a - 0.3).abs() < 0.005, "accept rate {a}");
        let (f, a) = run(&p, &[], 2, Some(&[2, 0]), 200_000);
        assert_close(&f, &p);
        assert!((a - 0.7).abs() < 0.005, "accept rate {a}");
    }
}
