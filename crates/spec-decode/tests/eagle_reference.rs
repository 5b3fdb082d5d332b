//! The EAGLE (EAGLE-1 / EAGLE-2 layout) draft head against the independent
//! float64 PyTorch reference of `tools/reference/make_eagle_fixture.py`
//! (tests/fixtures/eagle-tiny-llama):
//!
//! - the target states Arbor computes for tiny-llama (`hidden_layers` =
//!   `[num_layers]`, the final normed state) match the reference's, which
//!   are transformers' `output_hidden_states[-1]`;
//! - the head's prefill (both prompts in one batch, ids shifted by one) and
//!   three greedy chain steps (each feeding the previous output state and
//!   token) through a KV cache of the head's `kv_spec`, with the target's
//!   embedding and LM head, match the reference's logits and states within
//!   `TOL · max(1, max|x|)` and choose exactly its tokens; once on the
//!   reference's states, once end to end on Arbor's own;
//! - the registered `eagle` speculator proposes the reference chain (and
//!   without a head folder is refused, naming `draft_model_path`);
//! - the target's embedding is used even when the head carries a copy;
//! - a head whose config or tensors do not fit, or a target that exposes no
//!   LM head (or no embedding, for a head without one), is refused with
//!   errors that name the key or tensor.
#![allow(clippy::unwrap_used)]

#[path = "support/heads.rs"]
mod heads;

use arbor_engine_core::speculative::SpeculativeConfig;
use arbor_engine_core::{
    DType, ForwardBatch, ForwardContext, ForwardOutput, Model, ModelSpec, Registry,
};
use arbor_spec_decode::{DraftHead, EagleHead};
use heads::{
    Keys, PAGE, R, TOL, check_runs, compare, fixtures, head_dir, ints, propose_on_reference,
    reference_chain, rows, run_head, shared, speculator_inputs, target_states,
};
use serde_json::Value;
use std::path::Path;

/// The target (`tests/fixtures/tiny-llama`) and the head (with its reference).
const TARGET: &str = "tiny-llama";
const HEAD: &str = "eagle-tiny-llama";
/// The reference's names for the head's outputs.
const KEYS: Keys = Keys {
    state: "state",
    tokens: "token_ids",
    token: "token_id",
};

fn load_head(dir: &Path) -> arbor_engine_core::Result<EagleHead> {
    let s = shared();
    EagleHead::load(dir, &*s.target.model, s.backend.clone())
}

#[test]
fn prefill_and_chain_match_the_reference() -> R {
    let s = shared();
    let reference = &s.reference;
    let head = load_head(&head_dir())?;
    let layer = head.target_layer();
    assert_eq!(layer, s.target.model.spec().num_layers);
    assert_eq!(layer as u64, reference["target_layer"].as_u64().unwrap());
    assert_eq!(DraftHead::target_layers(&head), vec![layer]);
    assert_eq!(DraftHead::feature_width(&head), 64);
    assert_eq!(DraftHead::name(&head), "eagle");
    assert_eq!(head.kv_spec(PAGE, 8, DType::F32).num_layers, 1);
    assert_eq!(head.target_id(499)?, 499);
    assert!(head.target_id(500).is_err());

    let seqs = reference["sequences"].as_array().unwrap();
    let (mut ids, mut ref_states, mut own_states) = (Vec::new(), Vec::new(), Vec::new());
    let mut state_err = 0f32;
    for (i, seq) in seqs.iter().enumerate() {
        let pf = &seq["prefill"];
        let prompt = ints(&seq["prompt_ids"]);
        let want = rows(&pf["target_states"]);
        let n = want.len();
        assert_eq!(n + 1, prompt.len());
        assert_eq!(ints(&pf["input_ids"]), prompt[1..].to_vec());
        let mut own = target_states(&[layer], &prompt)?;
        own.truncate(n);
        state_err = state_err.max(compare(&format!("seq {i} target states"), &own, &want));
        ids.push(ints(&pf["input_ids"]));
        ref_states.push(want);
        own_states.push(own);
    }
    assert_eq!(ids.iter().map(Vec::len).collect::<Vec<_>>(), [4, 23]);
    let runs = run_head(&head, &ids, &ref_states, 3)?;
    let (el, es) = check_runs("reference states", &KEYS, &runs, seqs);
    let runs = run_head(&head, &ids, &own_states, 3)?;
    let (el2, es2) = check_runs("Arbor states", &KEYS, &runs, seqs);
    eprintln!(
        "max abs errors: target states {state_err:.2e}; \
         on the reference's states: logits {el:.2e}, state {es:.2e}; \
         end to end on Arbor's states: logits {el2:.2e}, state {es2:.2e} (tolerance {TOL:e} x max(1, max|x|))"
    );
    Ok(())
}

/// A copy of the head folder with its config and tensors edited.
fn edited_head(
    edit_config: impl Fn(&mut Value),
    drop_tensor: Option<&str>,
) -> R<tempfile::TempDir> {
    heads::edited_copy(false, "model.safetensors", edit_config, drop_tensor)
}

/// A target that exposes neither its embedding nor its LM head.
struct Opaque(ModelSpec);

impl Model for Opaque {
    fn spec(&self) -> &ModelSpec {
        &self.0
    }
    fn forward(
        &self,
        _batch: &ForwardBatch,
        _ctx: &ForwardContext<'_>,
    ) -> arbor_engine_core::Result<ForwardOutput> {
        Err(arbor_engine_core::CoreError::invalid("not run"))
    }
}

#[test]
fn heads_that_do_not_fit_are_refused() -> R {
    let s = shared();
    let err_of = |dir: &Path| load_head(dir).unwrap_err().to_string();
    // Not an EAGLE-1 config (an EAGLE3 head, say).
    let dir = edited_head(
        |c| c["architectures"] = serde_json::json!(["LlamaForCausalLMEagle3"]),
        None,
    )?;
    let err = err_of(dir.path());
    assert!(
        err.contains("'architectures'") && err.contains("LlamaForCausalLMEagle'"),
        "{err}"
    );
    assert!(load_head(&fixtures().join("eagle3-tiny-llama")).is_err());
    // Hidden size 32 against tiny-llama's 64.
    let dir = edited_head(|c| c["hidden_size"] = 32.into(), None)?;
    let err = err_of(dir.path());
    assert!(
        err.contains("'hidden_size'") && err.contains("64") && err.contains("32"),
        "{err}"
    );
    let dir = edited_head(|c| c["vocab_size"] = 400.into(), None)?;
    let err = err_of(dir.path());
    assert!(err.contains("'vocab_size'") && err.contains("500"), "{err}");
    // Missing tensors are named.
    for name in [
        "fc.weight",
        "fc.bias",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.post_attention_layernorm.weight",
        "layers.0.mlp.down_proj.weight",
    ] {
        let dir = edited_head(|_| {}, Some(name))?;
        let err = err_of(dir.path());
        assert!(
            err.contains(&format!("'{name}'")) && err.contains("missing"),
            "{err}"
        );
    }
    // A pytorch_model.bin that is not a torch.save archive (safetensors bytes).
    let dir = edited_head(|_| {}, None)?;
    std::fs::rename(
        dir.path().join("model.safetensors"),
        dir.path().join("pytorch_model.bin"),
    )?;
    let err = err_of(dir.path());
    assert!(
        err.contains("pytorch_model.bin") && err.contains("not a torch.save zip archive"),
        "{err}"
    );
    // `bias: false` reads no fc.bias (so a head without one loads).
    let dir = edited_head(|c| c["bias"] = false.into(), Some("fc.bias"))?;
    let head = load_head(dir.path())?;
    assert!(!head.config().fc_bias);
    // A second layer needs its input norm (and its weights).
    let dir = edited_head(|c| c["num_hidden_layers"] = 2.into(), None)?;
    let err = err_of(dir.path());
    assert!(err.contains("'layers.1.input_layernorm.weight'"), "{err}");
    // Head geometry that its tensors do not have.
    let dir = edited_head(|c| c["num_key_value_heads"] = 4.into(), None)?;
    let err = err_of(dir.path());
    assert!(
        err.contains("k_proj.weight") && err.contains("[64, 64]"),
        "{err}"
    );
    let dir = edited_head(|c| c["attention_bias"] = true.into(), None)?;
    assert!(err_of(dir.path()).contains("'attention_bias'"));
    // A target that exposes no embedding (the head has none) or no LM head.
    let opaque = Opaque(s.target.model.spec().clone());
    let err = EagleHead::load(&head_dir(), &opaque, s.backend.clone())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("embed_tokens.weight") && err.contains("exposes none"),
        "{err}"
    );
    // A head with its own `embed_tokens.weight`: without a target embedding
    // it is used, but the head still needs the target's LM head; with one,
    // the target's wins (EAGLE's load_emb, SGLang's set_embed_and_head), so
    // even a zeroed copy gives the reference logits.
    let bytes = std::fs::read(head_dir().join("model.safetensors"))?;
    let orig = safetensors::SafeTensors::deserialize(&bytes)?;
    let zeros = vec![0u8; 500 * 64 * 4];
    let mut st: Vec<(String, safetensors::tensor::TensorView<'_>)> = orig.tensors();
    st.push((
        "embed_tokens.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![500, 64], &zeros)?,
    ));
    let dir = edited_head(|_| {}, None)?;
    std::fs::write(
        dir.path().join("model.safetensors"),
        safetensors::serialize(st, None)?,
    )?;
    let err = EagleHead::load(dir.path(), &opaque, s.backend.clone())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("LM head") && err.contains("exposes none"),
        "{err}"
    );
    let with_copy = load_head(dir.path())?;
    let plain = load_head(&head_dir())?;
    let seqs = s.reference["sequences"].as_array().unwrap();
    let ids = vec![ints(&seqs[0]["prefill"]["input_ids"])];
    let states = vec![rows(&seqs[0]["prefill"]["target_states"])];
    let a = run_head(&with_copy, &ids, &states, 1)?;
    let b = run_head(&plain, &ids, &states, 1)?;
    assert_eq!(a[0].prefill_logits, b[0].prefill_logits);
    assert_eq!(a[0].chain_logits, b[0].chain_logits);
    Ok(())
}

/// The registered `eagle` speculator, fed the target's final states of each
/// reference prompt (all but its last position, whose next token is the
/// prompt's last), proposes the reference's chain: the prefill's last token,
/// then the three chain steps' (positions and state passing).
#[test]
fn eagle_drafter_proposes_the_reference_chain() -> R {
    let s = shared();
    let registry = Registry::builtin()?;
    let mut inputs = speculator_inputs(None)?;
    let cfg = SpeculativeConfig {
        algorithm: "eagle".into(),
        num_steps: 4,
        ..SpeculativeConfig::default()
    };
    let create = registry.speculators.get("eagle")?;
    let err = create(&cfg, &inputs).err().ok_or("no error")?.to_string();
    assert!(err.contains("draft_model_path is needed by EAGLE"), "{err}");
    // The head as safetensors, and as its original checkpoints ship
    // (pytorch_model.bin written by torch.save: tests/fixtures/eagle-tiny-llama-bin).
    for dir in [head_dir(), fixtures().join("eagle-tiny-llama-bin")] {
        inputs.draft_path = Some(dir.clone());
        let mut drafter = create(&cfg, &inputs)?;
        assert_eq!(drafter.name(), "eagle");
        assert_eq!(drafter.hidden_layers(), [s.target.model.spec().num_layers]);
        let drafts = propose_on_reference(&mut *drafter, 4, false)?;
        for (seq, d) in heads::sequences().iter().zip(&drafts) {
            assert_eq!(
                d.tokens,
                reference_chain(&KEYS, seq)?,
                "EAGLE chain from {dir:?}"
            );
            assert!(d.parents.is_none());
        }
    }
    Ok(())
}
