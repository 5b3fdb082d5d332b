//! Model drafters: a separate draft model (`standalone`, SGLang's
//! STANDALONE) or the target's own first N layers (`layerskip`,
//! self-speculative layer skip).
//!
//! A [`ModelDrafter`] proposes a chain (argmaxes; for a request sampled at
//! temperature > 0, draws from the draft's filtered distribution, returned
//! with the draft for speculative sampling): its first forward feeds the
//! request's tokens from the first position whose draft KV is not known to be
//! valid up to the pending token, each later forward feeds the previous draft
//! token; every forward is batched over the requests still drafting. Drafts
//! are advisory: verification decides what is kept, so a stale or missing
//! draft KV can only lower acceptance, never change output.
//!
//! Where its KV lives, and what it knows of it:
//! - **layerskip** runs the target's runner with
//!   [`ForwardBatch::exit_after`]: it reads the KV the target wrote for
//!   every committed position of its first N layers (exactly what it would
//!   have written itself) and writes only at the pending and draft
//!   positions, which the verification forward overwrites. Nothing to track.
//!   With tensor parallelism its forwards run on every rank
//!   ([`TpRunners`]): each rank's first N layers over its heads and KV
//!   shard, the LM head's logits gathered, as the target's steps run.
//! - **standalone** owns a second KV cache with the target's page size and
//!   page count, addressed by the *target's* page table: its pages come from
//!   the same pool accounting and are freed with the request, and pages the
//!   radix cache shares carry their draft KV to the next request. Invariant:
//!   `slot_keys[s]` is the hash of the whole token prefix (position
//!   included) whose draft KV slot `s` holds, or 0 when never written; a
//!   request's draft KV at position `p` is valid exactly when the slot's key
//!   equals the hash of the request's tokens `0..=p`.

use crate::choose::choose;
use arbor_engine_core::attention::BatchLayout;
use arbor_engine_core::error::{CoreError, Result};
use arbor_engine_core::model::{ForwardBatch, Model};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::speculative::{Drafting, SpeculativeConfig, SpeculatorInputs};
use arbor_engine_core::{
    Draft, DraftDist, DraftRequest, SamplingParams, SeqRng, Speculator, TpRunners,
};
use std::collections::HashMap;
use std::sync::Arc;

/// Where a drafter's KV lives.
enum DraftKv {
    /// The target's own cache (layerskip).
    Target,
    /// A cache of its own, indexed by the target's page table (standalone).
    Own {
        /// Hash of the token prefix each slot's draft KV belongs to (0: none).
        slot_keys: Vec<u64>,
    },
}

/// One live request as the drafter knows it.
#[derive(Default)]
struct DraftSeq {
    /// Every token of the sequence (from `observe`).
    tokens: Vec<u32>,
    /// `hashes[p]`: hash of `tokens[..=p]`.
    hashes: Vec<u64>,
    /// Positions below this hold valid draft KV (own cache only), in the
    /// pages of `pages`.
    valid: usize,
    /// The request's page table when `valid` was last set (a retracted
    /// request comes back in other pages).
    pages: Vec<u32>,
}

/// Hash of a token prefix extended by `token` (never 0).
fn extend_hash(prev: u64, token: u32) -> u64 {
    let mut z = prev ^ (u64::from(token) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) | 1
}

/// Hash of the empty prefix.
const ROOT_HASH: u64 = 0x5EED;

/// Proposes draft chains by running a model (see the module docs).
pub struct ModelDrafter {
    name: &'static str,
    /// Runs the draft forwards: the target's runner (layerskip) or the
    /// draft model's own (standalone).
    runner: Arc<ModelRunner>,
    /// A tensor-parallel target's runners on every rank (layerskip under
    /// TP): the draft forwards run on all of them, `runner` being rank 0's.
    group: Option<Arc<TpRunners>>,
    /// Layers run per draft forward (layerskip); `None` runs the draft model whole.
    exit_after: Option<usize>,
    kv: DraftKv,
    max_steps: usize,
    seqs: HashMap<u64, DraftSeq>,
    /// Draft forwards that failed (the requests drafted nothing that step).
    failures: u64,
}

impl ModelDrafter {
    /// `layerskip`: the target's first `cfg.draft_layers` layers draft.
    pub fn layer_skip(cfg: &SpeculativeConfig, inputs: &SpeculatorInputs) -> Result<Self> {
        let layers = inputs.target.spec().num_layers;
        let n = cfg.draft_layers.ok_or_else(|| CoreError::InvalidSetting {
            key: "draft_layers",
            reason: "is needed by LAYERSKIP (the target's first layers that draft)".into(),
        })?;
        if n == 0 || n >= layers {
            return Err(CoreError::InvalidSetting {
                key: "draft_layers",
                reason: format!(
                    "must be between 1 and {} (the target has {layers} layers), not {n}",
                    layers - 1
                ),
            });
        }
        let mut drafter = Self::new(
            "layerskip",
            inputs.target.clone(),
            Some(n),
            DraftKv::Target,
            cfg,
        );
        drafter.group = inputs.target_group.clone();
        Ok(drafter)
    }

    /// `standalone`: `inputs.draft_model` drafts, with a KV cache of its own
    /// shaped like the target's pages.
    pub fn standalone(cfg: &SpeculativeConfig, inputs: &SpeculatorInputs) -> Result<Self> {
        let draft: Arc<dyn Model> =
            inputs
                .draft_model
                .clone()
                .ok_or_else(|| CoreError::InvalidSetting {
                    key: "draft_model_path",
                    reason: "is needed by STANDALONE (the draft model)".into(),
                })?;
        let target = &inputs.target;
        let (tv, dv) = (target.spec().vocab_size, draft.spec().vocab_size);
        if tv != dv {
            return Err(CoreError::Config(format!(
                "--speculative-draft-model-path: the draft model's vocabulary has {dv} tokens, the target's {tv}; \
                 a draft model must share the target's tokenizer"
            )));
        }
        let kv = *target.kv_spec();
        let runner = ModelRunner::new(
            draft,
            target.backend().clone(),
            None,
            kv.page_size,
            kv.num_pages,
            kv.dtype,
        )?;
        let slots = kv.num_pages * kv.page_size;
        Ok(Self::new(
            "standalone",
            Arc::new(runner),
            None,
            DraftKv::Own {
                slot_keys: vec![0; slots],
            },
            cfg,
        ))
    }

    fn new(
        name: &'static str,
        runner: Arc<ModelRunner>,
        exit_after: Option<usize>,
        kv: DraftKv,
        cfg: &SpeculativeConfig,
    ) -> Self {
        Self {
            name,
            runner,
            group: None,
            exit_after,
            kv,
            max_steps: cfg.num_steps.min(cfg.num_draft_tokens),
            seqs: HashMap::new(),
            failures: 0,
        }
    }

    /// Bytes of KV the drafter holds beside the target's (standalone's own cache).
    pub fn own_kv_bytes(&self) -> usize {
        match self.kv {
            DraftKv::Target => 0,
            DraftKv::Own { .. } => {
                let s = self.runner.kv_spec();
                s.bytes_per_token() * s.num_pages * s.page_size
            }
        }
    }

    /// Draft forwards that failed so far.
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// The first position whose draft KV `r` must compute (the pending
    /// token's at the latest).
    fn first_stale(&mut self, r: &DraftRequest<'_>) -> usize {
        let ps = self.runner.kv_spec().page_size;
        let Some(seq) = self.seqs.get_mut(&r.key) else {
            return 0;
        };
        let pending = r.len - 1;
        match &self.kv {
            DraftKv::Target => pending,
            DraftKv::Own { slot_keys } => {
                // Positions in pages that changed since are not known valid.
                let same = seq
                    .pages
                    .iter()
                    .zip(r.pages)
                    .take_while(|(a, b)| a == b)
                    .count();
                let mut p = seq.valid.min(pending).min(same * ps);
                while p < pending {
                    let slot = r.pages[p / ps] as usize * ps + p % ps;
                    if slot_keys.get(slot) != Some(&seq.hashes[p]) {
                        break;
                    }
                    p += 1;
                }
                seq.valid = p;
                p
            }
        }
    }

    /// Runs the draft forwards for `reqs`; the chains, in order (with their
    /// distributions for sampled requests).
    fn run(&mut self, reqs: &[DraftRequest<'_>]) -> Result<Vec<Draft>> {
        let kv = *self.runner.kv_spec();
        let ps = kv.page_size;
        let context = self.runner.spec().max_position_embeddings;
        // Per request: draft length, first fed position, hash of what the
        // last fed position holds.
        let mut plan: Vec<(usize, usize, u64)> = Vec::with_capacity(reqs.len());
        for r in reqs {
            let known = self
                .seqs
                .get(&r.key)
                .is_some_and(|s| s.tokens.len() == r.len);
            // Draft position len + k - 2 is the last written: it must fit the
            // draft's context and the pages held.
            let fits = (context + 1)
                .saturating_sub(r.len)
                .min((r.pages.len() * ps).saturating_sub(r.len) + 1);
            let k = if known && r.len > 0 {
                r.max_tokens.min(self.max_steps).min(fits)
            } else {
                0
            };
            let start = if k > 0 { self.first_stale(r) } else { 0 };
            plan.push((k, start, 0));
        }
        let mut out: Vec<Vec<u32>> = plan.iter().map(|p| Vec::with_capacity(p.0)).collect();
        // Sampled requests draw their chains (and keep the distributions).
        let mut probs: Vec<Vec<DraftDist>> = vec![Vec::new(); reqs.len()];
        let mut rngs: Vec<Option<SeqRng>> = reqs
            .iter()
            .map(|r| r.sampling.map(|s| SeqRng::new(s.seed)))
            .collect();
        let greedy = SamplingParams::default();
        let steps = plan.iter().map(|p| p.0).max().unwrap_or(0);
        for j in 0..steps {
            let mut layout = BatchLayout::new(ps);
            let mut ids = Vec::new();
            let mut positions = Vec::new();
            let mut rows = Vec::new();
            let mut who = Vec::new();
            for (i, (r, &(k, start, _))) in reqs.iter().zip(&plan).enumerate() {
                if j >= k {
                    continue;
                }
                let (prefix, fed): (usize, &[u32]) = if j == 0 {
                    let seq = &self.seqs[&r.key];
                    (start, &seq.tokens[start..r.len])
                } else {
                    (r.len - 1 + j, std::slice::from_ref(&out[i][j - 1]))
                };
                layout.push_seq(prefix, fed.len(), r.pages)?;
                ids.extend_from_slice(fed);
                positions.extend((prefix..prefix + fed.len()).map(|p| p as u32));
                rows.push((ids.len() - 1) as u32);
                who.push(i);
            }
            let batch = ForwardBatch {
                input_ids: ids,
                positions,
                layout: Arc::new(layout),
                logits_rows: rows,
                hidden_layers: Vec::new(),
                lora: Vec::new(),
                exit_after: self.exit_after,
                hidden_at_every_row: false,
            };
            let logits = match &self.group {
                Some(g) => g.forward(&batch)?.logits,
                None => self.runner.forward(&batch)?.logits,
            };
            let backend = self.runner.backend().clone();
            let mut sampling: Vec<Option<(&SamplingParams, &mut SeqRng)>> = rngs
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| who.contains(i))
                .map(|(i, g)| {
                    g.as_mut()
                        .map(|g| (reqs[i].sampling.map_or(&greedy, |s| s.params), g))
                })
                .collect();
            let chosen = choose(&*backend, &logits, &mut sampling)?;
            drop(sampling);
            for (&i, (tok, q)) in who.iter().zip(chosen) {
                self.record(&reqs[i], &mut plan[i], j, out[i].last().copied());
                out[i].push(tok);
                if let Some(q) = q {
                    probs[i].push(q);
                }
            }
        }
        let drafts = out
            .into_iter()
            .zip(probs)
            .map(|(tokens, probs)| {
                let probs = if probs.len() == tokens.len() {
                    probs
                } else {
                    Vec::new()
                };
                Draft {
                    probs,
                    ..Draft::chain(tokens)
                }
            })
            .collect();
        Ok(drafts)
    }

    /// Records in `slot_keys` what draft forward `j` wrote for `r` (own cache
    /// only): its tokens from `start` (j = 0), or the previous draft token.
    fn record(
        &mut self,
        r: &DraftRequest<'_>,
        plan: &mut (usize, usize, u64),
        j: usize,
        prev_draft: Option<u32>,
    ) {
        let DraftKv::Own { slot_keys } = &mut self.kv else {
            return;
        };
        let ps = self.runner.kv_spec().page_size;
        let mut put = |p: usize, h: u64| {
            let slot = r.pages[p / ps] as usize * ps + p % ps;
            if let Some(k) = slot_keys.get_mut(slot) {
                *k = h;
            }
        };
        if j == 0 {
            let Some(seq) = self.seqs.get_mut(&r.key) else {
                return;
            };
            for p in plan.1..r.len {
                put(p, seq.hashes[p]);
            }
            seq.valid = r.len;
            seq.pages.clear();
            seq.pages
                .extend_from_slice(&r.pages[..r.len.div_ceil(ps).min(r.pages.len())]);
            plan.2 = seq.hashes[r.len - 1];
        } else if let Some(t) = prev_draft {
            plan.2 = extend_hash(plan.2, t);
            put(r.len - 1 + j, plan.2);
        }
    }
}

impl Speculator for ModelDrafter {
    fn name(&self) -> &str {
        self.name
    }

    fn propose(&mut self, reqs: &[DraftRequest<'_>]) -> Vec<Draft> {
        match self.run(reqs) {
            Ok(drafts) => drafts,
            Err(e) => {
                self.failures += 1;
                tracing::warn!(
                    "{} drafting failed: {e}; this step verifies no drafts",
                    self.name
                );
                vec![Draft::default(); reqs.len()]
            }
        }
    }

    fn observe(&mut self, key: u64, tokens: &[u32]) {
        let seq = self.seqs.entry(key).or_default();
        let mut h = seq.hashes.last().copied().unwrap_or(ROOT_HASH);
        for &t in tokens {
            h = extend_hash(h, t);
            seq.hashes.push(h);
        }
        seq.tokens.extend_from_slice(tokens);
    }

    fn release(&mut self, key: u64) {
        self.seqs.remove(&key);
    }

    fn drafting(&self) -> Drafting {
        Drafting::Model {
            max_tokens: self.max_steps,
            tree: false,
        }
    }
}
