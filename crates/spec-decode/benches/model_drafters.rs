//! Model drafters on the default model (SmolLM2-135M-Instruct Q4_1, 30
//! layers), the engine end to end, greedy:
//!
//! 1. batch 1 on copy-heavy chat prompts and two free-form ones: decode
//!    tok/s and mean accept length of plain decoding, n-gram, LAYERSKIP with
//!    N in {4, 8, 12}, and STANDALONE with the default model as its own draft
//!    (every draft accepted: the acceptance ceiling, which shows the per-step
//!    overhead of drafting with a second model);
//! 2. the same at temperature 0.7 (seeded) for plain, n-gram, LAYERSKIP 8
//!    and STANDALONE self: what drafting from the drafter's distribution and
//!    rejection sampling on the host cost and accept;
//! 3. where each breaks even: output tok/s of 1, 4 and 16 concurrent
//!    free-form prompts (ShareGPT's first user turns) against plain.
//!
//! Speculation is not adaptive here (`adaptive: false`), so the figures are
//! the drafters' own, except for one adaptive LAYERSKIP 8 engine (what the
//! controller makes of a drafter that does not pay). Engines alternate A B A B within one run; only ratios
//! measured this way mean anything on a shared machine. Benchmark only;
//! nothing asserted.
//!
//! Run: `cargo bench -p arbor-spec-decode --bench model_drafters`
//! (`ARBOR_BENCH_ROUNDS`, default 2; `ARBOR_BENCH_THREADS`, default 2;
//! `ARBOR_BENCH_LAYERS`, the LAYERSKIP depths, default `4,8,12`).

use arbor_engine_core::SamplingParams;
use arbor_engine_core::engine::Engine;
use arbor_engine_core::speculative::SpeculativeConfig;
use arbor_engine_core::{Backend, Registry};
use arbor_kv_radix as _;
use arbor_models::LoadedModel;
use arbor_spec_decode as _;
use std::sync::Arc;

#[path = "../../engine-core/tests/support/chat.rs"]
mod chat;
mod support;
use chat::{chat, copy_prompts};
use support::{default_model, engine, env_usize, run, run_with, sharegpt};

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn main() {
    let rounds = env_usize("ARBOR_BENCH_ROUNDS", 2);
    let threads = env_usize("ARBOR_BENCH_THREADS", 2);
    let Some((m, backend, registry)) = default_model(threads) else {
        return;
    };
    let engines = drafter_engines(&m, &backend, &registry);
    let free: Vec<Vec<u32>> = sharegpt(16)
        .iter()
        .map(|p| chat(&m, p).expect("chat prompt"))
        .collect();
    let mut prompts: Vec<Vec<u32>> = copy_prompts()
        .iter()
        .map(|p| chat(&m, p).expect("chat prompt"))
        .collect();
    prompts.extend(free.iter().take(2).cloned());
    greedy_batch1(&engines, &prompts, rounds, threads);
    sampled_batch1(&engines, &prompts, rounds);
    if free.len() == 16 {
        concurrent(&engines, &free, rounds);
    }
}

/// Plain, n-gram, LAYERSKIP at each `ARBOR_BENCH_LAYERS` depth, adaptive
/// LAYERSKIP 8 and STANDALONE with the model as its own draft.
fn drafter_engines(
    m: &LoadedModel,
    backend: &Arc<dyn Backend>,
    registry: &Registry,
) -> Vec<(String, Engine)> {
    let spec = |algorithm: &str, draft_layers: Option<usize>| SpeculativeConfig {
        algorithm: algorithm.into(),
        adaptive: false,
        draft_layers,
        ..SpeculativeConfig::default()
    };
    let mut engines: Vec<(String, Engine)> = vec![
        ("plain".into(), engine(m, backend, registry, None, None)),
        (
            "ngram".into(),
            engine(m, backend, registry, Some(spec("ngram", None)), None),
        ),
    ];
    let layers: Vec<usize> = std::env::var("ARBOR_BENCH_LAYERS")
        .unwrap_or_else(|_| "4,8,12".into())
        .split(',')
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    for n in layers {
        engines.push((
            format!("layerskip {n}"),
            engine(m, backend, registry, Some(spec("layerskip", Some(n))), None),
        ));
    }
    // What the adaptive controller makes of the weakest drafter.
    engines.push((
        "layerskip 8 adaptive".into(),
        engine(
            m,
            backend,
            registry,
            Some(SpeculativeConfig {
                adaptive: true,
                ..spec("layerskip", Some(8))
            }),
            None,
        ),
    ));
    engines.push((
        "standalone (self)".into(),
        engine(
            m,
            backend,
            registry,
            Some(spec("standalone", None)),
            Some(m.model.clone()),
        ),
    ));
    engines
}

/// Section 1: batch 1, greedy, every engine on every prompt.
fn greedy_batch1(
    engines: &[(String, Engine)],
    prompts: &[Vec<u32>],
    rounds: usize,
    threads: usize,
) {
    let steps = SpeculativeConfig::default().num_steps;
    println!(
        "== batch 1, greedy, {} prompts (3 copy-heavy, 2 free-form), 96 new tokens, {threads} threads, model drafters {steps} steps",
        prompts.len()
    );
    let n = engines.len();
    let mut rate = vec![Vec::new(); n];
    let mut accept = vec![0.0f64; n];
    let mut same = true;
    for round in 0..rounds {
        for p in prompts {
            let mut outs = Vec::new();
            for (i, (_, e)) in engines.iter().enumerate() {
                let _ = e.flush_cache();
                let (t, d, _, a, o) = run(e, std::slice::from_ref(p), 96);
                rate[i].push(t.saturating_sub(1) as f64 / d.max(1e-9));
                accept[i] += a / (rounds * prompts.len()) as f64;
                outs.push(o);
            }
            same &= outs.iter().all(|o| *o == outs[0]);
        }
        eprintln!("round {} done", round + 1);
    }
    for (i, (name, _)) in engines.iter().enumerate() {
        println!(
            "{name:>18}: decode {:.1} tok/s, {:.2}x plain, mean accept length {:.2}",
            mean(&rate[i]),
            mean(&rate[i]) / mean(&rate[0]),
            accept[i],
        );
    }
    println!("outputs identical: {same}");
}

/// Section 2: batch 1, sampled, for the drafters that draw from a distribution.
fn sampled_batch1(engines: &[(String, Engine)], prompts: &[Vec<u32>], rounds: usize) {
    let n = engines.len();
    // Sampled requests: model drafters draw from their own distribution and
    // verification runs rejection sampling on the host (n-gram drafts are
    // point masses there).
    println!("== batch 1, sampled (temperature 0.7, seeded), the same prompts, 96 new tokens");
    let sampled: Vec<usize> = engines
        .iter()
        .enumerate()
        .filter(|(_, (name, _))| {
            ["plain", "ngram", "layerskip 8", "standalone (self)"].contains(&name.as_str())
        })
        .map(|(i, _)| i)
        .collect();
    let mut rate = vec![Vec::new(); n];
    let mut accept = vec![0.0f64; n];
    for round in 0..rounds {
        for (k, p) in prompts.iter().enumerate() {
            let params = SamplingParams {
                temperature: 0.7,
                seed: Some((round * prompts.len() + k) as u64),
                ..SamplingParams::greedy(96)
            };
            for &i in &sampled {
                let e = &engines[i].1;
                let _ = e.flush_cache();
                let (t, d, _, a, _) = run_with(e, std::slice::from_ref(p), &params);
                rate[i].push(t.saturating_sub(1) as f64 / d.max(1e-9));
                accept[i] += a / (rounds * prompts.len()) as f64;
            }
        }
    }
    for &i in &sampled {
        println!(
            "{:>18}: decode {:.1} tok/s, {:.2}x plain, mean accept length {:.2}",
            engines[i].0,
            mean(&rate[i]),
            mean(&rate[i]) / mean(&rate[sampled[0]]),
            accept[i],
        );
    }
}

/// Section 3: 1, 4 and 16 concurrent free-form prompts against plain.
fn concurrent(engines: &[(String, Engine)], free: &[Vec<u32>], rounds: usize) {
    let n = engines.len();
    println!(
        "== concurrent free-form prompts (ShareGPT), 48 new tokens: output tok/s against plain"
    );
    for bs in [1usize, 4, 16] {
        let mut out_rate = vec![Vec::new(); n];
        let mut same = true;
        for _ in 0..rounds {
            let mut outs = Vec::new();
            for (i, (_, e)) in engines.iter().enumerate() {
                let _ = e.flush_cache();
                let (t, _, wall, _, o) = run(e, &free[..bs], 48);
                out_rate[i].push(t as f64 / wall);
                outs.push(o);
            }
            same &= outs.iter().all(|o| *o == outs[0]);
        }
        let cells: Vec<String> = engines
            .iter()
            .enumerate()
            .skip(1)
            .map(|(i, (name, _))| format!("{name} {:.2}x", mean(&out_rate[i]) / mean(&out_rate[0])))
            .collect();
        println!(
            "batch {bs:>2}: plain {:.1} tok/s; {}; outputs identical: {same}",
            mean(&out_rate[0]),
            cells.join(", ")
        );
    }
}
