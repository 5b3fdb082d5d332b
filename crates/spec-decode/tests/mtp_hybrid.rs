//! The MTP / NEXTN draft head of hybrid checkpoints against the reference
//! of `tools/reference/make_hybrid_mtp_fixture.py`:
//! tests/fixtures/tiny-qwen3.5-mtp (a Qwen3.5 ConditionalGeneration
//! checkpoint, `mtp_num_hidden_layers` in `text_config`, a dense MTP layer)
//! and tests/fixtures/tiny-qwen3-next-mtp (routed experts and a gated shared
//! expert), each run by transformers' one-layer text model in float64 inside
//! SGLang's `Qwen3_5ForCausalLMMTP` formula:
//!
//! - the head's prefill (both prompts in one batch, ids shifted by one, no
//!   position-0 masking) and three greedy chain steps match the reference's
//!   logits and states within `TOL · max(1, max|x|)` and choose its tokens,
//!   on the reference's target states and end to end on Arbor's own (the
//!   hybrid forward's captured final normed state);
//! - its KV cache is one attention layer of the target's geometry;
//! - the registered `nextn` speculator proposes the reference's chain;
//! - a missing MTP tensor and an absent `mtp_num_hidden_layers` are refused
//!   by name.
#![allow(clippy::unwrap_used)]

#[path = "support/heads.rs"]
mod heads;

use arbor_engine_core::speculative::SpeculativeConfig;
use arbor_engine_core::{DType, Registry};
use arbor_models::LoadedModel;
use arbor_spec_decode::{DraftHead, MtpHead};
use heads::{
    Keys, R, check_runs, fixtures, head_dir, ints, load_on, propose_on_reference, reference_chain,
    rows, run_head, shared, speculator_inputs, states_of,
};
use serde_json::Value;
use std::path::Path;

const TARGET: &str = "tiny-qwen3.5-mtp";
const HEAD: &str = TARGET;
const KEYS: Keys = Keys {
    state: "state",
    tokens: "token_ids",
    token: "token_id",
};

fn load_head(dir: &Path, target: &LoadedModel) -> arbor_engine_core::Result<MtpHead> {
    MtpHead::load(dir, target.model.spec(), shared().backend.clone())
}

/// The head of fixture `name` against its reference.
fn prefill_and_chain_match(name: &str, target: &LoadedModel) -> R {
    let dir = fixtures().join(name);
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
    let head = load_head(&dir, target)?;
    let spec = target.model.spec();
    assert!(spec.state.is_some(), "{name} is a hybrid target");
    assert_eq!(head.layer(), 0);
    assert_eq!(head.target_layers(), vec![spec.num_layers]);
    let kv = head.kv_spec(16, 4, DType::F32);
    assert_eq!(
        (kv.num_layers, kv.num_kv_heads, kv.head_dim),
        (1, spec.num_kv_heads, spec.head_dim)
    );
    let seqs = reference["sequences"].as_array().unwrap();
    let (mut ids, mut ref_states, mut own_states) = (Vec::new(), Vec::new(), Vec::new());
    for seq in seqs {
        let prompt = ints(&seq["prompt_ids"]);
        let n = prompt.len() - 1;
        let mut want = rows(&seq["target_hidden"]);
        want.truncate(n);
        let mut own = states_of(target, &[spec.num_layers], &prompt)?;
        own.truncate(n);
        ids.push(ints(&seq["prefill"]["input_ids"]));
        ref_states.push(want);
        own_states.push(own);
    }
    let runs = run_head(&head, &ids, &ref_states, 3)?;
    let (el, es) = check_runs("reference states", &KEYS, &runs, seqs);
    let runs = run_head(&head, &ids, &own_states, 3)?;
    let (el2, es2) = check_runs("Arbor states", &KEYS, &runs, seqs);
    eprintln!(
        "{name}: max abs errors: reference states: logits {el:.2e}, state {es:.2e}; \
         Arbor's: logits {el2:.2e}, state {es2:.2e}"
    );
    Ok(())
}

#[test]
fn qwen3_5_prefill_and_chain_match_the_reference() -> R {
    prefill_and_chain_match(TARGET, &shared().target)
}

#[test]
fn qwen3_next_moe_prefill_and_chain_match_the_reference() -> R {
    let name = "tiny-qwen3-next-mtp";
    let target = load_on(&shared().backend, name)?;
    prefill_and_chain_match(name, &target)
}

#[test]
fn hybrid_nextn_drafter_proposes_the_reference_chain() -> R {
    let s = shared();
    let registry = Registry::builtin()?;
    let cfg = SpeculativeConfig {
        algorithm: "nextn".into(),
        num_steps: 4,
        ..SpeculativeConfig::default()
    };
    let mut inputs = speculator_inputs(None)?;
    inputs.draft_path = Some(head_dir());
    let mut drafter = registry.speculators.get("nextn")?(&cfg, &inputs)?;
    assert_eq!(drafter.hidden_layers(), [s.target.model.spec().num_layers]);
    let drafts = propose_on_reference(&mut *drafter, 4, false)?;
    for (seq, d) in heads::sequences().iter().zip(&drafts) {
        assert_eq!(d.tokens, reference_chain(&KEYS, seq)?, "NEXTN chain");
    }
    Ok(())
}

#[test]
fn a_missing_mtp_tensor_or_key_is_named() -> R {
    let target = &shared().target;
    let tensor = "mtp.layers.0.self_attn.q_norm.weight";
    let dir = heads::edited_copy(true, "model-mtp.safetensors", |_| {}, Some(tensor))?;
    let err = load_head(dir.path(), target).unwrap_err().to_string();
    assert!(err.contains(tensor) && err.contains("missing"), "{err}");
    let dir = heads::edited_copy(true, "model-mtp.safetensors", |_| {}, Some("mtp.fc.weight"))?;
    let err = load_head(dir.path(), target).unwrap_err().to_string();
    assert!(
        err.contains("mtp.fc.weight") && err.contains("missing"),
        "{err}"
    );
    let dir = heads::edited_copy(
        true,
        "model-mtp.safetensors",
        |c| {
            c["text_config"]
                .as_object_mut()
                .unwrap()
                .remove("mtp_num_hidden_layers");
        },
        None,
    )?;
    let err = load_head(dir.path(), target).unwrap_err().to_string();
    assert!(
        err.contains("mtp_num_hidden_layers") && err.contains("absent"),
        "{err}"
    );
    Ok(())
}
