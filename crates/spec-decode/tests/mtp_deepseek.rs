//! The MTP / NEXTN draft head of a DeepSeek-V3 checkpoint against the
//! reference of `tools/reference/make_deepseek_mtp_fixture.py`
//! (tests/fixtures/tiny-deepseek-v3-mtp: tiny-deepseek-v3 plus a next-n
//! layer 3 that is a whole DeepSeek-V3 decoder layer — latent attention,
//! routed experts with the bias-corrected router, a shared expert — run by
//! transformers' own `DeepseekV3DecoderLayer` in float64):
//!
//! - the head's prefill (both prompts in one batch, ids shifted by one,
//!   position 0 masked) and three greedy chain steps match the reference's
//!   logits and states within `TOL · max(1, max|x|)` and choose its tokens,
//!   on the reference's target states and end to end on Arbor's own;
//! - its KV cache is one latent layer (one head of `qk_rope_head_dim +
//!   kv_lora_rank`);
//! - the registered `nextn` speculator proposes the reference's chain;
//! - a missing tensor of the MTP layer is refused with its name.
#![allow(clippy::unwrap_used)]

#[path = "support/heads.rs"]
mod heads;

use arbor_engine_core::speculative::SpeculativeConfig;
use arbor_engine_core::{DType, Registry};
use arbor_spec_decode::{DraftHead, MtpHead};
use heads::{
    Keys, R, check_runs, head_dir, ints, propose_on_reference, reference_chain, rows, run_head,
    shared, speculator_inputs, target_states,
};
use std::path::Path;

const TARGET: &str = "tiny-deepseek-v3-mtp";
const HEAD: &str = TARGET;
const KEYS: Keys = Keys {
    state: "state",
    tokens: "token_ids",
    token: "token_id",
};

fn load_head(dir: &Path) -> arbor_engine_core::Result<MtpHead> {
    let s = shared();
    MtpHead::load(dir, s.target.model.spec(), s.backend.clone())
}

#[test]
fn deepseek_prefill_and_chain_match_the_reference() -> R {
    let s = shared();
    let head = load_head(&head_dir())?;
    let spec = s.target.model.spec();
    assert_eq!(spec.num_layers, 3);
    assert_eq!(head.layer(), 3);
    assert_eq!(head.target_layers(), vec![spec.num_layers]);
    // One latent layer: k_pe (8) and c_kv (32) in one shared head.
    let kv = head.kv_spec(16, 4, DType::F32);
    assert_eq!((kv.num_layers, kv.num_kv_heads, kv.head_dim), (1, 1, 40));
    let seqs = s.reference["sequences"].as_array().unwrap();
    let (mut ids, mut ref_states, mut own_states) = (Vec::new(), Vec::new(), Vec::new());
    for seq in seqs {
        let prompt = ints(&seq["prompt_ids"]);
        let n = prompt.len() - 1;
        let mut want = rows(&seq["target_hidden"]);
        want.truncate(n);
        let mut own = target_states(&[spec.num_layers], &prompt)?;
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
        "max abs errors: reference states: logits {el:.2e}, state {es:.2e}; Arbor's: logits {el2:.2e}, state {es2:.2e}"
    );
    Ok(())
}

#[test]
fn deepseek_nextn_drafter_proposes_the_reference_chain() -> R {
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
fn a_missing_tensor_of_the_deepseek_mtp_layer_is_named() -> R {
    let dir = heads::edited_copy(
        true,
        "model-mtp.safetensors",
        |_| {},
        Some("model.layers.3.self_attn.kv_b_proj.weight"),
    )?;
    let err = load_head(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("model.layers.3.self_attn.kv_b_proj.weight") && err.contains("missing"),
        "{err}"
    );
    Ok(())
}
