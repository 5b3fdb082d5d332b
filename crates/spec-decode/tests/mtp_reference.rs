//! The MTP / NEXTN draft head against the independent float64 PyTorch
//! reference of `tools/reference/make_mtp_fixture.py`
//! (tests/fixtures/tiny-llama-mtp: tiny-llama plus a next-n layer 3):
//!
//! - Arbor loads the target from the folder (ignoring the layer-3 tensors),
//!   and its final normed hidden states (`hidden_layers` = `[num_layers]`)
//!   match transformers';
//! - the head's prefill (both prompts in one batch, ids shifted by one,
//!   positions 0 masked) and three greedy chain steps (each feeding the
//!   previous state and token) through a KV cache of the head's `kv_spec`
//!   match the reference's logits and states within `TOL · max(1,
//!   max|x|)`, and choose exactly its tokens; once on the reference's
//!   target states, once end to end on Arbor's own;
//! - the registered `nextn` speculator proposes the reference's chain;
//! - a checkpoint without `num_nextn_predict_layers` (or with 0), one
//!   missing an MTP tensor, and no draft path are refused with errors that
//!   name the key, tensor or flag.
#![allow(clippy::unwrap_used)]

#[path = "support/heads.rs"]
mod heads;

use arbor_engine_core::Registry;
use arbor_engine_core::speculative::SpeculativeConfig;
use arbor_spec_decode::{DraftHead, MtpHead};
use heads::{
    Keys, R, TOL, check_runs, compare, head_dir, ints, propose_on_reference, reference_chain, rows,
    run_head, shared, speculator_inputs, target_states,
};
use serde_json::Value;
use std::path::Path;

/// The target is the MTP folder itself (its loader must skip layer 3),
/// which also holds the next-n layer and the reference.
const TARGET: &str = "tiny-llama-mtp";
const HEAD: &str = TARGET;
/// The reference's names for the head's outputs.
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
fn target_states_match_the_reference() -> R {
    let s = shared();
    let spec = s.target.model.spec();
    assert_eq!(spec.num_layers, 3);
    let mut err = 0f32;
    for (i, seq) in s.reference["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let prompt = ints(&seq["prompt_ids"]);
        let own = target_states(&[spec.num_layers], &prompt)?;
        err = err.max(compare(
            &format!("seq {i} target final states"),
            &own,
            &rows(&seq["target_hidden"]),
        ));
    }
    eprintln!("max abs error of the target's final normed states: {err:.2e}");
    Ok(())
}

#[test]
fn prefill_and_chain_match_the_reference() -> R {
    let s = shared();
    let reference = &s.reference;
    let head = load_head(&head_dir())?;
    let spec = s.target.model.spec();
    assert_eq!(head.name(), "nextn");
    assert_eq!(
        head.layer(),
        reference["mtp_layer"].as_u64().unwrap() as usize
    );
    assert_eq!(head.target_layers(), vec![spec.num_layers]);
    assert_eq!(head.feature_width(), spec.hidden_size);
    assert_eq!(head.hidden_size(), spec.hidden_size);
    assert_eq!(head.target_id(499)?, 499);
    assert!(head.target_id(500).is_err());

    let seqs = reference["sequences"].as_array().unwrap();
    let (mut ids, mut ref_states, mut own_states) = (Vec::new(), Vec::new(), Vec::new());
    for seq in seqs {
        let pf = &seq["prefill"];
        let prompt = ints(&seq["prompt_ids"]);
        let n = prompt.len() - 1;
        assert_eq!(ints(&pf["input_ids"]), prompt[1..].to_vec());
        let mut want = rows(&seq["target_hidden"]);
        want.truncate(n);
        let mut own = target_states(&[spec.num_layers], &prompt)?;
        own.truncate(n);
        ids.push(ints(&pf["input_ids"]));
        ref_states.push(want);
        own_states.push(own);
    }
    let runs = run_head(&head, &ids, &ref_states, 3)?;
    let (el, es) = check_runs("reference states", &KEYS, &runs, seqs);
    let runs = run_head(&head, &ids, &own_states, 3)?;
    let (el2, es2) = check_runs("Arbor states", &KEYS, &runs, seqs);
    eprintln!(
        "max abs errors: on the reference's target states: logits {el:.2e}, state {es:.2e}; \
         end to end on Arbor's states: logits {el2:.2e}, state {es2:.2e} (tolerance {TOL:e} x max(1, max|x|))"
    );
    Ok(())
}

/// A copy of the MTP folder with its config edited and one tensor of the
/// MTP shard dropped.
fn edited_checkpoint(
    edit_config: impl Fn(&mut Value),
    drop_tensor: Option<&str>,
) -> R<tempfile::TempDir> {
    heads::edited_copy(true, "model-mtp.safetensors", edit_config, drop_tensor)
}

#[test]
fn checkpoints_without_an_mtp_layer_are_refused() -> R {
    // No num_nextn_predict_layers, or 0.
    let dir = edited_checkpoint(
        |c| {
            c.as_object_mut()
                .unwrap()
                .remove("num_nextn_predict_layers");
        },
        None,
    )?;
    let err = load_head(dir.path()).unwrap_err();
    assert!(
        matches!(err, arbor_engine_core::CoreError::Config(_)),
        "{err:?}"
    );
    let err = err.to_string();
    assert!(
        err.contains("'num_nextn_predict_layers'")
            && err.contains("absent")
            && err.contains("config.json"),
        "{err}"
    );
    let dir = edited_checkpoint(|c| c["num_nextn_predict_layers"] = 0.into(), None)?;
    let err = load_head(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("'num_nextn_predict_layers'") && err.contains("is 0"),
        "{err}"
    );
    // A missing MTP tensor.
    let dir = edited_checkpoint(|_| {}, Some("model.layers.3.eh_proj.weight"))?;
    let err = load_head(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("'model.layers.3.eh_proj.weight'") && err.contains("missing"),
        "{err}"
    );
    let dir = edited_checkpoint(|_| {}, Some("model.layers.3.shared_head.norm.weight"))?;
    let err = load_head(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("'model.layers.3.shared_head.norm.weight'") && err.contains("missing"),
        "{err}"
    );
    // A config that is not the target's.
    let dir = edited_checkpoint(|c| c["num_hidden_layers"] = 2.into(), None)?;
    let err = load_head(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("'num_hidden_layers'") && err.contains("target"),
        "{err}"
    );
    Ok(())
}

/// The registered `nextn` speculator, fed the target's final states of each
/// reference prompt (all but its last position, whose next token is the
/// prompt's last), proposes the reference's chain: the prefill's last
/// token, then the three chain steps'.
#[test]
fn nextn_drafter_proposes_the_reference_chain() -> R {
    let s = shared();
    let registry = Registry::builtin()?;
    let cfg = SpeculativeConfig {
        algorithm: "nextn".into(),
        num_steps: 4,
        ..SpeculativeConfig::default()
    };
    let create = registry.speculators.get("nextn")?;
    // No checkpoint folder: the error names the flag.
    let mut inputs = speculator_inputs(None)?;
    let err = create(&cfg, &inputs).err().unwrap().to_string();
    assert!(err.contains("draft_model_path is needed by NEXTN"), "{err}");
    inputs.draft_path = Some(head_dir());
    let mut drafter = create(&cfg, &inputs)?;
    assert_eq!(drafter.name(), "nextn");
    assert_eq!(drafter.hidden_layers(), [s.target.model.spec().num_layers]);
    let drafts = propose_on_reference(&mut *drafter, 4, false)?;
    for (seq, d) in heads::sequences().iter().zip(&drafts) {
        assert_eq!(d.tokens, reference_chain(&KEYS, seq)?, "NEXTN chain");
        assert!(d.parents.is_none());
    }
    Ok(())
}
