//! N-gram speculation on the default model (SmolLM2-135M-Instruct Q4_1), the
//! engine end to end: batch-1 greedy decode speed on copy-heavy chat prompts
//! (rewrite a function with one variable renamed, copy a paragraph, repeat
//! a JSON document) with and without speculation, and the output rate of 16
//! concurrent free-form prompts (the first user turns of ShareGPT
//! conversations from `../shared/data`) with adaptive speculation against
//! none. Engines alternate A B A B within one run; only ratios measured this
//! way mean anything on a shared machine. Benchmark only; nothing asserted.
//!
//! Run: `cargo bench -p arbor-spec-decode --bench default_model`
//! (`ARBOR_BENCH_ROUNDS`, default 3; `ARBOR_BENCH_THREADS`, default 2).

use arbor_engine_core::speculative::SpeculativeConfig;
use arbor_kv_radix as _;
use arbor_spec_decode as _;

#[path = "../../engine-core/tests/support/chat.rs"]
mod chat;
mod support;
use chat::{chat, copy_prompts};
use support::{default_model, engine, env_usize, run, sharegpt};

fn main() {
    let rounds = env_usize("ARBOR_BENCH_ROUNDS", 3);
    let threads = env_usize("ARBOR_BENCH_THREADS", 2);
    let Some((m, backend, registry)) = default_model(threads) else {
        return;
    };
    let off = engine(&m, &backend, &registry, None, None);
    let spec = |adaptive| SpeculativeConfig {
        adaptive,
        ..SpeculativeConfig::default()
    };
    let on = engine(&m, &backend, &registry, Some(spec(false)), None);
    let adaptive = engine(&m, &backend, &registry, Some(spec(true)), None);

    println!("== batch 1, greedy, copy-heavy chat prompts, 128 new tokens, {threads} threads");
    let copies: Vec<Vec<u32>> = copy_prompts()
        .iter()
        .map(|p| chat(&m, p).expect("chat prompt"))
        .collect();
    let mut rate = [Vec::new(), Vec::new(), Vec::new()];
    let mut accept = [0.0f64; 3];
    let mut same = true;
    for round in 0..rounds {
        for p in &copies {
            let mut outs = Vec::new();
            for (i, e) in [&off, &on, &adaptive].iter().enumerate() {
                let _ = e.flush_cache();
                let (t, d, _, a, o) = run(e, std::slice::from_ref(p), 128);
                rate[i].push(t.saturating_sub(1) as f64 / d.max(1e-9));
                accept[i] += a / (rounds * copies.len()) as f64;
                outs.push(o);
            }
            same &= outs[0] == outs[1] && outs[0] == outs[2];
        }
        eprintln!("round {} done", round + 1);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let names = ["plain", "ngram", "ngram adaptive"];
    for i in 0..3 {
        println!(
            "{:>15}: decode {:.1} tok/s (mean of {} runs), mean accept length {:.2}, {:.2}x plain",
            names[i],
            mean(&rate[i]),
            rate[i].len(),
            accept[i],
            mean(&rate[i]) / mean(&rate[0])
        );
    }
    println!("outputs identical: {same}");

    let free: Vec<Vec<u32>> = sharegpt(16)
        .iter()
        .map(|p| chat(&m, p).expect("chat prompt"))
        .collect();
    if free.len() < 16 {
        return;
    }
    println!("== 16 concurrent free-form prompts (ShareGPT), 64 new tokens");
    let mut out_rate = [Vec::new(), Vec::new()];
    let mut same = true;
    for _ in 0..rounds {
        let mut outs = Vec::new();
        for (i, e) in [&off, &adaptive].iter().enumerate() {
            let _ = e.flush_cache();
            let (t, _, wall, _, o) = run(e, &free, 64);
            out_rate[i].push(t as f64 / wall);
            outs.push(o);
        }
        same &= outs[0] == outs[1];
    }
    let st = adaptive.stats();
    println!(
        "plain {:.1} output tok/s; ngram adaptive {:.1} ({:.2}x); adaptive skipped {} of {} proposed draft tokens; outputs identical: {same}",
        mean(&out_rate[0]),
        mean(&out_rate[1]),
        mean(&out_rate[1]) / mean(&out_rate[0]),
        st.spec_draft_tokens_skipped_total,
        st.spec_draft_tokens_skipped_total + st.spec_draft_tokens_total
    );
}
