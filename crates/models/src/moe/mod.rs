//! The sparse MoE feed-forward block of Qwen2-MoE, Qwen3-MoE, Mixtral and
//! DeepSeek-V2/V3:
//! its `config.json` keys ([`MoeConfig`]), its weights ([`MoeBlock`]) and its
//! forward (router → top-k → grouped experts → optional shared expert).
//!
//! Invariants: the router weight is kept in f32 whatever the checkpoint's
//! dtype or quantization (routing decisions are the most precision-sensitive
//! part of the block); every expert of the layer is loaded with the shapes
//! the config implies, and errors name the tensor; the routing of a token
//! depends on that token only (see [`routing`]).

pub mod all_to_all;
pub mod routing;

use crate::config::Keys;
use crate::decoder::Loader;
use all_to_all::{all_gather_rows, run_experts_all_to_all, token_block};
use arbor_engine_core::comm::Communicator;
use arbor_engine_core::moe::ExpertSharding;
use arbor_engine_core::{Backend, DType, Result, Tensor};
use routing::{
    ExpertCounter, ExpertInputScales, ExpertWeights, MoeRouting, RouterScoring, route, run_experts,
};
use serde_json::Value;
use std::sync::Arc;

/// How an architecture names its MoE tensors and scores its router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeStyle {
    /// `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj`; optional
    /// `mlp.shared_expert` with a sigmoid `mlp.shared_expert_gate`
    /// (Qwen2-MoE, Qwen3-MoE); `norm_topk_prob` decides renormalization.
    Qwen,
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w3/w2`
    /// (gate/up/down); the top-k weights are always renormalized (Mixtral).
    Mixtral,
    /// `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj`, ungated
    /// `mlp.shared_experts` (`n_shared_experts` wide); softmax routing,
    /// greedy or group-limited (`topk_method`), times
    /// `routed_scaling_factor`; the first `first_k_dense_replace` layers are
    /// dense (DeepSeek-V2).
    DeepSeekV2,
    /// As DeepSeek-V2, with sigmoid scores, the
    /// `mlp.gate.e_score_correction_bias` and group-limited choice
    /// (`noaux_tc`), renormalized when `norm_topk_prob` (DeepSeek-V3).
    DeepSeekV3,
}

/// How a block's router turns logits into weights (the config's half of
/// `RouterScoring`; DeepSeek-V3's bias is a weight).
#[derive(Clone, Debug, PartialEq)]
pub enum RouterConfig {
    /// Softmax, top k, renormalized when asked.
    Softmax { renormalize: bool },
    /// DeepSeek-V2: softmax, group-limited top k, scaled.
    GroupLimited {
        groups: usize,
        topk_groups: usize,
        scale: f32,
    },
    /// DeepSeek-V3: biased sigmoid, group-limited top k.
    NoAuxTc {
        groups: usize,
        topk_groups: usize,
        renormalize: bool,
        scale: f32,
    },
}

/// The MoE keys of a `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Tensor naming and router scoring.
    pub style: MoeStyle,
    /// Routed experts per MoE layer (`num_experts`, `num_local_experts`).
    pub num_experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Width of each routed expert (`moe_intermediate_size`, else `intermediate_size`).
    pub expert_intermediate_size: usize,
    /// How the router scores experts.
    pub router: RouterConfig,
    /// Width of the shared expert (`shared_expert_intermediate_size`), when there is one.
    pub shared_expert_intermediate_size: Option<usize>,
    /// Layers whose feed-forward is dense (`mlp_only_layers`, and those that
    /// `decoder_sparse_step` skips).
    pub dense_layers: Vec<usize>,
}

impl MoeConfig {
    /// Parses the MoE keys of `v`; `file` names it in errors.
    pub fn from_json(v: &Value, file: &str, style: MoeStyle, layers: usize) -> Result<Self> {
        let k = Keys { v, file };
        let err = |key: &str, what: &str| k.err(key, what);
        let uint = |key: &str| k.usize_opt(key);
        let deepseek = matches!(style, MoeStyle::DeepSeekV2 | MoeStyle::DeepSeekV3);
        let experts_key = if deepseek {
            uint("n_routed_experts")?
        } else {
            uint("num_experts")?
        };
        let num_experts = match (experts_key, uint("num_local_experts")?) {
            (Some(n), _) | (None, Some(n)) => n,
            (None, None) => return Err(err("num_experts", "is missing")),
        };
        let top_k =
            uint("num_experts_per_tok")?.ok_or_else(|| err("num_experts_per_tok", "is missing"))?;
        if num_experts == 0 || top_k == 0 || top_k > num_experts {
            return Err(err(
                "num_experts_per_tok",
                &format!("({top_k}) must be between 1 and the number of experts ({num_experts})"),
            ));
        }
        let expert_intermediate_size = match style {
            MoeStyle::Mixtral => None,
            _ => uint("moe_intermediate_size")?,
        }
        .or(uint("intermediate_size")?)
        .filter(|&n| n > 0)
        .ok_or_else(|| err("moe_intermediate_size", "is missing or zero"))?;
        let norm_topk_prob = k.bool_opt("norm_topk_prob")?.unwrap_or(false);
        let scale = k.f32_opt("routed_scaling_factor")?.unwrap_or(1.0);
        let groups = uint("n_group")?.unwrap_or(1).max(1);
        let topk_groups = uint("topk_group")?.unwrap_or(1).max(1);
        let router = match style {
            MoeStyle::Mixtral => RouterConfig::Softmax { renormalize: true },
            MoeStyle::Qwen => RouterConfig::Softmax {
                renormalize: norm_topk_prob,
            },
            MoeStyle::DeepSeekV2 => match v.get("topk_method").and_then(Value::as_str) {
                None | Some("greedy") => RouterConfig::GroupLimited {
                    groups: 1,
                    topk_groups: 1,
                    scale,
                },
                Some("group_limited_greedy") => RouterConfig::GroupLimited {
                    groups,
                    topk_groups,
                    scale,
                },
                Some(other) => {
                    return Err(err(
                        "topk_method",
                        &format!("'{other}' is not supported (greedy, group_limited_greedy)"),
                    ));
                }
            },
            MoeStyle::DeepSeekV3 => RouterConfig::NoAuxTc {
                groups,
                topk_groups,
                renormalize: norm_topk_prob,
                scale,
            },
        };
        if let RouterConfig::GroupLimited {
            groups,
            topk_groups,
            ..
        }
        | RouterConfig::NoAuxTc {
            groups,
            topk_groups,
            ..
        } = router
            && (!num_experts.is_multiple_of(groups) || topk_groups > groups)
        {
            return Err(err(
                "n_group",
                &format!(
                    "({groups}) must divide the {num_experts} experts, with topk_group ({topk_groups}) at most n_group"
                ),
            ));
        }
        let shared_expert_intermediate_size = match style {
            MoeStyle::Qwen => uint("shared_expert_intermediate_size")?.filter(|&n| n > 0),
            MoeStyle::Mixtral => None,
            MoeStyle::DeepSeekV2 | MoeStyle::DeepSeekV3 => uint("n_shared_experts")?
                .filter(|&n| n > 0)
                .map(|n| n * expert_intermediate_size),
        };
        let step = uint("decoder_sparse_step")?.unwrap_or(1);
        if step == 0 {
            return Err(err("decoder_sparse_step", "must be positive"));
        }
        let only: Vec<usize> = match v.get("mlp_only_layers") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64().map(|n| n as usize).ok_or_else(|| {
                        err("mlp_only_layers", &format!("holds {x}, not a layer index"))
                    })
                })
                .collect::<Result<_>>()?,
            Some(x) => {
                return Err(err(
                    "mlp_only_layers",
                    &format!("must be a list, found {x}"),
                ));
            }
        };
        // DeepSeek's first layers are dense (transformers reads only this key).
        let first_dense = if deepseek {
            uint("first_k_dense_replace")?.unwrap_or(0)
        } else {
            0
        };
        let dense_layers = (0..layers)
            .filter(|&i| i < first_dense || only.contains(&i) || (i + 1) % step != 0)
            .collect();
        Ok(Self {
            style,
            num_experts,
            top_k,
            expert_intermediate_size,
            router,
            shared_expert_intermediate_size,
            dense_layers,
        })
    }

    /// True when layer `i` has a sparse MoE block.
    pub fn is_sparse(&self, i: usize) -> bool {
        !self.dense_layers.contains(&i)
    }

    /// Tensors one sparse layer loads (for load progress).
    pub fn tensors_per_layer(&self) -> usize {
        let shared = match (self.style, self.shared_expert_intermediate_size) {
            (_, None) => 0,
            (MoeStyle::Qwen, Some(_)) => 4,
            (_, Some(_)) => 3,
        };
        let bias = usize::from(self.style == MoeStyle::DeepSeekV3);
        1 + bias + 3 * self.num_experts + shared
    }
}

/// A shared expert, run on every token; Qwen2-MoE scales it by a sigmoid gate.
struct SharedExpert {
    /// The expert, as the single slot of a one-expert routing.
    mlp: [Option<ExpertWeights>; 1],
    /// `[1, hidden]` f32 (`shared_expert_gate`).
    gate: Option<Tensor>,
}

/// A rank's part in the MoE layers of a tensor-parallel group.
#[derive(Clone)]
pub(crate) struct MoeParallel {
    /// The group.
    pub comm: Arc<dyn Communicator>,
    /// How the ranks share the routed experts.
    pub sharding: ExpertSharding,
}

/// The tokens routed to each expert of each sparse layer: `blocks` gives
/// every layer's block, `None` for a dense layer.
pub(crate) fn expert_loads<'a>(
    blocks: impl Iterator<Item = Option<&'a MoeBlock>>,
) -> Vec<arbor_engine_core::moe::ExpertLoad> {
    blocks
        .enumerate()
        .filter_map(|(layer, b)| {
            b.map(|m| arbor_engine_core::moe::ExpertLoad {
                layer,
                tokens: m.expert_load(),
            })
        })
        .collect()
}

/// One sparse feed-forward block.
pub struct MoeBlock {
    /// `[num_experts, hidden]` f32.
    router: Tensor,
    experts: Vec<Option<ExpertWeights>>,
    top_k: usize,
    scoring: RouterScoring,
    shared: Option<SharedExpert>,
    /// Tokens this block's experts computed so far.
    load: ExpertCounter,
    /// This rank's group, with tensor or expert parallelism.
    parallel: Option<MoeParallel>,
}

impl MoeBlock {
    /// Loads layer `layer`'s block (as rank `parallel.comm.rank()`: with
    /// partitioned experts, only that rank's).
    pub(crate) fn load(
        l: &mut Loader<'_>,
        cfg: &MoeConfig,
        layer: usize,
        hidden: usize,
        parallel: Option<MoeParallel>,
    ) -> Result<Self> {
        let owned = parallel
            .as_ref()
            .filter(|p| p.sharding.partitioned())
            .map(|p| {
                let (rank, world) = (p.comm.rank(), p.comm.world_size());
                let per = cfg.num_experts / world.max(1);
                rank * per..(rank + 1) * per
            });
        let (prefix, names) = match cfg.style {
            MoeStyle::Mixtral => (
                format!("model.layers.{layer}.block_sparse_moe"),
                ["w1", "w3", "w2"],
            ),
            _ => (
                format!("model.layers.{layer}.mlp"),
                ["gate_proj", "up_proj", "down_proj"],
            ),
        };
        let router = l.f32_matrix(&format!("{prefix}.gate.weight"), &[cfg.num_experts, hidden])?;
        let inter = cfg.expert_intermediate_size;
        let mut experts = Vec::with_capacity(cfg.num_experts);
        let mut scales = Vec::with_capacity(cfg.num_experts);
        let mut others = Vec::new();
        for e in 0..cfg.num_experts {
            let p = format!("{prefix}.experts.{e}");
            if owned.as_ref().is_some_and(|r| !r.contains(&e)) {
                // Another rank's expert (expert parallelism).
                l.skip(3);
                experts.push(None);
                others.push(p);
                continue;
            }
            let (weights, own) = expert(l, &p, names, hidden, inter)?;
            experts.push(Some(weights));
            scales.push(own);
        }
        if scales.iter().flatten().any(Option::is_some) {
            // The block's scales are the largest over every expert, this
            // rank's or not, so that expert parallelism computes what one
            // device does.
            for p in &others {
                scales.push([
                    l.input_scale_of(&format!("{p}.{}", names[0]), inter, hidden)?,
                    l.input_scale_of(&format!("{p}.{}", names[1]), inter, hidden)?,
                    l.input_scale_of(&format!("{p}.{}", names[2]), hidden, inter)?,
                ]);
            }
        }
        share_block_input_scales(&mut experts, &scales);
        let shared_names = match cfg.style {
            MoeStyle::Qwen => ["gate_proj", "up_proj", "down_proj"],
            _ => names,
        };
        let shared = match cfg.shared_expert_intermediate_size {
            None => None,
            Some(si) => {
                let name = match cfg.style {
                    MoeStyle::Qwen => "shared_expert",
                    _ => "shared_experts",
                };
                let (weights, own) =
                    expert(l, &format!("{prefix}.{name}"), shared_names, hidden, si)?;
                let mut mlp = [Some(weights)];
                share_block_input_scales(&mut mlp, &[own]);
                let gate = match cfg.style {
                    MoeStyle::Qwen => Some(l.f32_matrix(
                        &format!("{prefix}.shared_expert_gate.weight"),
                        &[1, hidden],
                    )?),
                    _ => None,
                };
                Some(SharedExpert { mlp, gate })
            }
        };
        let scoring = match cfg.router {
            RouterConfig::Softmax { renormalize } => RouterScoring::SoftmaxTopK { renormalize },
            RouterConfig::GroupLimited {
                groups,
                topk_groups,
                scale,
            } => RouterScoring::SoftmaxGroupLimited {
                groups,
                topk_groups,
                scale,
            },
            RouterConfig::NoAuxTc {
                groups,
                topk_groups,
                renormalize,
                scale,
            } => {
                let name = format!("{prefix}.gate.e_score_correction_bias");
                let bias = l.f32_matrix(&name, &[cfg.num_experts])?;
                RouterScoring::SigmoidGrouped {
                    bias: l.download_f32(&bias)?,
                    groups,
                    topk_groups,
                    renormalize,
                    scale,
                }
            }
        };
        Ok(Self {
            router,
            experts,
            top_k: cfg.top_k,
            scoring,
            shared,
            load: ExpertCounter::new(cfg.num_experts),
            parallel,
        })
    }

    /// Tokens routed to each expert so far.
    pub fn expert_load(&self) -> Vec<u64> {
        self.load.snapshot()
    }

    /// `out = moe(x)` for `x` `[tokens, hidden]` f32 (the same on every
    /// rank of a group), the whole output on every rank; overwrites `out`.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor, out: &Tensor) -> Result<()> {
        // With all-to-all dispatch the routed output is already whole on
        // every rank; otherwise (split widths or the experts' shares) it is
        // a partial sum.
        let a2a = self
            .parallel
            .as_ref()
            .filter(|p| p.sharding == ExpertSharding::PartitionedAllToAll);
        match a2a {
            Some(p) => self.routed_all_to_all(b, p.comm.as_ref(), x, out)?,
            None => {
                let routing = self.route(b, x)?;
                self.load.record(&routing);
                run_experts(b, x, &routing, &self.experts, out)?;
            }
        }
        if let Some(s) = &self.shared {
            let y = b.alloc(DType::F32, &[x.rows(), x.row_len()])?;
            s.forward(b, x, &y)?;
            if let Some(p) = a2a {
                // The shared expert's width is split: its partial sums are
                // reduced on their own.
                p.comm.all_reduce(&y)?;
            }
            b.add_assign(out, &y)?;
        }
        match (&self.parallel, a2a) {
            (Some(p), None) => p.comm.all_reduce(out),
            _ => Ok(()),
        }
    }

    /// Routes each row of `x`.
    fn route(&self, b: &dyn Backend, x: &Tensor) -> Result<MoeRouting> {
        let n_exp = self.experts.len();
        let logits = b.alloc(DType::F32, &[x.rows(), n_exp])?;
        if x.rows() > 0 {
            b.linear(x, &self.router, None, &logits)?;
        }
        route(&b.download_f32(&logits)?, n_exp, self.top_k, &self.scoring)
    }

    /// The routed experts' output of the whole batch with all-to-all
    /// dispatch and combine: this rank routes its block of the tokens.
    fn routed_all_to_all(
        &self,
        b: &dyn Backend,
        comm: &dyn Communicator,
        x: &Tensor,
        out: &Tensor,
    ) -> Result<()> {
        let mine = token_block(x.rows(), comm.rank(), comm.world_size());
        let xo = x.narrow(mine.start, mine.len())?;
        let routing = self.route(b, &xo)?;
        let own = b.alloc(DType::F32, &[mine.len(), x.row_len()])?;
        run_experts_all_to_all(
            b,
            comm,
            &xo,
            &routing,
            &self.experts,
            Some(&self.load),
            &own,
        )?;
        all_gather_rows(b, comm, &own, out)
    }
}

impl SharedExpert {
    /// `out = expert(x)`, scaled by the gate where there is one.
    fn forward(&self, b: &dyn Backend, x: &Tensor, out: &Tensor) -> Result<()> {
        let s = self;
        let t = x.rows();
        let all = MoeRouting {
            num_experts: 1,
            top_k: 1,
            experts: vec![0; t],
            weights: match &s.gate {
                None => vec![1.0; t],
                Some(g) => {
                    let gl = b.alloc(DType::F32, &[t, 1])?;
                    b.linear(x, g, None, &gl)?;
                    b.download_f32(&gl)?
                        .iter()
                        .map(|&v| 1.0 / (1.0 + (-v).exp()))
                        .collect()
                }
            },
        };
        run_experts(b, x, &all, &s.mlp, out)
    }
}

/// One expert's weights, and the static input scales of its gate, up and
/// down projections (W8A8 FP8 over a checkpoint that has them).
fn expert(
    l: &mut Loader<'_>,
    prefix: &str,
    names: [&str; 3],
    hidden: usize,
    inter: usize,
) -> Result<(ExpertWeights, [Option<f32>; 3])> {
    let (gate, gate_scale) = l.scaled_matrix(&format!("{prefix}.{}", names[0]), inter, hidden)?;
    let (up, up_scale) = l.scaled_matrix(&format!("{prefix}.{}", names[1]), inter, hidden)?;
    let (down, down_scale) = l.scaled_matrix(&format!("{prefix}.{}", names[2]), hidden, inter)?;
    Ok((
        ExpertWeights::new(gate, up, down),
        [gate_scale, up_scale, down_scale],
    ))
}

/// Gives every expert of a block that has static input scales the block's
/// two: the largest gate/up scale and the largest down scale in `scales`
/// (each expert's gate, up and down), as vLLM's FP8 MoE methods merge them
/// (`w13_input_scale.max()`, `w2_input_scale.max()`) for the fused
/// experts, which round one input for all. An expert without a scale keeps
/// its weights' own rule.
fn share_block_input_scales(experts: &mut [Option<ExpertWeights>], scales: &[[Option<f32>; 3]]) {
    let max = |it: &mut dyn Iterator<Item = Option<f32>>| it.flatten().reduce(f32::max);
    let gate_up = max(&mut scales.iter().flat_map(|s| [s[0], s[1]]));
    let down = max(&mut scales.iter().map(|s| s[2]));
    for (e, own) in experts.iter_mut().flatten().zip(scales) {
        e.input_scales = ExpertInputScales {
            gate_up: gate_up.filter(|_| own[0].is_some() || own[1].is_some()),
            down: down.filter(|_| own[2].is_some()),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sparse_layers_follow_step_and_dense_list() {
        let v = json!({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                       "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": true});
        let c = MoeConfig::from_json(&v, "config.json", MoeStyle::Qwen, 6).unwrap();
        assert_eq!(c.dense_layers, vec![0, 2, 3, 4]);
        assert!(c.is_sparse(1) && c.is_sparse(5) && !c.is_sparse(3));
        assert_eq!(c.router, RouterConfig::Softmax { renormalize: true });
        let m = json!({"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32});
        let c = MoeConfig::from_json(&m, "config.json", MoeStyle::Mixtral, 2).unwrap();
        assert!(c.dense_layers.is_empty() && c.expert_intermediate_size == 32);
        let d = json!({"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                       "n_shared_experts": 2, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
                       "norm_topk_prob": true, "routed_scaling_factor": 2.5});
        let c = MoeConfig::from_json(&d, "config.json", MoeStyle::DeepSeekV3, 3).unwrap();
        assert_eq!(c.dense_layers, vec![0]);
        assert_eq!(c.shared_expert_intermediate_size, Some(32));
        assert_eq!(
            c.router,
            RouterConfig::NoAuxTc {
                groups: 4,
                topk_groups: 2,
                renormalize: true,
                scale: 2.5
            }
        );
        assert_eq!(c.tensors_per_layer(), 1 + 1 + 24 + 3);
    }

    #[test]
    fn bad_keys_are_named() {
        let v = json!({"num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 16});
        let e = MoeConfig::from_json(&v, "x/config.json", MoeStyle::Qwen, 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("x/config.json") && e.contains("num_experts_per_tok"),
            "{e}"
        );
        let v = json!({"num_experts_per_tok": 2, "moe_intermediate_size": 16});
        let e = MoeConfig::from_json(&v, "config.json", MoeStyle::Qwen, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_experts") && e.contains("missing"), "{e}");
    }
}
