//! Drafting from the target's hidden states with a [`DraftHead`]:
//! [`HeadDrafter`] is the `eagle3` speculator (SGLang's
//! `--speculative-algorithm EAGLE3`, with an `Eagle3Head`), the `eagle` one
//! (`--speculative-algorithm EAGLE`, with an `EagleHead` over the target's
//! final normed state) and the `nextn` one (MTP: next-n prediction layers
//! shipped in the target's checkpoint).
//!
//! Flow, as SGLang's EAGLE worker:
//! - **Extend** ([`Speculator::observe_states`], after every target step):
//!   for each position `p` the target computed and kept, the head takes the
//!   token at `p + 1` and the target's hidden states at `p` (the head's
//!   [`target_layers`](DraftHead::target_layers): EAGLE3's low/mid/high
//!   layers, MTP's and EAGLE's final normed state), and writes its KV at
//!   `p`. The last position's logits (the first draft token's distribution)
//!   and output state (where the next draft step starts) are kept for the
//!   request, tagged with the sequence length they apply to.
//! - **Draft** ([`Speculator::propose`]): when the request's length is still
//!   that tag, the chain starts from the kept logits; every further token is
//!   one head forward (batched over the requests still drafting) that feeds
//!   the previous draft token with the previous step's output state at the
//!   next position. Tokens are argmaxes, or for a request sampled at
//!   temperature > 0 draws from the head's filtered distribution, returned
//!   with the draft for speculative sampling.
//!
//! Under tensor parallelism the head runs whole on rank 0's device (as a
//! STANDALONE draft model does), reading the target's replicated input
//! embedding and its LM head over the whole vocabulary gathered there once
//! at load ([`TargetTables`]); the group verifies.
//!
//! Where its KV lives: a one-layer cache of its own with the target's page
//! size and page count, addressed by the target's page table, so its pages
//! come from the target's pool accounting and are freed with the request.
//! Invariant: every position the target computes gets its draft KV in the
//! same step (extend), so pages the radix cache shares carry their draft KV;
//! the KV that draft steps write past the sequence is rewritten by the next
//! extend. Drafts are advisory: verification decides what is kept.

use crate::choose::{Choice, argmax, draw};
use crate::eagle::EagleHead;
use crate::eagle3::Eagle3Head;
use crate::head::DraftHead;
use crate::head_tree::Growing;
use crate::mtp::MtpHead;
use arbor_engine_core::attention::{AttentionBackend, BatchLayout};
use arbor_engine_core::error::{CoreError, Result};
use arbor_engine_core::kv::KvCache;
use arbor_engine_core::model::{ForwardBatch, ForwardContext};
use arbor_engine_core::speculative::{
    ComputedStates, Drafting, SpeculativeConfig, SpeculatorInputs,
};
use arbor_engine_core::{
    Backend, Draft, DraftDist, DraftRequest, ModelSpec, SamplingParams, SeqRng, Speculator, Tensor,
};
use std::collections::HashMap;
use std::sync::Arc;

/// What a head reads of its target, on the device the head runs on (the
/// target's; rank 0's of a tensor-parallel group).
struct TargetTables {
    /// The whole model's shape (every rank's heads together).
    spec: ModelSpec,
    /// The input embedding (replicated on every rank).
    embed: Option<Tensor>,
    /// The LM head over the whole vocabulary.
    lm_head: Option<Tensor>,
}

impl TargetTables {
    fn of(inputs: &SpeculatorInputs) -> Result<Self> {
        let model = inputs.target.model();
        let (spec, lm_head) = match &inputs.target_group {
            Some(group) => (group.spec().clone(), group.whole_lm_head()?),
            None => (inputs.target.spec().clone(), model.lm_head()),
        };
        Ok(Self {
            spec,
            embed: model.input_embedding(),
            lm_head,
        })
    }
}

/// A request's next draft start, from its last extend.
struct Pending {
    /// The sequence length it applies to.
    len: usize,
    /// The head's logits over its draft vocabulary at position `len - 2`
    /// (the first draft token's distribution).
    logits: Vec<f32>,
    /// The head's output state at position `len - 2` (`[hidden]`).
    state: Vec<f32>,
    /// The head's input state at position `len - 2` (the target's fused
    /// features), kept for trees (their forwards re-run that position).
    root: Option<Vec<f32>>,
}

/// The draft path `inputs` give, or an error saying `who` needs it.
fn draft_path<'a>(inputs: &'a SpeculatorInputs, who: &str) -> Result<&'a std::path::PathBuf> {
    inputs
        .draft_path
        .as_ref()
        .ok_or_else(|| CoreError::InvalidSetting {
            key: "draft_model_path",
            reason: format!("is needed by {who}"),
        })
}

/// Proposes draft chains with a [`DraftHead`] (see the module docs).
pub struct HeadDrafter {
    head: Box<dyn DraftHead>,
    backend: Arc<dyn Backend>,
    attention: Arc<dyn AttentionBackend>,
    kv: KvCache,
    layers: Vec<usize>,
    max_steps: usize,
    /// Children per level of a tree (1: chains).
    topk: usize,
    /// Levels of a tree (`num_steps`) and its most nodes (`num_draft_tokens`).
    depth: usize,
    tree_tokens: usize,
    context: usize,
    pending: HashMap<u64, Pending>,
    failures: u64,
}

impl HeadDrafter {
    /// `eagle3`: loads the head at `inputs.draft_path` for `inputs.target`.
    pub fn eagle3(cfg: &SpeculativeConfig, inputs: &SpeculatorInputs) -> Result<Self> {
        let dir = draft_path(inputs, "EAGLE3 (the head's folder)")?;
        let t = TargetTables::of(inputs)?;
        let head = Eagle3Head::load(dir, &t.spec, t.embed, inputs.target.backend().clone())?;
        Self::new(Box::new(head), cfg, inputs)
    }

    /// `nextn` (MTP): loads the first next-n prediction layer of the
    /// checkpoint at `inputs.draft_path` (the target's own folder) for
    /// `inputs.target`.
    pub fn nextn(cfg: &SpeculativeConfig, inputs: &SpeculatorInputs) -> Result<Self> {
        let dir = draft_path(
            inputs,
            "NEXTN (the target's checkpoint folder, which holds its next-n prediction layers)",
        )?;
        let t = TargetTables::of(inputs)?;
        let head = MtpHead::load_sharing(
            dir,
            &t.spec,
            t.embed,
            t.lm_head,
            inputs.target.backend().clone(),
        )?;
        Self::new(Box::new(head), cfg, inputs)
    }

    /// `eagle`: loads the EAGLE head at `inputs.draft_path` for `inputs.target`,
    /// sharing the target's LM head (and its embedding when the head has none).
    pub fn eagle(cfg: &SpeculativeConfig, inputs: &SpeculatorInputs) -> Result<Self> {
        let dir = draft_path(inputs, "EAGLE (the head's folder)")?;
        let t = TargetTables::of(inputs)?;
        let head = EagleHead::load_sharing(
            dir,
            &t.spec,
            t.embed,
            t.lm_head,
            inputs.target.backend().clone(),
        )?;
        Self::new(Box::new(head), cfg, inputs)
    }

    /// A drafter with `head` over `inputs.target`'s device and pages.
    pub fn new(
        head: Box<dyn DraftHead>,
        cfg: &SpeculativeConfig,
        inputs: &SpeculatorInputs,
    ) -> Result<Self> {
        let target = &inputs.target;
        let backend = target.backend().clone();
        let t = *target.kv_spec();
        let kv = KvCache::allocate(&*backend, head.kv_spec(t.page_size, t.num_pages, t.dtype))?;
        let attention = target.attention().clone();
        let context = head
            .max_position_embeddings()
            .min(target.spec().max_position_embeddings);
        Ok(Self {
            layers: head.target_layers(),
            head,
            backend,
            attention,
            kv,
            max_steps: cfg.num_steps.min(cfg.num_draft_tokens),
            topk: cfg.eagle_topk,
            depth: cfg.num_steps,
            tree_tokens: cfg.num_draft_tokens,
            context,
            pending: HashMap::new(),
            failures: 0,
        })
    }

    /// Head forwards that failed so far.
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// The KV pages' size (the target's).
    pub(crate) fn page_size(&self) -> usize {
        self.kv.spec().page_size
    }

    /// Width of the head's state.
    pub(crate) fn hidden_size(&self) -> usize {
        self.head.hidden_size()
    }

    /// The target id of a draft-vocabulary id.
    pub(crate) fn target_id(&self, draft_id: u32) -> Result<u32> {
        self.head.target_id(draft_id)
    }

    /// One head forward over `seqs` (prefix, fed token ids, pages), with
    /// `hidden` (`[tokens, width]` rows in the same order); at each
    /// sequence's last row, its logits over the draft vocabulary and its
    /// output state (`[hidden]`).
    fn step(
        &self,
        seqs: &[(usize, &[u32], &[u32])],
        hidden: Vec<f32>,
        width: usize,
    ) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        let ps = self.kv.spec().page_size;
        let mut layout = BatchLayout::new(ps);
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut rows = Vec::with_capacity(seqs.len());
        for &(prefix, fed, pages) in seqs {
            layout.push_seq(prefix, fed.len(), pages)?;
            ids.extend_from_slice(fed);
            positions.extend((prefix..prefix + fed.len()).map(|p| p as u32));
            rows.push((ids.len() - 1) as u32);
        }
        let batch = ForwardBatch {
            input_ids: ids,
            positions,
            layout: Arc::new(layout),
            logits_rows: rows,
            hidden_layers: Vec::new(),
            lora: Vec::new(),
            exit_after: None,
            hidden_at_every_row: false,
        };
        self.run_batch(&batch, hidden, width)
    }

    /// Runs the head over `batch` with `hidden` (`[tokens, width]`); at each
    /// of its logits rows, the logits over the draft vocabulary and the
    /// output state (`[hidden]`).
    pub(crate) fn run_batch(
        &self,
        batch: &ForwardBatch,
        hidden: Vec<f32>,
        width: usize,
    ) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        let t = batch.input_ids.len();
        let hidden: Tensor = self.backend.upload_f32(&[t, width], &hidden)?;
        let attention_batch = self.attention.prepare(batch.layout.clone())?;
        let ctx = ForwardContext {
            kv: &self.kv,
            attention: &*self.attention,
            attention_batch: &attention_batch,
        };
        let out = self.head.forward(batch, &hidden, &ctx)?;
        let vocab = out.logits.row_len();
        let logits = self.backend.download_f32(&out.logits)?;
        let states = self.backend.download_f32(&out.state)?;
        let h = self.head.hidden_size();
        Ok(logits
            .chunks_exact(vocab)
            .zip(states.chunks_exact(h))
            .map(|(l, s)| (l.to_vec(), s.to_vec()))
            .collect())
    }

    /// The draft token of a logits row (a target id): its argmax, or a draw
    /// under `sampling`, then with the distribution (in target ids).
    fn pick(
        &self,
        row: &[f32],
        sampling: Option<(&SamplingParams, &mut SeqRng)>,
    ) -> Result<Choice> {
        let (id, probs) = match sampling.and_then(|(p, rng)| draw(row, p, rng)) {
            Some(c) => c,
            None => (argmax(row), None),
        };
        let probs = match probs {
            Some(q) => Some(
                q.iter()
                    .map(|&(p, d)| Ok((p, self.head.target_id(d)?)))
                    .collect::<Result<DraftDist>>()?,
            ),
            None => None,
        };
        Ok((self.head.target_id(id)?, probs))
    }

    /// Extend: the head's KV at every position the target kept, and each
    /// request's next draft start.
    fn extend(&mut self, seqs: &[ComputedStates<'_>]) -> Result<()> {
        let width = self.head.feature_width();
        let fits = |s: &&ComputedStates<'_>| {
            s.states.len() == s.next_tokens.len() * width
                && s.start + s.next_tokens.len() <= self.context
        };
        let kept: Vec<&ComputedStates<'_>> = seqs.iter().filter(fits).collect();
        if kept.is_empty() {
            return Ok(());
        }
        let mut hidden = Vec::with_capacity(kept.iter().map(|s| s.states.len()).sum());
        for s in &kept {
            hidden.extend_from_slice(s.states);
        }
        let fed: Vec<(usize, &[u32], &[u32])> = kept
            .iter()
            .map(|s| (s.start, s.next_tokens, s.pages))
            .collect();
        let roots = if self.topk > 1 {
            let mut last = Vec::with_capacity(kept.len() * width);
            for s in &kept {
                last.extend_from_slice(&s.states[s.states.len() - width..]);
            }
            let t = self.backend.upload_f32(&[kept.len(), width], &last)?;
            let fused = self.backend.download_f32(&self.head.fuse(&t)?)?;
            let h = self.head.hidden_size();
            fused.chunks_exact(h).map(|r| Some(r.to_vec())).collect()
        } else {
            vec![None; kept.len()]
        };
        let out = self.step(&fed, hidden, width)?;
        for ((s, (logits, state)), root) in kept.iter().zip(out).zip(roots) {
            self.pending.insert(
                s.key,
                Pending {
                    len: s.start + s.next_tokens.len() + 1,
                    logits,
                    state,
                    root,
                },
            );
        }
        Ok(())
    }

    /// The chains for `reqs`, in order (drawn, with their distributions,
    /// for sampled requests).
    fn draft(&self, reqs: &[DraftRequest<'_>]) -> Result<Vec<Draft>> {
        let ps = self.kv.spec().page_size;
        let h = self.head.hidden_size();
        let n = reqs.len();
        let mut chains: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut probs: Vec<Vec<DraftDist>> = vec![Vec::new(); n];
        let mut states: Vec<Vec<f32>> = vec![Vec::new(); n];
        let mut lens: Vec<usize> = vec![0; n];
        let mut rngs: Vec<Option<SeqRng>> = reqs
            .iter()
            .map(|r| r.sampling.map(|s| SeqRng::new(s.seed)))
            .collect();
        // Requests that allow a tree grow one (`topk` > 1): its nodes are the
        // head's best tokens, or for a sampled request draws from the head's
        // distribution, returned with it (see `head_tree`).
        let mut trees: Vec<(usize, Growing<'_>)> = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            let Some(p) = self
                .pending
                .get(&r.key)
                .filter(|p| p.len == r.len && r.len >= 2)
            else {
                continue;
            };
            if let (true, true, Some(root)) = (self.topk > 1, r.allow_tree, &p.root) {
                let g = Growing::new(
                    self,
                    r,
                    &p.logits,
                    root.clone(),
                    p.state.clone(),
                    self.topk,
                    self.depth,
                )?;
                trees.push((i, g));
                continue;
            }
            // Draft step j writes position len - 2 + j; it must fit the
            // context and the pages held.
            let room = (self.context + 2)
                .saturating_sub(r.len)
                .min((r.pages.len() * ps + 2).saturating_sub(r.len));
            lens[i] = r.max_tokens.min(self.max_steps).min(room).max(1);
            let sampling = r.sampling.zip(rngs[i].as_mut()).map(|(s, g)| (s.params, g));
            let (t, q) = self.pick(&p.logits, sampling)?;
            chains[i].push(t);
            probs[i].extend(q);
            states[i].clone_from(&p.state);
        }
        let steps = lens.iter().copied().max().unwrap_or(0);
        for j in 1..steps {
            let who: Vec<usize> = (0..n).filter(|&i| lens[i] > j).collect();
            if who.is_empty() {
                break;
            }
            let mut hidden = Vec::with_capacity(who.len() * h);
            let mut fed: Vec<(usize, &[u32], &[u32])> = Vec::with_capacity(who.len());
            for &i in &who {
                hidden.extend_from_slice(&states[i]);
                fed.push((reqs[i].len - 2 + j, &chains[i][j - 1..j], reqs[i].pages));
            }
            let out = self.step(&fed, hidden, h)?;
            for (&i, (logits, state)) in who.iter().zip(out) {
                let sampling = reqs[i]
                    .sampling
                    .zip(rngs[i].as_mut())
                    .map(|(s, g)| (s.params, g));
                let (t, q) = self.pick(&logits, sampling)?;
                chains[i].push(t);
                probs[i].extend(q);
                states[i] = state;
            }
        }
        let mut drafts: Vec<Draft> = chains
            .into_iter()
            .zip(probs)
            .zip(lens)
            .map(|((mut tokens, mut probs), n)| {
                tokens.truncate(n);
                probs.truncate(n);
                if probs.len() != tokens.len() {
                    probs.clear();
                }
                Draft {
                    probs,
                    ..Draft::chain(tokens)
                }
            })
            .collect();
        let (at, growing): (Vec<usize>, Vec<Growing<'_>>) = trees.into_iter().unzip();
        for (i, d) in at.into_iter().zip(self.grow(growing, self.topk)?) {
            drafts[i] = d;
        }
        Ok(drafts)
    }
}

impl Speculator for HeadDrafter {
    fn name(&self) -> &str {
        self.head.name()
    }

    fn propose(&mut self, reqs: &[DraftRequest<'_>]) -> Vec<Draft> {
        match self.draft(reqs) {
            Ok(drafts) => drafts,
            Err(e) => {
                self.failures += 1;
                tracing::warn!(
                    "{} drafting failed: {e}; this step verifies no drafts",
                    self.head.name()
                );
                vec![Draft::default(); reqs.len()]
            }
        }
    }

    fn observe(&mut self, _key: u64, _tokens: &[u32]) {}

    fn release(&mut self, key: u64) {
        self.pending.remove(&key);
    }

    fn drafting(&self) -> Drafting {
        if self.topk > 1 {
            Drafting::Model {
                max_tokens: self.tree_tokens,
                tree: true,
            }
        } else {
            Drafting::Model {
                max_tokens: self.max_steps,
                tree: false,
            }
        }
    }

    fn hidden_layers(&self) -> &[usize] {
        &self.layers
    }

    fn observe_states(&mut self, seqs: &[ComputedStates<'_>]) {
        if let Err(e) = self.extend(seqs) {
            self.failures += 1;
            tracing::warn!(
                "{} extend failed: {e}; the next drafts may be poor",
                self.head.name()
            );
        }
    }
}
