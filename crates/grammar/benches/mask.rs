//! Grammar benchmark over MaskBench: compile time, time to the first mask,
//! per-token mask time (p50/p99), and the share of output tokens that
//! jump-forward would emit without a forward, for SmolLM2's tokenizer (49k)
//! and a Qwen3 one (151k) when present.
//!
//! `cargo bench -p arbor-grammar --bench mask` (all 9,010 schemas; set
//! `ARBOR_MASKBENCH_STEP=10` for every 10th). Single thread, one matcher at a time.
#![allow(clippy::unwrap_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use arbor_engine_core::grammar::{
    GrammarBackend, GrammarMatcher, GrammarOptions, GrammarSpec, JsonWhitespace, TokenBitmask,
};
use common::{Tok, maskbench, percentile, qwen, smollm2};
use std::time::Instant;

/// Simulates decoding `tokens` with jump-forward: at each step the forced
/// tokens are taken when the instance continues with them. Returns
/// (tokens, forced tokens) or `None` when the instance leaves the grammar.
fn jump_forward(m: &mut dyn GrammarMatcher, tokens: &[u32]) -> Option<(usize, usize)> {
    let (mut i, mut forced) = (0, 0);
    while i < tokens.len() {
        let f = m.forced_tokens().ok()?;
        if !f.is_empty() && tokens[i..].starts_with(&f) {
            m.accept_tokens(&f).ok()?;
            i += f.len();
            forced += f.len();
            continue;
        }
        m.accept(tokens[i]).ok()?;
        i += 1;
    }
    Some((tokens.len(), forced))
}

fn bench(tok: &Tok, step: usize) {
    let Some(entries) = maskbench(step) else {
        return;
    };
    let t0 = Instant::now();
    let backend = tok.backend(&GrammarOptions::default());
    let build = t0.elapsed().as_secs_f64();
    let compact = tok.backend(&GrammarOptions {
        json_whitespace: JsonWhitespace::Compact,
        ..Default::default()
    });
    let n = backend.vocab_size();
    let mut mask = TokenBitmask::new(n);
    let (mut compile, mut first, mut masks) = (Vec::new(), Vec::new(), Vec::new());
    let (mut compiled, mut total_tokens, mut forced_flex, mut forced_compact) = (0, 0, 0, 0);
    let (mut jf_tokens_flex, mut jf_tokens_compact) = (0, 0);
    for e in &entries {
        let spec = GrammarSpec::JsonSchema(e.schema.clone());
        let t0 = Instant::now();
        let Ok(c) = backend.compile(&spec) else {
            continue;
        };
        compile.push(t0.elapsed().as_secs_f64());
        compiled += 1;
        let cc = compact.compile(&spec).ok();
        let mut first_done = false;
        for (valid, text) in &e.tests {
            if !valid {
                continue;
            }
            let tokens = tok.encode(text);
            let mut m = c.matcher().unwrap();
            for (i, &t) in tokens.iter().enumerate() {
                let t0 = Instant::now();
                if m.fill_mask(&mut mask).is_err() {
                    break;
                }
                let dt = t0.elapsed().as_secs_f64();
                if i == 0 && !first_done {
                    first.push(dt);
                    first_done = true;
                } else {
                    masks.push(dt);
                }
                if m.accept(t).is_err() {
                    break;
                }
            }
            total_tokens += tokens.len();
            if let Some((t, f)) = jump_forward(c.matcher().unwrap().as_mut(), &tokens) {
                jf_tokens_flex += t;
                forced_flex += f;
            }
            if let Some(cc) = &cc
                && let Some((t, f)) = jump_forward(cc.matcher().unwrap().as_mut(), &tokens)
            {
                jf_tokens_compact += t;
                forced_compact += f;
            }
        }
    }
    let us = |v: &mut Vec<f64>, p| percentile(v, p) * 1e6;
    let ms = |v: &mut Vec<f64>, p| percentile(v, p) * 1e3;
    println!(
        "| {} | {} | {:.0} ms | {}/{} | {:.2} / {:.2} ms | {:.0} / {:.0} µs | {:.1} / {:.1} µs ({} masks) | {:.1}% / {:.1}% |",
        tok.name,
        n,
        build * 1e3,
        compiled,
        entries.len(),
        ms(&mut compile, 0.5),
        ms(&mut compile, 0.99),
        us(&mut first, 0.5),
        us(&mut first, 0.99),
        us(&mut masks, 0.5),
        us(&mut masks, 0.99),
        masks.len(),
        100.0 * forced_flex as f64 / jf_tokens_flex.max(1) as f64,
        100.0 * forced_compact as f64 / jf_tokens_compact.max(1) as f64,
    );
    let _ = total_tokens;
}

/// llama.cpp's `json.gbnf` (as SGLang users pass it in `ebnf`).
const JSON_GBNF: &str = r#"
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-7]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
"#;

/// Mask times of one grammar over the valid maskbench instances it accepts.
fn bench_spec(tok: &Tok, label: &str, spec: &GrammarSpec, texts: &[String]) {
    let backend = tok.backend(&GrammarOptions::default());
    let t0 = Instant::now();
    let c = backend.compile(spec).unwrap();
    let compile = t0.elapsed().as_secs_f64();
    let (mut times, mut accepted) = (Vec::new(), 0);
    for text in texts {
        let (w, t) = common::walk(&c, backend.vocab_size(), &tok.encode(text), tok.eos[0]);
        if w == common::Walk::Accepted {
            accepted += 1;
            times.extend(t);
        }
    }
    println!(
        "| {} | {label} | {:.2} ms | {accepted}/{} | {:.1} / {:.1} µs ({} masks) |",
        tok.name,
        compile * 1e3,
        texts.len(),
        percentile(&mut times, 0.5) * 1e6,
        percentile(&mut times, 0.99) * 1e6,
        times.len()
    );
}

fn main() {
    // `cargo bench` passes `--bench`; a plain `cargo test --benches` run passes nothing and
    // should stay short.
    let full = std::env::args().any(|a| a == "--bench");
    let step = std::env::var("ARBOR_MASKBENCH_STEP")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if full { 1 } else { 300 });
    println!(
        "| tokenizer | vocab | backend build | compiled | compile p50 / p99 | first mask p50 / p99 | mask p50 / p99 | forced tokens (flexible ws / compact) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let toks: Vec<Tok> = [smollm2(), qwen()].into_iter().flatten().collect();
    for tok in &toks {
        bench(tok, step);
    }
    // Other grammar kinds on JSON text: the first valid instance of every 20th schema.
    let texts: Vec<String> = maskbench(20)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|e| e.tests.into_iter().find(|t| t.0).map(|t| t.1))
        .take(if full { 400 } else { 20 })
        .collect();
    println!();
    println!("| tokenizer | grammar | compile | accepted | mask p50 / p99 |");
    println!("|---|---|---|---|---|");
    for tok in &toks {
        bench_spec(tok, "json_object", &GrammarSpec::JsonObject, &texts);
        bench_spec(
            tok,
            "ebnf (json.gbnf)",
            &GrammarSpec::Ebnf(JSON_GBNF.into()),
            &texts,
        );
    }
}
