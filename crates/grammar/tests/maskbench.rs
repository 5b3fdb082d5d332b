//! MaskBench (`../shared/data/maskbench/maskbench.jsonl.gz`): for every schema
//! that compiles, each valid instance (compact JSON) must pass token by token
//! (every token in its mask and accepted, EOS allowed at the end) and each
//! invalid one must be rejected somewhere.
//!
//! `maskbench_sample` runs every 30th schema (300) in the normal test run,
//! with SmolLM2's tokenizer when the default GGUF is present, else the small
//! BPE built in code. The full set is `#[ignore]`d (minutes):
//! `cargo test -p arbor-grammar --release --test maskbench -- --ignored --nocapture`.
//! The kinds of remaining false rejections are listed in `KNOWN_MISMATCHES`.
#![allow(clippy::unwrap_used)]

mod common;

use common::{Tok, Walk, maskbench, qwen, run_maskbench, small_bpe, smollm2};

/// Upper bound on false rejections other than key order in the 300-schema
/// sample (the full run prints every case). Kinds seen on the full set
/// (strict: 20 of 10,050 valid instances; none is a token-level problem):
/// - key order: llguidance emits object properties in the schema's order, so
///   an instance listing keys in another order is refused at the first
///   out-of-order key (11-13; counted, not listed);
/// - numbers: `2.0` under `multipleOf: 0.25`, `6000.0` under `multipleOf: 1`,
///   `1e-6` under `minimum: 0`: llguidance's bounded-number grammars do not
///   take these spellings (4);
/// - `$ref` with sibling keywords: draft-07 ignores keywords next to `$ref`,
///   llguidance applies them (`required` or `type` beside `$ref`) (1-2);
/// - lexer budget: a `pattern` with bounded repetition intersected with a
///   large `maxLength` needs more than `step_lexer_fuel` (~20 ms) in one mask
///   and the matcher stops with "too many expressions constructed" (2).
const MAX_SAMPLE_FALSE_REJECTIONS: usize = 3;

/// Runs maskbench; strict runs must have no false acceptances (lenient ones
/// ignore constraints by design, so they are only counted).
fn check(tok: &Tok, step: usize, lenient: bool, max_false_rejections: usize) -> Option<usize> {
    let entries = maskbench(step)?;
    let mut rep = run_maskbench(tok, &entries, lenient);
    rep.print(&format!(
        "{}{}",
        tok.name,
        if lenient { ", lenient" } else { "" }
    ));
    assert!(
        rep.compiled as f64 >= 0.8 * rep.schemas as f64,
        "coverage fell: {} of {}",
        rep.compiled,
        rep.schemas
    );
    // A token outside its mask that `accept` takes, or an EOS problem, would
    // be a bug of ours (mask copying, vocabulary adapter), not a schema corner case.
    for (s, i, w, _) in &rep.false_rejections {
        assert!(
            !matches!(
                w,
                Walk::NotInMask {
                    accept_ok: true,
                    ..
                } | Walk::CannotEnd
            ),
            "{s} #{i}: {w:?}"
        );
    }
    assert!(
        rep.false_rejections.len() <= max_false_rejections,
        "{} false rejections",
        rep.false_rejections.len()
    );
    if !lenient {
        assert!(
            rep.false_acceptances.is_empty(),
            "{} false acceptances",
            rep.false_acceptances.len()
        );
    }
    Some(rep.compiled)
}

#[test]
fn maskbench_sample() {
    let tok = smollm2().unwrap_or_else(small_bpe);
    let strict = check(&tok, 30, false, MAX_SAMPLE_FALSE_REJECTIONS);
    let lenient = check(&tok, 30, true, MAX_SAMPLE_FALSE_REJECTIONS);
    assert!(lenient >= strict);
}

#[test]
#[ignore = "full maskbench: minutes; run with --release --ignored --nocapture"]
fn maskbench_full_smollm2() {
    if let Some(tok) = smollm2() {
        check(&tok, 1, false, usize::MAX);
        check(&tok, 1, true, usize::MAX);
    }
}

#[test]
#[ignore = "full maskbench: minutes; run with --release --ignored --nocapture"]
fn maskbench_full_qwen() {
    if let Some(tok) = qwen() {
        check(&tok, 1, false, usize::MAX);
        check(&tok, 1, true, usize::MAX);
    }
}
