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
//!   layers, EAGLE's final normed state), and writes its KV at `p`. The last position's output is the first
//!   draft token and the hidden state the next draft step starts from; both
//!   are kept for the request, tagged with the sequence length they apply to.
//! - **Draft** ([`Speculator::propose`]): when the request's length is still
//!   that tag, the chain starts with the kept token; every further token is
//!   one head forward (batched over the requests still drafting) that feeds
//!   the previous draft token with the previous step's output state at the
//!   next position.
//!
//! Where its KV lives: a one-layer cache of its own with the target's page
//! size and page count, addressed by the target's page table, so its pages
//! come from the target's pool accounting and are freed with the request.
//! Invariant: every position the target computes gets its draft KV in the
//! same step (extend), so pages the radix cache shares carry their draft KV;
//! the KV that draft steps write past the sequence is rewritten by the next
//! extend. Drafts are advisory: verification decides what is kept.

use crate::eagle::EagleHead;
use crate::eagle3::Eagle3Head;
use crate::head::DraftHead;
use arbor_engine_core::attention::{AttentionBackend, BatchLayout};
use arbor_engine_core::backend::SampleRow;
use arbor_engine_core::error::{CoreError, Result};
use arbor_engine_core::kv::KvCache;
use arbor_engine_core::model::{ForwardBatch, ForwardContext};
use arbor_engine_core::speculative::{
    ComputedStates, Drafting, SpeculativeConfig, SpeculatorInputs,
};
use arbor_engine_core::{Backend, DType, Draft, DraftRequest, Speculator, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// A request's next draft start, from its last extend.
struct Pending {
    /// The sequence length it applies to.
    len: usize,
    /// The first draft token (a target id).
    token: u32,
    /// The head's output state at position `len - 2` (`[hidden]`).
    state: Vec<f32>,
}

/// Proposes draft chains with a [`DraftHead`] (see the module docs).
pub struct HeadDrafter {
    head: Box<dyn DraftHead>,
    backend: Arc<dyn Backend>,
    attention: Arc<dyn AttentionBackend>,
    kv: KvCache,
    layers: Vec<usize>,
    max_steps: usize,
    context: usize,
    pending: HashMap<u64, Pending>,
    failures: u64,
}

impl HeadDrafter {
    /// `eagle3`: loads the head at `inputs.draft_path` for `inputs.target`.
    pub fn eagle3(cfg: &SpeculativeConfig, inputs: &SpeculatorInputs) -> Result<Self> {
        let dir = inputs.draft_path.as_ref().ok_or_else(|| {
            CoreError::Config(
                "--speculative-algorithm EAGLE3 needs --speculative-draft-model-path (the head's folder)"
                    .into(),
            )
        })?;
        let target = &inputs.target;
        let embed = target.model().input_embedding();
        let head = Eagle3Head::load(dir, target.spec(), embed, target.backend().clone())?;
        Self::new(Box::new(head), cfg, inputs)
    }

    /// `eagle`: loads the EAGLE head at `inputs.draft_path` for `inputs.target`,
    /// sharing the target's LM head (and its embedding when the head has none).
    pub fn eagle(cfg: &SpeculativeConfig, inputs: &SpeculatorInputs) -> Result<Self> {
        let dir = inputs.draft_path.as_ref().ok_or_else(|| {
            CoreError::Config(
                "--speculative-algorithm EAGLE needs --speculative-draft-model-path (the head's folder)"
                    .into(),
            )
        })?;
        let target = &inputs.target;
        let head = EagleHead::load(dir, &*target.model(), target.backend().clone())?;
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
            context,
            pending: HashMap::new(),
            failures: 0,
        })
    }

    /// Head forwards that failed so far.
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// One head forward over `seqs` (prefix, fed token ids, pages), with
    /// `hidden` (`[tokens, width]` rows in the same order); the chosen
    /// target ids and output states (`[hidden]` each) at each sequence's
    /// last row.
    fn step(
        &self,
        seqs: &[(usize, &[u32], &[u32])],
        hidden: Vec<f32>,
        width: usize,
    ) -> Result<Vec<(u32, Vec<f32>)>> {
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
        let t = ids.len();
        let layout = Arc::new(layout);
        let batch = ForwardBatch {
            input_ids: ids,
            positions,
            layout: layout.clone(),
            logits_rows: rows,
            hidden_layers: Vec::new(),
            lora: Vec::new(),
            exit_after: None,
            hidden_at_every_row: false,
        };
        let hidden: Tensor = self.backend.upload_f32(&[t, width], &hidden)?;
        let attention_batch = self.attention.prepare(layout)?;
        let ctx = ForwardContext {
            kv: &self.kv,
            attention: &*self.attention,
            attention_batch: &attention_batch,
        };
        let out = self.head.forward(&batch, &hidden, &ctx)?;
        let n = seqs.len();
        let greedy = SampleRow {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        };
        let picked = self.backend.alloc(DType::U32, &[n])?;
        self.backend
            .sample(&out.logits, &vec![greedy; n], &picked)?;
        let mut bytes = vec![0u8; n * 4];
        self.backend.download(&picked, &mut bytes)?;
        let states = self.backend.download_f32(&out.state)?;
        let h = self.head.hidden_size();
        bytes
            .chunks_exact(4)
            .zip(states.chunks_exact(h))
            .map(|(c, s)| {
                let d = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                Ok((self.head.target_id(d)?, s.to_vec()))
            })
            .collect()
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
        let out = self.step(&fed, hidden, width)?;
        for (s, (token, state)) in kept.iter().zip(out) {
            self.pending.insert(
                s.key,
                Pending {
                    len: s.start + s.next_tokens.len() + 1,
                    token,
                    state,
                },
            );
        }
        Ok(())
    }

    /// The chains for `reqs`, in order.
    fn draft(&self, reqs: &[DraftRequest<'_>]) -> Result<Vec<Vec<u32>>> {
        let ps = self.kv.spec().page_size;
        let h = self.head.hidden_size();
        // Per request: chain length, then the chain and the current state.
        let mut chains: Vec<Vec<u32>> = Vec::with_capacity(reqs.len());
        let mut states: Vec<Vec<f32>> = Vec::with_capacity(reqs.len());
        let mut lens: Vec<usize> = Vec::with_capacity(reqs.len());
        for r in reqs {
            match self
                .pending
                .get(&r.key)
                .filter(|p| p.len == r.len && r.len >= 2)
            {
                Some(p) => {
                    // Draft step j writes position len - 2 + j; it must fit
                    // the context and the pages held.
                    let room = (self.context + 2)
                        .saturating_sub(r.len)
                        .min((r.pages.len() * ps + 2).saturating_sub(r.len));
                    lens.push(r.max_tokens.min(self.max_steps).min(room).max(1));
                    chains.push(vec![p.token]);
                    states.push(p.state.clone());
                }
                None => {
                    lens.push(0);
                    chains.push(Vec::new());
                    states.push(Vec::new());
                }
            }
        }
        let steps = lens.iter().copied().max().unwrap_or(0);
        for j in 1..steps {
            let who: Vec<usize> = (0..reqs.len()).filter(|&i| lens[i] > j).collect();
            if who.is_empty() {
                break;
            }
            let mut hidden = Vec::with_capacity(who.len() * h);
            let mut fed: Vec<(usize, &[u32], &[u32])> = Vec::with_capacity(who.len());
            for &i in &who {
                hidden.extend_from_slice(&states[i]);
                let last = &chains[i][j - 1..j];
                fed.push((reqs[i].len - 2 + j, last, reqs[i].pages));
            }
            let out = self.step(&fed, hidden, h)?;
            for (&i, (token, state)) in who.iter().zip(out) {
                chains[i].push(token);
                states[i] = state;
            }
        }
        for (c, &n) in chains.iter_mut().zip(&lens) {
            c.truncate(n);
        }
        Ok(chains)
    }
}

impl Speculator for HeadDrafter {
    fn name(&self) -> &str {
        self.head.name()
    }

    fn propose(&mut self, reqs: &[DraftRequest<'_>]) -> Vec<Draft> {
        match self.draft(reqs) {
            Ok(chains) => chains.into_iter().map(Draft::chain).collect(),
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
        Drafting::Model {
            max_steps: self.max_steps,
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
