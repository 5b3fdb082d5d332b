//! A backend-independent check of chain verification, shared by the CPU,
//! wgpu and CUDA test suites (included with `#[path]`): on the given device,
//! the greedy tokens of plain one-token decode steps must equal what one
//! verify step of the same tokens as drafts accepts — all of them when the
//! drafts are right; up to a corrupted draft, then the target's own token,
//! when one is wrong — and a draft past a rejection must leave no trace (the
//! next step, overwriting its slots, continues exactly); a step that
//! samples one row on the device and another on the host gives both right;
//! tree verification accepts exactly what plain decoding gives through a
//! branch that is not the first child (so the accepted KV is moved into
//! chain order) and the steps after it continue exactly; HiCache's page
//! copies between device and host move KV exactly, also when the step that
//! loads a prefix computes on it.

use anyhow::{Context, Result, ensure};
use arbor_engine_core::executor::{Executor, LocalExecutor};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::sampling::StandardSampler;
use arbor_engine_core::step::{SampleRows, SampleSpec, SeqPlan, StepPlan};
use arbor_engine_core::{Backend, DType, LoadOptions, Registry, SamplingParams};
use std::path::Path;
use std::sync::Arc;

fn spec(rows: SampleRows) -> SampleSpec {
    SampleSpec {
        params: Arc::new(SamplingParams::greedy(64)),
        rows,
        seed: 0,
        context: None,
        logprobs: None,
        generated: 1,
        draft_probs: Vec::new(),
        logprob_ids: None,
    }
}

fn step(ex: &LocalExecutor, seq: SeqPlan) -> Result<Vec<u32>> {
    let out = ex.execute(&StepPlan {
        seqs: vec![seq],
        ..Default::default()
    })?;
    Ok(out
        .seqs
        .into_iter()
        .next()
        .context("one sequence")?
        .tokens
        .into_vec())
}

/// An executor of `model` on `backend` (f32, pages of 16, 16 pages of KV)
/// and the bytes of one of its host-tier pages.
fn executor(backend: &Arc<dyn Backend>, model: &Path) -> Result<(LocalExecutor, usize)> {
    let registry = Registry::builtin()?;
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("f32")?(&Default::default())?,
        progress: None,
    };
    let m = arbor_models::load_model(model, &registry, &opts)?;
    let runner = ModelRunner::new(m.model.clone(), backend.clone(), None, 16, 16, DType::F32)?;
    let page_bytes = arbor_engine_core::TierIdentity::new("m", runner.kv_spec()).page_bytes();
    Ok((
        LocalExecutor::new(runner, Arc::new(StandardSampler), vec![], vec![]),
        page_bytes,
    ))
}

/// A one-sequence greedy plan of `tokens` after `prefix_len` cached ones.
fn greedy_seq(tokens: Vec<u32>, prefix_len: usize, pages: Vec<u32>) -> SeqPlan {
    SeqPlan {
        lora: None,
        state_slot: None,
        state_ops: Default::default(),
        prompt_logprobs: None,
        pool: None,
        tokens,
        prefix_len,
        pages,
        tree: None,
        sample: Some(spec(SampleRows::Last)),
    }
}

/// `toks` (what a prompt of `prompt_len` tokens sampled so far) and six
/// more greedy decode steps on `pages`.
fn decode_six(
    ex: &LocalExecutor,
    prompt_len: usize,
    mut toks: Vec<u32>,
    pages: &[u32],
) -> Result<Vec<u32>> {
    for _ in 0..6 {
        let last = *toks.last().context("a token")?;
        let prefix = prompt_len + toks.len() - 1;
        toks.extend(step(ex, greedy_seq(vec![last], prefix, pages.to_vec()))?);
    }
    Ok(toks)
}

/// Runs the check on `backend` with the HF model folder `model`.
pub fn chain_verify_matches_decode(backend: Arc<dyn Backend>, model: &Path) -> Result<()> {
    let (ex, _) = executor(&backend, model)?;
    let pages: Vec<u32> = (0..8).collect();
    let prompt: Vec<u32> = vec![17, 301, 45, 9, 220, 78, 3, 150, 41];
    let prefill = |ex: &LocalExecutor| {
        step(
            ex,
            SeqPlan {
                lora: None,
                state_slot: None,
                state_ops: Default::default(),
                prompt_logprobs: None,
                pool: None,
                tokens: prompt.clone(),
                prefix_len: 0,
                pages: pages.clone(),
                tree: None,
                sample: Some(spec(SampleRows::Last)),
            },
        )
    };
    // Plain decode: one token per step.
    let mut toks = prefill(&ex)?;
    for _ in 0..10 {
        let last = *toks.last().context("a token")?;
        let t = step(
            &ex,
            SeqPlan {
                lora: None,
                state_slot: None,
                state_ops: Default::default(),
                prompt_logprobs: None,
                pool: None,
                tokens: vec![last],
                prefix_len: prompt.len() + toks.len() - 1,
                pages: pages.clone(),
                tree: None,
                sample: Some(spec(SampleRows::Last)),
            },
        )?;
        toks.extend(t);
    }
    let verify = |drafts: &[u32]| -> SeqPlan {
        let mut tokens = vec![toks[0]];
        tokens.extend_from_slice(drafts);
        SeqPlan {
            lora: None,
            state_slot: None,
            state_ops: Default::default(),
            prompt_logprobs: None,
            pool: None,
            tokens,
            prefix_len: prompt.len(),
            pages: pages.clone(),
            tree: None,
            sample: Some(spec(SampleRows::Verify {
                drafts: drafts.len(),
            })),
        }
    };
    // Right drafts: all accepted, plus the target's next token.
    ensure!(prefill(&ex)? == toks[..1], "prefill changed");
    let got = step(&ex, verify(&toks[1..9]))?;
    ensure!(
        got == toks[1..10],
        "all-right drafts: {got:?}, want {:?}",
        &toks[1..10]
    );
    // A wrong fourth draft: three accepted, then the target's own token.
    let mut drafts = toks[1..9].to_vec();
    drafts[3] = (drafts[3] + 1) % ex.model_spec().vocab_size as u32;
    ensure!(prefill(&ex)? == toks[..1], "prefill changed");
    let got = step(&ex, verify(&drafts))?;
    ensure!(
        got == toks[1..5],
        "a wrong 4th draft: {got:?}, want {:?}",
        &toks[1..5]
    );
    // Continue after the rejection from the accepted length: exact again.
    let t = step(
        &ex,
        SeqPlan {
            lora: None,
            state_slot: None,
            state_ops: Default::default(),
            prompt_logprobs: None,
            pool: None,
            tokens: vec![toks[4]],
            prefix_len: prompt.len() + 4,
            pages: pages.clone(),
            tree: None,
            sample: Some(spec(SampleRows::Verify { drafts: 0 })),
        },
    )?;
    ensure!(
        t == toks[5..6],
        "after rollback: {t:?}, want {:?}",
        &toks[5..6]
    );
    Ok(())
}

/// Tree verification on `backend` with the HF model folder `model`: the
/// tokens of plain one-token decode steps `t0, t1, ...` are drafted as a tree
/// whose right path is never the first child of its parent, next to wrong
/// siblings and a wrong subtree:
///
/// ```text
/// 0:t0 ─┬─ 1:t1' ── 3:t2
///       └─ 2:t1 ─┬─ 4:t2'
///                └─ 5:t2 ── 6:t3 ─┬─ 7:t4'
///                                 └─ 8:t4
/// ```
/// (`x'` a wrong token). One verify step must accept the path 2, 5, 6, 8 and
/// add the target's own `t5`, and two decode steps after it, reading the KV
/// the executor moved into chain order, must give `t6`, `t7`.
pub fn tree_verify_matches_decode(backend: Arc<dyn Backend>, model: &Path) -> Result<()> {
    let (ex, _) = executor(&backend, model)?;
    let pages: Vec<u32> = (0..8).collect();
    ensure!(
        ex.capabilities().tree,
        "the attention backend does not declare draft trees"
    );
    let prompt: Vec<u32> = vec![5, 88, 213, 7, 64, 130, 2, 19];
    let decode = |tok: u32, prefix_len: usize| -> Result<Vec<u32>> {
        step(
            &ex,
            SeqPlan {
                lora: None,
                state_slot: None,
                state_ops: Default::default(),
                prompt_logprobs: None,
                pool: None,
                tokens: vec![tok],
                prefix_len,
                pages: pages.clone(),
                tree: None,
                sample: Some(spec(SampleRows::Last)),
            },
        )
    };
    let prefill = || {
        step(
            &ex,
            SeqPlan {
                lora: None,
                state_slot: None,
                state_ops: Default::default(),
                prompt_logprobs: None,
                pool: None,
                tokens: prompt.clone(),
                prefix_len: 0,
                pages: pages.clone(),
                tree: None,
                sample: Some(spec(SampleRows::Last)),
            },
        )
    };
    let mut t = prefill()?;
    for _ in 0..7 {
        let last = *t.last().context("a token")?;
        t.extend(decode(last, prompt.len() + t.len() - 1)?);
    }
    let vocab = ex.model_spec().vocab_size as u32;
    let wrong = |x: u32| (x + 1) % vocab;
    let tokens = vec![
        t[0],
        wrong(t[1]),
        t[1],
        t[2],
        wrong(t[2]),
        t[2],
        t[3],
        wrong(t[4]),
        t[4],
    ];
    let parents = vec![-1, 0, 0, 1, 2, 2, 5, 6, 6];
    ensure!(prefill()? == t[..1], "prefill changed");
    let out = ex.execute(&StepPlan {
        seqs: vec![SeqPlan {
            lora: None,
            state_slot: None,
            state_ops: Default::default(),
            prompt_logprobs: None,
            pool: None,
            tokens,
            prefix_len: prompt.len(),
            pages: pages.clone(),
            tree: Some(parents),
            sample: Some(spec(SampleRows::Verify { drafts: 8 })),
        }],
        ..Default::default()
    })?;
    let s = out.seqs.into_iter().next().context("one sequence")?;
    ensure!(s.error().is_none(), "{:?}", s.error());
    ensure!(
        s.tokens.as_slice() == &t[1..6] && s.accepted == 4 && s.accepted_path() == [2, 5, 6, 8],
        "tree verification gave {:?} (accepted {}, path {:?}), want {:?} along 2, 5, 6, 8",
        s.tokens,
        s.accepted,
        s.accepted_path(),
        &t[1..6]
    );
    // The accepted tokens' KV now sits in chain order: decoding continues exactly.
    let t6 = decode(t[5], prompt.len() + 5)?;
    ensure!(t6 == t[6..7], "after the tree: {t6:?}, want {:?}", &t[6..7]);
    let t7 = decode(t[6], prompt.len() + 6)?;
    ensure!(
        t7 == t[7..8],
        "two steps after the tree: {t7:?}, want {:?}",
        &t[7..8]
    );
    Ok(())
}

/// KV tier copies on `backend` (HiCache's load-back and backup): a plan's
/// copies move pages device → host → other device pages exactly (their K
/// and V bytes equal), decoding from the copies gives the tokens decoding
/// from the originals gives, and a load from a host slot that holds no page
/// is refused.
pub fn tier_copies_move_kv_exactly(backend: Arc<dyn Backend>, model: &Path) -> Result<()> {
    use arbor_engine_core::{CopyDirection, HostKvPool, KvTierOps, PageCopy};
    let (ex, page_bytes) = executor(&backend, model)?;
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 400).collect();
    let first = step(&ex, greedy_seq(prompt.clone(), 0, vec![0, 1, 2]))?;
    let host = HostKvPool::new(page_bytes, 4);
    let slots = host.alloc(3).context("host slots")?;
    let mut copies = Vec::new();
    for (i, s) in slots.slots().iter().enumerate() {
        copies.push(PageCopy {
            direction: CopyDirection::ToHost,
            device_page: i as u32,
            host: *s,
        });
    }
    for (i, s) in slots.slots().iter().enumerate() {
        copies.push(PageCopy {
            direction: CopyDirection::ToDevice,
            device_page: 10 + i as u32,
            host: *s,
        });
    }
    let out = ex.execute(&StepPlan {
        kv_ops: KvTierOps {
            host: Some(host.clone()),
            copies,
        },
        ..Default::default()
    })?;
    ensure!(
        out.kv_copy.pages_to_host == 3 && out.kv_copy.pages_to_device == 3,
        "{:?}",
        out.kv_copy
    );
    let kv = ex.runner().kv();
    for l in 0..kv.spec().num_layers {
        let layer = kv.layer(l)?;
        for t in [&layer.k, &layer.v] {
            for p in 0..3 {
                let a = backend.download_f32(&t.narrow(p * 16, 16)?)?;
                let b = backend.download_f32(&t.narrow((10 + p) * 16, 16)?)?;
                ensure!(a == b, "layer {l} page {p}: the copy differs");
            }
        }
    }
    let original = decode_six(&ex, prompt.len(), first.clone(), &[0, 1, 2, 3])?;
    let copied = decode_six(&ex, prompt.len(), first.clone(), &[10, 11, 12, 13])?;
    ensure!(original == copied, "{original:?} vs {copied:?}");
    // A slot never written holds no page: loading it is an error, not garbage.
    let empty = host.alloc(1).context("a slot")?;
    let bad = ex.execute(&StepPlan {
        kv_ops: KvTierOps {
            host: Some(host.clone()),
            copies: vec![PageCopy {
                direction: CopyDirection::ToDevice,
                device_page: 5,
                host: empty.slots()[0],
            }],
        },
        ..Default::default()
    });
    ensure!(bad.is_err(), "a load from an empty slot was accepted");
    Ok(())
}

/// HiCache's load-back in the step that uses it: a step that loads a
/// prefix's pages from host slots (over pages holding another prompt's KV)
/// and computes the rest of the prompt on them gives the tokens the prompt
/// gives computed whole, and so do the decode steps after it. On an
/// asynchronous device the loads run beside the forward, one layer's part
/// at a time, so this fails when a layer reads its pages before their copy
/// ran. The host pages are in the device's host memory (pinned on GPUs).
pub fn load_back_is_exact_in_the_step_that_loads(
    backend: Arc<dyn Backend>,
    model: &Path,
) -> Result<LoadBack> {
    use arbor_engine_core::{CopyDirection, HostKvPool, KvTierOps, PageCopy};
    let (ex, page_bytes) = executor(&backend, model)?;
    let kv = *ex.runner().kv_spec();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 400).collect();
    let other: Vec<u32> = (0..40).map(|i| (i * 53 + 5) % 400).collect();
    let first = step(&ex, greedy_seq(prompt.clone(), 0, vec![0, 1, 2]))?;
    let whole = decode_six(&ex, prompt.len(), first, &[0, 1, 2, 3])?;
    // Pages 10-12 hold another prompt's KV: a load that is not waited for
    // leaves it there.
    step(&ex, greedy_seq(other, 0, vec![10, 11, 12]))?;
    // The host tier in the device's own host memory (pinned on GPUs).
    let host = HostKvPool::with_memory(page_bytes, 2, backend.host_memory());
    let slots = host.alloc(2).context("host slots")?;
    let copies = |direction, first_page: u32| KvTierOps {
        host: Some(host.clone()),
        copies: (slots.slots().iter().zip(first_page..))
            .map(|(s, device_page)| PageCopy {
                direction,
                device_page,
                host: *s,
            })
            .collect(),
    };
    ex.execute(&StepPlan {
        kv_ops: copies(CopyDirection::ToHost, 0),
        ..Default::default()
    })?;
    let out = ex.execute(&StepPlan {
        seqs: vec![greedy_seq(prompt[32..].to_vec(), 32, vec![10, 11, 12])],
        kv_ops: copies(CopyDirection::ToDevice, 10),
        ..Default::default()
    })?;
    ensure!(out.kv_copy.pages_to_device == 2, "{:?}", out.kv_copy);
    let first = out
        .seqs
        .into_iter()
        .next()
        .context("one sequence")?
        .tokens
        .into_vec();
    let loaded = decode_six(&ex, prompt.len(), first, &[10, 11, 12, 13])?;
    ensure!(
        loaded == whole,
        "after a load-back {loaded:?}, computed whole {whole:?}"
    );
    ensure!(
        host.heap_fallbacks() == 0,
        "the {} host memory ran out",
        host.memory_kind()
    );
    Ok(LoadBack {
        batches: kv.num_layers * kv.tensors_per_layer(),
        memory: host.memory_kind(),
    })
}

/// What [`load_back_is_exact_in_the_step_that_loads`] ran.
pub struct LoadBack {
    /// Load batches the step wrote (one per layer tensor).
    #[allow(dead_code)] // read by the emulator's copy-stream test only
    pub batches: usize,
    /// The host pages' memory (`pinned`, `heap`).
    pub memory: &'static str,
}
