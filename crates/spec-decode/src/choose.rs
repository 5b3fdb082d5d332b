//! Choosing draft tokens from a drafter's logits rows: the argmax on the
//! device for greedy requests; for a request sampled at temperature > 0, a
//! draw on the host from the standard sampler's filtered distribution
//! (`sampling::filtered_candidates`), returned with the token so that
//! verification can run speculative sampling against it.
//!
//! Invariant: a returned distribution is normalized (its probabilities sum
//! to 1) and contains the drawn token.

use arbor_engine_core::backend::SampleRow;
use arbor_engine_core::error::Result;
use arbor_engine_core::sampling::filtered_candidates;
use arbor_engine_core::{Backend, DType, DraftDist, SamplingParams, SeqRng, Tensor};

/// A row's draft token and, when drawn, the distribution it was drawn from
/// (ids in the logits' vocabulary).
pub(crate) type Choice = (u32, Option<DraftDist>);

/// A (probability, draft id) pair.
pub(crate) type Weighted = (f32, u32);

/// One choice per row of `logits` (f32 `[rows, vocab]`); `sampling[i]` is
/// set for a row drawn at temperature > 0.
pub(crate) fn choose(
    backend: &(dyn Backend + 'static),
    logits: &Tensor,
    sampling: &mut [Option<(&SamplingParams, &mut SeqRng)>],
) -> Result<Vec<Choice>> {
    let n = sampling.len();
    let greedy = SampleRow {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
    };
    let picked = backend.alloc(DType::U32, &[n])?;
    backend.sample(logits, &vec![greedy; n], &picked)?;
    let mut bytes = vec![0u8; n * 4];
    backend.download(&picked, &mut bytes)?;
    let mut out: Vec<Choice> = bytes
        .chunks_exact(4)
        .map(|c| (u32::from_le_bytes([c[0], c[1], c[2], c[3]]), None))
        .collect();
    if sampling.iter().all(Option::is_none) {
        return Ok(out);
    }
    let all = backend.download_f32(logits)?;
    let vocab = logits.row_len();
    for (i, s) in sampling.iter_mut().enumerate() {
        if let Some((params, rng)) = s {
            let row = &all[i * vocab..(i + 1) * vocab];
            if let Some(c) = draw(row, params, rng) {
                out[i] = c;
            }
        }
    }
    Ok(out)
}

/// The argmax of `row` (the lowest id among equal maxima).
pub(crate) fn argmax(row: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// A draw from `row`'s filtered distribution under `params`, with that
/// distribution; `None` when nothing is finite (the argmax then stands).
pub(crate) fn draw(row: &[f32], params: &SamplingParams, rng: &mut SeqRng) -> Option<Choice> {
    let (drawn, cand) = draw_distinct(row, params, rng, 1)?;
    let token = drawn.first()?.1;
    Some((token, Some(cand.into())))
}

/// Up to `k` distinct tokens drawn without replacement, in draw order, from
/// `row`'s filtered distribution under `params`, each with its probability,
/// and that distribution (normalized); `None` when nothing is finite.
pub(crate) fn draw_distinct(
    row: &[f32],
    params: &SamplingParams,
    rng: &mut SeqRng,
    k: usize,
) -> Option<(Vec<Weighted>, Vec<Weighted>)> {
    let mut cand = filtered_candidates(row, params)?;
    let total: f32 = cand.iter().map(|c| c.0).sum();
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    for c in cand.iter_mut() {
        c.0 /= total;
    }
    let mut left: Vec<f32> = cand.iter().map(|c| c.0).collect();
    let mut drawn = Vec::with_capacity(k);
    for _ in 0..k {
        let mass: f32 = left.iter().sum();
        if mass <= 0.0 {
            break;
        }
        let mut r = rng.next_f32() * mass;
        let mut pick = None;
        for (i, &w) in left.iter().enumerate() {
            if w > 0.0 {
                pick = Some(i);
                r -= w;
                if r < 0.0 {
                    break;
                }
            }
        }
        let Some(i) = pick else { break };
        drawn.push(cand[i]);
        left[i] = 0.0;
    }
    Some((drawn, cand))
}
