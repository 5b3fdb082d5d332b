//! Mixture-of-experts routing: router scoring and top-k selection ([`route`]), the
//! routing of one batch grouped by expert ([`MoeRouting`]), and the grouped
//! expert computation every backend can run ([`run_experts`]).
//!
//! Invariants:
//! - Routing is decided per token from that token's router logits alone, in
//!   f32, as transformers does (softmax over every expert, top-k, optional
//!   renormalization of the k weights; or DeepSeek's sigmoid scores with the
//!   correction bias and group limit), so a token picks the same experts in
//!   any batch.
//! - [`MoeRouting::groups`] lists the experts that received tokens in
//!   ascending expert id, each with its rows in ascending row order; every
//!   (token, slot) pair appears exactly once.
//! - [`run_experts`] computes each expert once over all of its rows (one
//!   gate/up GEMM, one down GEMM), not once per token, and adds each token's
//!   expert outputs in ascending expert id: a row's output depends on that
//!   row's input and routing only (batch-invariant when the backend's linear
//!   is).

use arbor_engine_core::{Backend, CoreError, DType, LinearRef, Result, Tensor};

/// How router logits become expert weights.
#[derive(Clone, Debug, PartialEq)]
pub enum RouterScoring {
    /// Softmax over all experts, then the top k; with `renormalize` the k
    /// weights are divided by their sum (Mixtral always, Qwen3-MoE when
    /// `norm_topk_prob`).
    SoftmaxTopK {
        /// Divide the chosen weights by their sum.
        renormalize: bool,
    },
    /// DeepSeek-V2 (`greedy`, `group_limited_greedy`): softmax over all
    /// experts; experts are split into `groups`, the `topk_groups` groups
    /// with the highest single score are kept (one group of all experts:
    /// no limit), the top k of those are chosen, and their probabilities
    /// (not renormalized) times `scale` are the weights.
    SoftmaxGroupLimited {
        /// Expert groups (`n_group`; 1 for `greedy`).
        groups: usize,
        /// Groups kept (`topk_group`; 1 for `greedy`).
        topk_groups: usize,
        /// Multiplies the weights (`routed_scaling_factor`).
        scale: f32,
    },
    /// DeepSeek-V3 (`noaux_tc`): sigmoid scores; the choice adds a
    /// per-expert correction bias; experts are split into `groups`, the
    /// `topk_groups` groups with the largest sum of their two best biased
    /// scores are kept, and the top k of those are chosen; the weights are
    /// the unbiased scores (renormalized when asked) times `scale`.
    SigmoidGrouped {
        /// Per-expert correction bias (`e_score_correction_bias`).
        bias: Vec<f32>,
        /// Expert groups (`n_group`).
        groups: usize,
        /// Groups kept (`topk_group`).
        topk_groups: usize,
        /// Divide the chosen weights by their sum (`norm_topk_prob`).
        renormalize: bool,
        /// Multiplies the final weights (`routed_scaling_factor`).
        scale: f32,
    },
}

/// The experts each token of a batch was routed to.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeRouting {
    /// Experts of the layer.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// `[tokens * top_k]` chosen expert ids, each token's in descending weight.
    pub experts: Vec<u32>,
    /// `[tokens * top_k]` the weights of `experts`.
    pub weights: Vec<f32>,
}

/// Running per-expert token counts of one layer, shared by the threads that
/// run forwards.
#[derive(Debug)]
pub struct ExpertCounter {
    counts: Vec<std::sync::atomic::AtomicU64>,
}

impl ExpertCounter {
    /// Zero counts for `num_experts` experts.
    pub fn new(num_experts: usize) -> Self {
        Self {
            counts: (0..num_experts)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
        }
    }

    /// Adds a batch's routing.
    pub fn record(&self, routing: &MoeRouting) {
        self.add(&routing.load());
    }

    /// Adds per-expert token counts.
    pub fn add(&self, tokens: &[u64]) {
        for (c, &n) in self.counts.iter().zip(tokens) {
            c.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The counts so far.
    pub fn snapshot(&self) -> Vec<u64> {
        self.counts
            .iter()
            .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
            .collect()
    }
}

/// One expert's share of a batch.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertGroup {
    /// The expert.
    pub expert: usize,
    /// Rows of the batch routed to it, ascending.
    pub rows: Vec<u32>,
    /// The weight of each row's output.
    pub weights: Vec<f32>,
}

impl MoeRouting {
    /// Tokens routed.
    pub fn tokens(&self) -> usize {
        self.experts.len().checked_div(self.top_k).unwrap_or(0)
    }

    /// The experts that received tokens, ascending, with their rows.
    pub fn groups(&self) -> Vec<ExpertGroup> {
        let mut by_expert: Vec<ExpertGroup> = (0..self.num_experts)
            .map(|expert| ExpertGroup {
                expert,
                rows: Vec::new(),
                weights: Vec::new(),
            })
            .collect();
        for (i, (&e, &w)) in self.experts.iter().zip(&self.weights).enumerate() {
            let g = &mut by_expert[e as usize];
            g.rows.push((i / self.top_k.max(1)) as u32);
            g.weights.push(w);
        }
        by_expert.retain(|g| !g.rows.is_empty());
        by_expert
    }

    /// Checks that it routes the rows of `x` (`[tokens, hidden]`) and that
    /// `out` has `x`'s shape.
    pub fn check_batch(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        let t = x.rows();
        if self.tokens() != t || out.rows() != t || out.row_len() != x.row_len() {
            return Err(CoreError::invalid(format!(
                "experts of {x:?} into {out:?} with a routing of {} tokens",
                self.tokens()
            )));
        }
        Ok(())
    }

    /// Tokens routed to each expert (`[num_experts]`), for load statistics.
    pub fn load(&self) -> Vec<u64> {
        let mut n = vec![0u64; self.num_experts];
        for &e in &self.experts {
            n[e as usize] += 1;
        }
        n
    }
}

/// Indices of the `k` largest values, largest first; ties go to the lower index.
fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Routes each row of `logits` (`[tokens, num_experts]`, row-major) to its
/// `top_k` experts.
pub fn route(
    logits: &[f32],
    num_experts: usize,
    top_k: usize,
    scoring: &RouterScoring,
) -> Result<MoeRouting> {
    if num_experts == 0 || top_k == 0 || top_k > num_experts {
        return Err(CoreError::invalid(format!(
            "routing to {top_k} of {num_experts} experts"
        )));
    }
    if !logits.len().is_multiple_of(num_experts) {
        return Err(CoreError::invalid(format!(
            "{} router logits for {num_experts} experts",
            logits.len()
        )));
    }
    let limits = match scoring {
        RouterScoring::SoftmaxTopK { .. } => None,
        RouterScoring::SoftmaxGroupLimited {
            groups,
            topk_groups,
            ..
        } => Some((num_experts, *groups, *topk_groups)),
        RouterScoring::SigmoidGrouped {
            bias,
            groups,
            topk_groups,
            ..
        } => Some((bias.len(), *groups, *topk_groups)),
    };
    if let Some((biases, groups, topk_groups)) = limits {
        let per_group = num_experts.checked_div(groups).unwrap_or(0);
        if biases != num_experts
            || per_group == 0
            || !num_experts.is_multiple_of(groups)
            || topk_groups == 0
            || topk_groups > groups
            || topk_groups * per_group < top_k
        {
            return Err(CoreError::invalid(format!(
                "grouped routing of {num_experts} experts ({biases} biases) in {groups} groups, \
                 {topk_groups} kept, top {top_k}"
            )));
        }
    }
    let tokens = logits.len() / num_experts;
    let mut experts = Vec::with_capacity(tokens * top_k);
    let mut weights = Vec::with_capacity(tokens * top_k);
    for row in logits.chunks_exact(num_experts) {
        let (chosen, w) = route_row(row, top_k, scoring);
        experts.extend(chosen.iter().map(|&e| e as u32));
        weights.extend(w);
    }
    Ok(MoeRouting {
        num_experts,
        top_k,
        experts,
        weights,
    })
}

fn softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = row.iter().map(|&x| (x - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    exp.iter().map(|&e| e / sum).collect()
}

/// `values` with every expert outside the `kept` groups (of `per_group`
/// experts each) set to `fill`.
fn keep_groups(values: &[f32], per_group: usize, kept: &[usize], fill: f32) -> Vec<f32> {
    values
        .iter()
        .enumerate()
        .map(|(e, &v)| {
            if kept.contains(&(e / per_group)) {
                v
            } else {
                fill
            }
        })
        .collect()
}

fn route_row(row: &[f32], top_k: usize, scoring: &RouterScoring) -> (Vec<usize>, Vec<f32>) {
    match scoring {
        RouterScoring::SoftmaxGroupLimited {
            groups,
            topk_groups,
            scale,
        } => {
            let probs = softmax(row);
            let per_group = row.len() / groups;
            let best: Vec<f32> = probs
                .chunks_exact(per_group)
                .map(|g| g.iter().copied().fold(f32::NEG_INFINITY, f32::max))
                .collect();
            let kept = top_k_indices(&best, *topk_groups);
            let masked = keep_groups(&probs, per_group, &kept, 0.0);
            let chosen = top_k_indices(&masked, top_k);
            let w = chosen.iter().map(|&e| masked[e] * scale).collect();
            (chosen, w)
        }
        RouterScoring::SoftmaxTopK { renormalize } => {
            let probs = softmax(row);
            let chosen = top_k_indices(&probs, top_k);
            let mut w: Vec<f32> = chosen.iter().map(|&e| probs[e]).collect();
            if *renormalize {
                let s: f32 = w.iter().sum();
                w.iter_mut().for_each(|x| *x /= s);
            }
            (chosen, w)
        }
        RouterScoring::SigmoidGrouped {
            bias,
            groups,
            topk_groups,
            renormalize,
            scale,
        } => {
            let scores: Vec<f32> = row.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
            let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
            let per_group = row.len() / groups;
            let group_score: Vec<f32> = biased
                .chunks_exact(per_group)
                .map(|g| {
                    top_k_indices(g, 2.min(per_group))
                        .iter()
                        .map(|&i| g[i])
                        .sum()
                })
                .collect();
            let kept = top_k_indices(&group_score, *topk_groups);
            let masked = keep_groups(&biased, per_group, &kept, f32::NEG_INFINITY);
            let chosen = top_k_indices(&masked, top_k);
            let mut w: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
            if *renormalize {
                let s: f32 = w.iter().sum::<f32>() + 1e-20;
                w.iter_mut().for_each(|x| *x /= s);
            }
            w.iter_mut().for_each(|x| *x *= scale);
            (chosen, w)
        }
    }
}

/// One expert's SwiGLU MLP: `down(silu(gate(x)) * up(x))`, linear weights
/// in the backend's layout (`[out, in]`).
#[derive(Clone, Debug)]
pub struct ExpertWeights {
    /// `[intermediate, hidden]`.
    pub gate: Tensor,
    /// `[intermediate, hidden]`.
    pub up: Tensor,
    /// `[hidden, intermediate]`.
    pub down: Tensor,
    /// The static input scales of W8A8 FP8 weights ([`LinearRef::input_scale`]).
    pub input_scales: ExpertInputScales,
}

/// The static scales a W8A8 FP8 expert rounds its two inputs with (see
/// [`LinearRef::input_scale`]; `None`: the weight's own rule). vLLM and
/// SGLang give every expert of a block the same two: the largest of the
/// block's gate/up scales and the largest of its down scales.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertInputScales {
    /// The scale of the input of `gate` and `up` (the block's hidden state).
    pub gate_up: Option<f32>,
    /// The scale of the input of `down` (the activated intermediate).
    pub down: Option<f32>,
}

impl ExpertWeights {
    /// An expert whose inputs follow its weights' own rule.
    pub fn new(gate: Tensor, up: Tensor, down: Tensor) -> Self {
        Self {
            gate,
            up,
            down,
            input_scales: ExpertInputScales::default(),
        }
    }

    /// The intermediate width.
    pub fn intermediate(&self) -> usize {
        self.gate.rows()
    }

    /// `y = down(silu(gate(x)) * up(x))` for every row of `x` (`[n,
    /// hidden]` f32) into `y` (`[n, hidden]`): one GEMM per projection
    /// over all the rows.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor, y: &Tensor) -> Result<()> {
        let (n, inter) = (x.rows(), self.intermediate());
        let gate = b.alloc(DType::F32, &[n, inter])?;
        let up = b.alloc(DType::F32, &[n, inter])?;
        let scaled = |w, out, input_scale| LinearRef {
            input_scale,
            ..LinearRef::new(w, None, out)
        };
        let gate_up = self.input_scales.gate_up;
        b.linear_many(
            x,
            &[
                scaled(&self.gate, &gate, gate_up),
                scaled(&self.up, &up, gate_up),
            ],
        )?;
        let act = b.alloc(DType::F32, &[n, inter])?;
        b.silu_mul(&gate, &up, &act)?;
        b.linear_many(&act, &[scaled(&self.down, y, self.input_scales.down)])
    }
}

/// `out = Σ_k weight_k · expert_k(x)` for every row of `x` (`[tokens,
/// hidden]` f32), over the experts of `routing`; `experts[e]` is expert `e`
/// (`None`: not on this device, as with expert parallelism, where each
/// device adds its own experts' share and the shares are summed after).
/// Overwrites `out` (`[tokens, hidden]` f32).
///
/// Each expert that received tokens runs once on all of its rows: its rows
/// are gathered, gate and up run as one GEMM pair, then down, and the
/// outputs are added to their rows scaled by their weights.
pub fn run_experts(
    b: &dyn Backend,
    x: &Tensor,
    routing: &MoeRouting,
    experts: &[Option<ExpertWeights>],
    out: &Tensor,
) -> Result<()> {
    let (t, h) = (x.rows(), x.row_len());
    routing.check_batch(x, out)?;
    if experts.len() != routing.num_experts {
        return Err(CoreError::invalid(format!(
            "{} expert slots for a routing over {} experts",
            experts.len(),
            routing.num_experts
        )));
    }
    let acc = b.alloc(DType::F32, &[t, h])?;
    for g in routing.groups() {
        let Some(e) = &experts[g.expert] else {
            continue;
        };
        let n = g.rows.len();
        let xs = if n == t && g.rows.iter().enumerate().all(|(i, &r)| r as usize == i) {
            x.clone()
        } else {
            let rows = b.upload_u32(&[n], &g.rows)?;
            let xs = b.alloc(DType::F32, &[n, h])?;
            b.gather_rows(x, &rows, &xs)?;
            xs
        };
        let y = b.alloc(DType::F32, &[n, h])?;
        e.forward(b, &xs, &y)?;
        let rows = b.upload_u32(&[n], &g.rows)?;
        let scales = b.upload_f32(&[n], &g.weights)?;
        b.scatter_add_rows(&acc, &rows, &scales, &y)?;
    }
    b.copy(&acc, out)
}

/// The same sum as [`run_experts`], one token and one expert at a time (a
/// GEMV per token per chosen expert, in ascending expert id): the baseline
/// the grouped computation is measured and checked against. With a
/// batch-invariant linear the two give bit-identical outputs.
pub fn run_experts_per_token(
    b: &dyn Backend,
    x: &Tensor,
    routing: &MoeRouting,
    experts: &[Option<ExpertWeights>],
    out: &Tensor,
) -> Result<()> {
    let (t, h) = (x.rows(), x.row_len());
    if routing.tokens() != t || experts.len() != routing.num_experts {
        return Err(CoreError::invalid(format!(
            "experts of {x:?} with a routing of {} tokens over {} experts",
            routing.tokens(),
            routing.num_experts
        )));
    }
    let acc = b.alloc(DType::F32, &[t, h])?;
    let k = routing.top_k;
    for row in 0..t {
        let xr = x.narrow(row, 1)?;
        let mut chosen: Vec<(u32, f32)> = (0..k)
            .map(|j| (routing.experts[row * k + j], routing.weights[row * k + j]))
            .collect();
        chosen.sort_by_key(|&(e, _)| e);
        for (e, w) in chosen {
            let Some(ex) = &experts[e as usize] else {
                continue;
            };
            let y = b.alloc(DType::F32, &[1, h])?;
            ex.forward(b, &xr, &y)?;
            let rows = b.upload_u32(&[1], &[row as u32])?;
            let scales = b.upload_f32(&[1], &[w])?;
            b.scatter_add_rows(&acc, &rows, &scales, &y)?;
        }
    }
    b.copy(&acc, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_top_k_renormalizes_when_asked() {
        let logits = [0.0, 2.0, 1.0, -1.0, 3.0, 0.5, 0.0, 0.0];
        let plain = route(
            &logits,
            4,
            2,
            &RouterScoring::SoftmaxTopK { renormalize: false },
        )
        .unwrap();
        assert_eq!(plain.experts, vec![1, 2, 0, 1]);
        let z: f32 = [0.0f32, 2.0, 1.0, -1.0].iter().map(|x| x.exp()).sum();
        assert!((plain.weights[0] - 2f32.exp() / z).abs() < 1e-6);
        let norm = route(
            &logits,
            4,
            2,
            &RouterScoring::SoftmaxTopK { renormalize: true },
        )
        .unwrap();
        assert!((norm.weights[0] + norm.weights[1] - 1.0).abs() < 1e-6);
        assert!((norm.weights[0] / norm.weights[1] - 1f32.exp()).abs() < 1e-5);
        let groups = norm.groups();
        assert_eq!(
            groups.iter().map(|g| g.expert).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(groups[1].rows, vec![0, 1]);
        assert_eq!(norm.load(), vec![1, 2, 1, 0]);
    }

    #[test]
    fn grouped_sigmoid_keeps_the_best_groups() {
        // 4 experts in 2 groups; group 1 (experts 2, 3) wins on biased scores.
        let logits = [3.0, -3.0, 1.0, 1.0];
        let scoring = RouterScoring::SigmoidGrouped {
            bias: vec![0.0, 0.0, 0.5, 0.5],
            groups: 2,
            topk_groups: 1,
            renormalize: true,
            scale: 2.0,
        };
        let r = route(&logits, 4, 2, &scoring).unwrap();
        assert_eq!(r.experts, vec![2, 3]);
        assert!((r.weights[0] - 1.0).abs() < 1e-6 && (r.weights[1] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn bad_shapes_are_refused() {
        let s = RouterScoring::SoftmaxTopK { renormalize: true };
        assert!(route(&[0.0; 8], 4, 5, &s).is_err());
        assert!(route(&[0.0; 7], 4, 2, &s).is_err());
        let g = RouterScoring::SigmoidGrouped {
            bias: vec![0.0; 4],
            groups: 3,
            topk_groups: 1,
            renormalize: true,
            scale: 1.0,
        };
        assert!(route(&[0.0; 4], 4, 2, &g).is_err());
    }
}
