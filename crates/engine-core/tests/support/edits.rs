//! A backend-independent check of logit edits on the device, shared by the
//! CPU, wgpu and CUDA test suites (included with `#[path]`):
//!
//! - `Backend::edit_logits` gives exactly the bits of `LogitEdits::apply`
//!   (the host definition) on random logits, edits and masks, and refuses
//!   edits outside the logits;
//! - an executor whose penalty and logit-bias processors say what they do as
//!   token edits samples every row on the device (no logits cross to the
//!   host) and produces, step after step, exactly the tokens of an executor
//!   running the same processors on the host: penalties with the output as
//!   history, logit bias, `min_new_tokens` with stop ids, grammar masks,
//!   and greedy verification of drafts under penalties (each row seeing the
//!   drafts on its path); seeded draws too where the device's sampler draws
//!   as the host's does;
//! - logprobs come from the device too (`Backend::logprob_stats`: the same
//!   alternatives as the host's definition, values within 1e-4), for plain
//!   and verified rows.

use anyhow::{Context, Result, ensure};
use arbor_engine_core::executor::{Executor, LocalExecutor};
use arbor_engine_core::grammar::TokenBitmask;
use arbor_engine_core::logit_edits::{LogitEdits, RowEdits};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::sampling::{
    LogitBiasProcessor, LogitsContext, LogitsProcessor, PenaltyProcessor, SeqRng, StandardSampler,
    log_sum_exp, top_logits,
};
use arbor_engine_core::step::{
    MaskInput, SampleContext, SampleRows, SampleSpec, SeqPlan, StepOutput, StepPlan, TokenLogprob,
};
use arbor_engine_core::{Backend, DType, LoadOptions, Registry, SamplingParams};
use std::path::Path;
use std::sync::Arc;

/// A processor run on the host only: the wrapped one without its edits,
/// active for every request so that every row takes the host path.
struct HostOnly<P>(P);

impl<P: LogitsProcessor> LogitsProcessor for HostOnly<P> {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn process(
        &self,
        logits: &mut [f32],
        ctx: &LogitsContext<'_>,
    ) -> arbor_engine_core::Result<()> {
        self.0.process(logits, ctx)
    }
    fn is_active(&self, _: &SamplingParams) -> bool {
        true
    }
}

/// Random edits of `[rows, vocab]` logits (masks on odd rows, one of them
/// shorter than the vocabulary).
fn random_edits(rng: &mut SeqRng, rows: usize, vocab: usize) -> Result<LogitEdits> {
    let mut all = LogitEdits::new(vocab);
    for r in 0..rows {
        let mut row = RowEdits::new(r as u32, vocab);
        for _ in 0..40 {
            let t = (rng.next_u64() % vocab as u64) as u32;
            match rng.next_u64() % 4 {
                0 => row.repeat(t, 0.5 + 1.5 * rng.next_f32()),
                1 => row.penalize(t, 3.0 * rng.next_f32() - 1.0),
                2 => row.bias(t, 20.0 * rng.next_f32() - 10.0),
                _ => row.forbid(t),
            }
        }
        row.finish(&mut all)?;
        if r % 2 == 1 || rows == 1 {
            let mut m = TokenBitmask::new(if r == 1 { vocab - 7 } else { vocab });
            for t in 0..vocab as u32 {
                if !rng.next_u64().is_multiple_of(3) {
                    m.allow(t);
                }
            }
            all.push_mask(r as u32, &m)?;
        }
    }
    Ok(all)
}

/// `Backend::edit_logits` against the host definition, bit for bit.
pub fn edits_match_the_host(backend: &dyn Backend) -> Result<()> {
    let mut rng = SeqRng::new(7);
    for (rows, vocab) in [(1usize, 33usize), (6, 1000), (3, 32)] {
        let values: Vec<f32> = (0..rows * vocab)
            .map(|_| 8.0 * rng.next_f32() - 4.0)
            .collect();
        let edits = random_edits(&mut rng, rows, vocab)?;
        ensure!(!edits.tokens.is_empty() && !edits.mask_rows.is_empty());
        let mut want = values.clone();
        edits.apply(&mut want, vocab)?;
        let t = backend.upload_f32(&[rows, vocab], &values)?;
        backend.edit_logits(&t, &edits)?;
        let got = backend.download_f32(&t)?;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            ensure!(
                g.to_bits() == w.to_bits(),
                "[{rows}, {vocab}] logit {i}: device {g} host {w}"
            );
        }
        // Edits past the logits are refused.
        let mut bad = edits.clone();
        bad.tokens.push(arbor_engine_core::TokenEdit {
            row: rows as u32,
            ..edits.tokens[0]
        });
        ensure!(
            backend.edit_logits(&t, &bad).is_err(),
            "a row past the logits"
        );
    }
    Ok(())
}

/// One request of the scenario: its pages, prompt, parameters and output.
struct Req {
    pages: Vec<u32>,
    prompt: Arc<[u32]>,
    params: Arc<SamplingParams>,
    out: Vec<u32>,
    /// A grammar mask each step: tokens `id % 3 == step % 3`.
    masked: bool,
    logprobs: Option<usize>,
}

impl Req {
    fn plan(&self, step: u64, drafts: &[u32]) -> SeqPlan {
        let (tokens, prefix_len) = match self.out.last() {
            None => (self.prompt.to_vec(), 0),
            Some(&last) => {
                let mut t = vec![last];
                t.extend_from_slice(drafts);
                (t, self.prompt.len() + self.out.len() - 1)
            }
        };
        let rows = if drafts.is_empty() {
            SampleRows::Last
        } else {
            SampleRows::Verify {
                drafts: drafts.len(),
            }
        };
        SeqPlan {
            lora: None,
            state_slot: None,
            state_ops: Default::default(),
            prompt_logprobs: None,
            pool: None,
            tokens,
            prefix_len,
            pages: self.pages.clone(),
            tree: None,
            sample: Some(SampleSpec {
                params: self.params.clone(),
                rows,
                seed: step * 1000 + self.pages[0] as u64,
                context: Some(SampleContext {
                    prompt: self.prompt.clone(),
                    output: self.out.clone(),
                }),
                logprobs: self.logprobs,
                generated: self.out.len(),
                draft_probs: Vec::new(),
                logprob_ids: None,
            }),
        }
    }
}

fn mask_for(step: u64, vocab: usize, rows: usize) -> Vec<TokenBitmask> {
    (0..rows as u64)
        .map(|j| {
            let mut m = TokenBitmask::new(vocab);
            for t in (0..vocab as u32).filter(|t| u64::from(t % 3) == (step + j) % 3) {
                m.allow(t);
            }
            m
        })
        .collect()
}

/// Runs one step of `reqs` (with `drafts` per request) on `ex`.
fn run(ex: &LocalExecutor, reqs: &[Req], step: u64, drafts: &[Vec<u32>]) -> Result<StepOutput> {
    let vocab = ex.model_spec().vocab_size;
    let masks = reqs
        .iter()
        .zip(drafts)
        .map(|(r, d)| {
            if r.masked {
                mask_for(step, vocab, d.len() + 1)
            } else {
                Vec::new()
            }
        })
        .collect();
    Ok(ex.execute(&StepPlan {
        seqs: reqs
            .iter()
            .zip(drafts)
            .map(|(r, d)| r.plan(step, d))
            .collect(),
        masks: MaskInput::Ready(masks),
        ..Default::default()
    })?)
}

/// Runs the executor-level check on `backend` with the HF model folder
/// `model`; `same_draws`: the device's sampler draws the host's token for a
/// seed (the CPU backend), so sampled rows are compared too.
pub fn edited_sampling_matches_host(
    backend: Arc<dyn Backend>,
    model: &Path,
    same_draws: bool,
) -> Result<()> {
    edits_match_the_host(&*backend)?;
    logprob_stats_match_the_host(&*backend)?;
    let registry = Registry::builtin()?;
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("f32")?(&Default::default())?,
        progress: None,
    };
    let m = arbor_models::load_model(model, &registry, &opts)?;
    let executor = |device: bool| -> Result<LocalExecutor> {
        let runner = ModelRunner::new(m.model.clone(), backend.clone(), None, 16, 24, DType::F32)?;
        let processors: Vec<Arc<dyn LogitsProcessor>> = if device {
            vec![Arc::new(PenaltyProcessor), Arc::new(LogitBiasProcessor)]
        } else {
            vec![
                Arc::new(HostOnly(PenaltyProcessor)),
                Arc::new(HostOnly(LogitBiasProcessor)),
            ]
        };
        Ok(LocalExecutor::new(
            runner,
            Arc::new(StandardSampler),
            processors,
            vec![2],
        ))
    };
    let (dev, host) = (executor(true)?, executor(false)?);
    let prompt = |seed: u32| -> Arc<[u32]> {
        (0..14)
            .map(|i| (i * 37 + seed * 11) % 200 + (i % 4) * 3)
            .collect()
    };
    // The first greedy token of request 1's prompt becomes a stop id that
    // `min_new_tokens` must hold back.
    let probe = Req {
        pages: (4..8).collect(),
        prompt: prompt(1),
        params: Arc::new(SamplingParams::greedy(32)),
        out: Vec::new(),
        masked: false,
        logprobs: None,
    };
    let first = run(&host, std::slice::from_ref(&probe), 0, &[Vec::new()])?;
    let stop = *first.seqs[0].tokens.first().context("a token")?;
    let plain = {
        let mut r = Req {
            pages: (20..24).collect(),
            prompt: prompt(0),
            params: Arc::new(SamplingParams::greedy(32)),
            out: Vec::new(),
            masked: false,
            logprobs: None,
        };
        for step in 0..12 {
            let o = run(&dev, std::slice::from_ref(&r), step, &[Vec::new()])?;
            r.out.extend_from_slice(&o.seqs[0].tokens);
        }
        r.out
    };
    let penalties = SamplingParams {
        // Token 5 is favoured until its count in the history outweighs its
        // bias, so which row picks it depends on the drafts on its path.
        repetition_penalty: 1.6,
        frequency_penalty: 6.0,
        presence_penalty: 0.4,
        logit_bias: [(5u32, 15.0f32), (stop, -1.0), (77, 1.25), (plain[2], -30.0)].into(),
        ..SamplingParams::greedy(32)
    };
    let mut params = vec![
        penalties.clone(),
        SamplingParams {
            min_new_tokens: 6,
            stop_token_ids: vec![stop],
            ..SamplingParams::greedy(32)
        },
        SamplingParams::greedy(32),
    ];
    if same_draws {
        params.push(SamplingParams {
            temperature: 0.9,
            top_p: 0.9,
            top_k: 40,
            ..penalties.clone()
        });
    }
    let n = params.len();
    let mut reqs: Vec<[Req; 2]> = params
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let p = Arc::new(p);
            let r = || Req {
                pages: (i as u32 * 4..i as u32 * 4 + 4).collect(),
                prompt: prompt(i as u32),
                params: p.clone(),
                out: Vec::new(),
                masked: i == 2,
                logprobs: [Some(3), None, Some(5)].get(i).copied().flatten(),
            };
            [r(), r()]
        })
        .collect();
    let none = vec![Vec::new(); n];
    for step in 0..12u64 {
        let out_dev = run_refs(&dev, &reqs, 0, step, &none)?;
        let out_host = run_refs(&host, &reqs, 1, step, &none)?;
        ensure!(
            out_dev.host_sampled_rows == 0,
            "step {step}: logits crossed to the host"
        );
        ensure!(
            out_host.host_sampled_rows == n,
            "step {step}: the host path was not taken"
        );
        for (i, (x, y)) in out_dev.seqs.iter().zip(&out_host.seqs).enumerate() {
            ensure!(
                x.tokens == y.tokens && x.error().is_none(),
                "step {step}, request {i}: device {:?} host {:?} ({:?})",
                x.tokens,
                y.tokens,
                x.error()
            );
            same_logprobs(x.logprobs(), y.logprobs(), reqs[i][0].logprobs)
                .with_context(|| format!("step {step}, request {i}"))?;
            reqs[i][0].out.extend_from_slice(&x.tokens);
            reqs[i][1].out.extend_from_slice(&y.tokens);
        }
    }
    // The edits mattered: request 1 held its stop id back for 6 tokens, the
    // masked request kept to its masks, the penalized one left plain greedy.
    let outs: Vec<&Vec<u32>> = reqs.iter().map(|r| &r[0].out).collect();
    ensure!(
        !outs[1][..6].contains(&stop),
        "min_new_tokens: {:?}",
        outs[1]
    );
    for (s, &t) in outs[2].iter().enumerate() {
        ensure!(u64::from(t % 3) == s as u64 % 3, "mask at step {s}: {t}");
    }
    ensure!(
        plain != *outs[0],
        "penalties and bias changed nothing: {plain:?}"
    );
    let vocab = m.model.spec().vocab_size as u32;
    verify_under_penalties(&dev, &host, &mut reqs[0], vocab)
}

/// Greedy verification of the penalized request `pair` (its device and host
/// copies) after its decode: drafts of its own continuation, then with a
/// wrong third draft, then as a tree whose first branch is wrong.
fn verify_under_penalties(
    dev: &LocalExecutor,
    host: &LocalExecutor,
    pair: &mut [Req; 2],
    vocab: u32,
) -> Result<()> {
    // From the penalized request's first token, drafts of its own
    // continuation (then one with a wrong third draft) are checked row by
    // row with the history each row's path implies (token 5, a draft, must
    // count against row 2 onwards), the same on both sides, and accept
    // exactly the continuation.
    let cont = pair[0].out.clone();
    ensure!(
        cont[1..5].contains(&5),
        "token 5 among the drafts: {cont:?}"
    );
    for wrong in [false, true] {
        let mut drafts = cont[1..5].to_vec();
        if wrong {
            drafts[2] = (drafts[2] + 1) % vocab;
        }
        let mut got = Vec::new();
        for (k, ex) in [dev, host].into_iter().enumerate() {
            let r = &mut pair[k];
            r.out.truncate(1);
            let o = run(ex, std::slice::from_ref(r), 12, &[drafts.clone()])?;
            let o = o.seqs.into_iter().next().context("one sequence")?;
            got.push((o.tokens.to_vec(), o.logprobs().to_vec()));
        }
        let want = if wrong { &cont[1..4] } else { &cont[1..6] };
        ensure!(
            got[0].0 == got[1].0 && got[0].0 == want,
            "verify (wrong draft: {wrong}): device {:?} host {:?} want {want:?}",
            got[0].0,
            got[1].0
        );
        same_logprobs(&got[0].1, &got[1].1, Some(3)).context("verify")?;
    }
    // The same as a draft tree whose first branch is wrong: the rows of the
    // right branch see only their own ancestors.
    if dev.capabilities().tree {
        let wrong = (cont[1] + 1) % vocab;
        let drafts = [wrong, cont[1], cont[2], cont[3], cont[4]];
        let mut got = Vec::new();
        for (k, ex) in [dev, host].into_iter().enumerate() {
            let r = &mut pair[k];
            r.out.truncate(1);
            let mut seq = r.plan(12, &drafts);
            seq.tree = Some(vec![-1, 0, 0, 2, 3, 4]);
            let o = ex.execute(&StepPlan {
                seqs: vec![seq],
                ..Default::default()
            })?;
            let o = o.seqs.into_iter().next().context("one sequence")?;
            got.push((o.tokens.to_vec(), o.logprobs().to_vec()));
        }
        ensure!(
            got[0].0 == got[1].0 && got[0].0 == cont[1..6],
            "tree verify: device {:?} host {:?} want {:?}",
            got[0].0,
            got[1].0,
            &cont[1..6]
        );
        same_logprobs(&got[0].1, &got[1].1, Some(3)).context("tree verify")?;
    }
    Ok(())
}

/// Logprobs computed on the device against the host's: one per token
/// (when asked), the same token and alternatives, values within 1e-4.
fn same_logprobs(dev: &[TokenLogprob], host: &[TokenLogprob], asked: Option<usize>) -> Result<()> {
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-4 * a.abs().max(1.0);
    ensure!(
        dev.len() == host.len() && (asked.is_some() || dev.is_empty()),
        "{} logprobs on the device, {} on the host",
        dev.len(),
        host.len()
    );
    for (d, h) in dev.iter().zip(host) {
        ensure!(
            d.token == h.token && close(d.logprob, h.logprob) && d.top.len() == h.top.len(),
            "device {d:?} host {h:?}"
        );
        ensure!(Some(d.top.len()) == asked, "{} alternatives", d.top.len());
        for (a, b) in d.top.iter().zip(&h.top) {
            ensure!(a.0 == b.0 && close(a.1, b.1), "device {d:?} host {h:?}");
        }
    }
    Ok(())
}

/// `Backend::logprob_stats` against the host's definitions: the same
/// alternatives in the same order (ties to the lower id), values within
/// 1e-5; and too many alternatives refused.
pub fn logprob_stats_match_the_host(backend: &dyn Backend) -> Result<()> {
    let mut rng = SeqRng::new(11);
    for (rows, vocab, top) in [(1usize, 7usize, 7usize), (4, 1000, 20), (3, 300, 64)] {
        let mut values: Vec<f32> = (0..rows * vocab)
            .map(|_| 16.0 * rng.next_f32() - 8.0)
            .collect();
        // Ties among the largest: the lower id comes first.
        values[vocab / 2] = 9.0;
        values[vocab / 3] = 9.0;
        values[0] = f32::NEG_INFINITY;
        let t = backend.upload_f32(&[rows, vocab], &values)?;
        let lse = backend.alloc(DType::F32, &[rows])?;
        let ids = backend.alloc(DType::U32, &[rows, top])?;
        let vals = backend.alloc(DType::F32, &[rows, top])?;
        backend.logprob_stats(&t, top, &lse, &ids, &vals)?;
        let got_lse = backend.download_f32(&lse)?;
        let got_vals = backend.download_f32(&vals)?;
        let got_ids = backend.download_u32(&ids)?;
        for (r, row) in values.chunks_exact(vocab).enumerate() {
            let want_lse = log_sum_exp(row);
            ensure!(
                (got_lse[r] - want_lse).abs() <= 1e-5 * want_lse.abs().max(1.0),
                "row {r}: lse {} want {want_lse}",
                got_lse[r]
            );
            for (k, (id, x)) in top_logits(row, top).into_iter().enumerate() {
                let (gi, gv) = (got_ids[r * top + k], got_vals[r * top + k]);
                let want = x - want_lse;
                ensure!(
                    gi == id && (gv == want || (gv - want).abs() <= 1e-5 * want.abs().max(1.0)),
                    "[{rows}, {vocab}] row {r} alternative {k}: ({gi}, {gv}) want ({id}, {want})"
                );
            }
        }
        if top < vocab {
            let more = backend.alloc(DType::U32, &[rows, 65])?;
            let more_v = backend.alloc(DType::F32, &[rows, 65])?;
            ensure!(
                backend.logprob_stats(&t, 65, &lse, &more, &more_v).is_err(),
                "65 alternatives accepted"
            );
        }
    }
    Ok(())
}

/// Runs side `k` (0: device, 1: host) of the paired requests.
fn run_refs(
    ex: &LocalExecutor,
    reqs: &[[Req; 2]],
    k: usize,
    step: u64,
    drafts: &[Vec<u32>],
) -> Result<StepOutput> {
    let vocab = ex.model_spec().vocab_size;
    let seqs = reqs
        .iter()
        .zip(drafts)
        .map(|(r, d)| r[k].plan(step, d))
        .collect();
    let masks = reqs
        .iter()
        .zip(drafts)
        .map(|(r, d)| {
            if r[k].masked {
                mask_for(step, vocab, d.len() + 1)
            } else {
                Vec::new()
            }
        })
        .collect();
    Ok(ex.execute(&StepPlan {
        seqs,
        masks: MaskInput::Ready(masks),
        ..Default::default()
    })?)
}
