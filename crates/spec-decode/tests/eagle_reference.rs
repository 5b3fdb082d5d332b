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
//!   without a head folder is refused, naming `--speculative-draft-model-path`);
//! - the target's embedding is used even when the head carries a copy;
//! - a head whose config or tensors do not fit, or a target that exposes no
//!   LM head (or no embedding, for a head without one), is refused with
//!   errors that name the key or tensor.
#![allow(clippy::unwrap_used)]

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{
    AttentionBackend, Backend, BatchLayout, DType, ForwardBatch, ForwardContext, ForwardOutput,
    KvCache, LoadOptions, Model, ModelSpec, Registry, Tensor,
};
use arbor_models::{LoadedModel, load_model};
use arbor_spec_decode::{DraftHead, EagleHead};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

type R<T = ()> = Result<T, Box<dyn std::error::Error>>;
/// Logits rows and state rows of one forward.
type Rows2 = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Allowed error, relative to `max(1, max|reference|)` of the compared row set.
const TOL: f32 = 1e-4;
const PAGE: usize = 16;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn head_dir() -> PathBuf {
    fixtures().join("eagle-tiny-llama")
}

struct Shared {
    target: LoadedModel,
    backend: Arc<dyn Backend>,
    reference: Value,
}

fn shared() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| {
        let registry = Registry::builtin().expect("registry");
        let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2).expect("cpu"));
        let opts = LoadOptions {
            backend: backend.clone(),
            quant: registry.quant_methods.get("f32").expect("f32")().expect("quant"),
            progress: None,
        };
        let target =
            load_model(&fixtures().join("tiny-llama"), &registry, &opts).expect("tiny-llama");
        let text = std::fs::read_to_string(head_dir().join("reference.json")).expect("reference");
        Shared {
            target,
            backend,
            reference: serde_json::from_str(&text).expect("json"),
        }
    })
}

fn load_head(dir: &Path) -> arbor_engine_core::Result<EagleHead> {
    let s = shared();
    EagleHead::load(dir, &*s.target.model, s.backend.clone())
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn rows(v: &Value) -> Vec<Vec<f32>> {
    v.as_array().unwrap().iter().map(floats).collect()
}

fn ints(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Max |got - want| and the tolerance `TOL · max(1, max|want|)` over row sets.
fn compare(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: row count");
    let scale = want.iter().flatten().fold(1f32, |m, x| m.max(x.abs()));
    let mut err = 0f32;
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len(), "{what}: row width");
        for (a, b) in g.iter().zip(w) {
            err = err.max((a - b).abs());
        }
    }
    assert!(
        err <= TOL * scale,
        "{what}: max abs error {err:e} > {TOL:e} x {scale}"
    );
    err
}

fn split_rows(flat: &[f32], width: usize) -> Vec<Vec<f32>> {
    flat.chunks_exact(width).map(<[f32]>::to_vec).collect()
}

/// Arbor's target hidden states of `layer` `[n, hidden]` for `prompt` at every position.
fn target_states(layer: usize, prompt: &[u32]) -> R<Vec<Vec<f32>>> {
    let s = shared();
    let runner = ModelRunner::new(
        s.target.model.clone(),
        s.backend.clone(),
        None,
        PAGE,
        8,
        DType::F32,
    )?;
    let n = prompt.len();
    let mut layout = BatchLayout::new(PAGE);
    layout.push_seq(0, n, &[0, 1, 2, 3])?;
    let out = runner.forward(&ForwardBatch {
        input_ids: prompt.to_vec(),
        positions: (0..n as u32).collect(),
        layout: Arc::new(layout),
        logits_rows: (0..n as u32).collect(),
        hidden_layers: vec![layer],
        lora: Vec::new(),
        exit_after: None,
        hidden_at_every_row: false,
    })?;
    let h = s.target.model.spec().hidden_size;
    Ok(split_rows(&s.backend.download_f32(&out.hidden[0])?, h))
}

/// What the head produced for one sequence.
#[derive(Default)]
struct SeqRun {
    prefill_logits: Vec<Vec<f32>>,
    prefill_state: Vec<Vec<f32>>,
    prefill_tokens: Vec<u32>,
    chain_inputs: Vec<u32>,
    chain_logits: Vec<Vec<f32>>,
    chain_state: Vec<Vec<f32>>,
    chain_tokens: Vec<u32>,
}

/// The prefill of every sequence in one batch (ids `ids[s]`, target states
/// `states[s]` at positions `0..`), then `steps` greedy chain steps batched
/// over the sequences.
fn run_head(
    head: &EagleHead,
    ids: &[Vec<u32>],
    states: &[Vec<Vec<f32>>],
    steps: usize,
) -> R<Vec<SeqRun>> {
    let b = &shared().backend;
    let (h, vocab) = (head.hidden_size(), head.vocab_size());
    let kv = KvCache::allocate(&**b, head.kv_spec(PAGE, 8, DType::F32))?;
    let attention: Arc<dyn AttentionBackend> = b.attention(None)?;
    let pages: Vec<Vec<u32>> = (0..ids.len() as u32)
        .map(|i| vec![2 * i, 2 * i + 1])
        .collect();
    let forward = |layout: BatchLayout,
                   input_ids: Vec<u32>,
                   positions: Vec<u32>,
                   logits_rows: Vec<u32>,
                   hidden: &Tensor|
     -> R<Rows2> {
        let layout = Arc::new(layout);
        let prepared = attention.prepare(layout.clone())?;
        let ctx = ForwardContext {
            kv: &kv,
            attention: &*attention,
            attention_batch: &prepared,
        };
        let batch = ForwardBatch {
            input_ids,
            positions,
            layout,
            logits_rows,
            hidden_layers: Vec::new(),
            lora: Vec::new(),
            exit_after: None,
            hidden_at_every_row: false,
        };
        let out = head.forward(&batch, hidden, &ctx)?;
        Ok((
            split_rows(&b.download_f32(&out.logits)?, vocab),
            split_rows(&b.download_f32(&out.state)?, h),
        ))
    };

    // Prefill: the target's states.
    let mut layout = BatchLayout::new(PAGE);
    let (mut all_ids, mut all_pos, mut all_states) = (Vec::new(), Vec::new(), Vec::new());
    for (s, seq_ids) in ids.iter().enumerate() {
        layout.push_seq(0, seq_ids.len(), &pages[s])?;
        all_ids.extend_from_slice(seq_ids);
        all_pos.extend(0..seq_ids.len() as u32);
        all_states.extend(states[s].iter().flatten().copied());
    }
    let t = all_ids.len();
    let hidden = b.upload_f32(&[t, h], &all_states)?;
    let (logits, state) = forward(layout, all_ids, all_pos, (0..t as u32).collect(), &hidden)?;
    let mut runs: Vec<SeqRun> = Vec::new();
    let mut start = 0;
    let mut last_state = Vec::new();
    let mut last_tok = Vec::new();
    for seq_ids in ids {
        let n = seq_ids.len();
        let mut r = SeqRun {
            prefill_logits: logits[start..start + n].to_vec(),
            prefill_state: state[start..start + n].to_vec(),
            ..SeqRun::default()
        };
        for row in &r.prefill_logits {
            r.prefill_tokens.push(head.target_id(argmax(row))?);
        }
        last_state.extend_from_slice(&state[start + n - 1]);
        last_tok.push(*r.prefill_tokens.last().unwrap());
        runs.push(r);
        start += n;
    }

    // Chain: the previous output state as h, the previous token as the input.
    for step in 0..steps {
        let mut layout = BatchLayout::new(PAGE);
        let mut positions = Vec::new();
        for (s, seq_ids) in ids.iter().enumerate() {
            let pos = seq_ids.len() + step;
            layout.push_seq(pos, 1, &pages[s])?;
            positions.push(pos as u32);
        }
        let n = ids.len();
        let hidden = b.upload_f32(&[n, h], &last_state)?;
        let inputs = last_tok.clone();
        let (logits, state) = forward(
            layout,
            inputs.clone(),
            positions,
            (0..n as u32).collect(),
            &hidden,
        )?;
        last_state = state.iter().flatten().copied().collect();
        last_tok.clear();
        for (s, r) in runs.iter_mut().enumerate() {
            let tok = head.target_id(argmax(&logits[s]))?;
            r.chain_inputs.push(inputs[s]);
            r.chain_logits.push(logits[s].clone());
            r.chain_state.push(state[s].clone());
            r.chain_tokens.push(tok);
            last_tok.push(tok);
        }
    }
    Ok(runs)
}

/// Compares runs with the reference; returns the max abs errors (logits, state).
fn check_runs(what: &str, runs: &[SeqRun], seqs: &[Value]) -> (f32, f32) {
    let (mut el, mut es) = (0f32, 0f32);
    for (i, (r, s)) in runs.iter().zip(seqs).enumerate() {
        let pf = &s["prefill"];
        el = el.max(compare(
            &format!("{what} seq {i} prefill logits"),
            &r.prefill_logits,
            &rows(&pf["logits"]),
        ));
        es = es.max(compare(
            &format!("{what} seq {i} prefill state"),
            &r.prefill_state,
            &rows(&pf["state"]),
        ));
        assert_eq!(
            r.prefill_tokens,
            ints(&pf["token_ids"]),
            "{what} seq {i} prefill tokens"
        );
        let chain = s["chain"].as_array().unwrap();
        let want_logits: Vec<Vec<f32>> = chain.iter().map(|c| floats(&c["logits"])).collect();
        let want_state: Vec<Vec<f32>> = chain.iter().map(|c| floats(&c["state"])).collect();
        let want_inputs: Vec<u32> = chain
            .iter()
            .map(|c| c["input_id"].as_u64().unwrap() as u32)
            .collect();
        let want_tokens: Vec<u32> = chain
            .iter()
            .map(|c| c["token_id"].as_u64().unwrap() as u32)
            .collect();
        assert_eq!(r.chain_inputs, want_inputs, "{what} seq {i} chain inputs");
        assert_eq!(r.chain_tokens, want_tokens, "{what} seq {i} chain tokens");
        el = el.max(compare(
            &format!("{what} seq {i} chain logits"),
            &r.chain_logits,
            &want_logits,
        ));
        es = es.max(compare(
            &format!("{what} seq {i} chain state"),
            &r.chain_state,
            &want_state,
        ));
    }
    (el, es)
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
        let mut own = target_states(layer, &prompt)?;
        own.truncate(n);
        state_err = state_err.max(compare(&format!("seq {i} target states"), &own, &want));
        ids.push(ints(&pf["input_ids"]));
        ref_states.push(want);
        own_states.push(own);
    }
    assert_eq!(ids.iter().map(Vec::len).collect::<Vec<_>>(), [4, 23]);
    let runs = run_head(&head, &ids, &ref_states, 3)?;
    let (el, es) = check_runs("reference states", &runs, seqs);
    let runs = run_head(&head, &ids, &own_states, 3)?;
    let (el2, es2) = check_runs("Arbor states", &runs, seqs);
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
    let dir = tempfile::tempdir()?;
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(head_dir().join("config.json"))?)?;
    edit_config(&mut cfg);
    std::fs::write(dir.path().join("config.json"), serde_json::to_string(&cfg)?)?;
    let bytes = std::fs::read(head_dir().join("model.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let keep: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| Some(n.as_str()) != drop_tensor)
        .collect();
    std::fs::write(
        dir.path().join("model.safetensors"),
        safetensors::serialize(keep, None)?,
    )?;
    Ok(dir)
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
    // An original checkpoint with only pytorch_model.bin.
    let dir = edited_head(|_| {}, None)?;
    std::fs::rename(
        dir.path().join("model.safetensors"),
        dir.path().join("pytorch_model.bin"),
    )?;
    let err = err_of(dir.path());
    assert!(
        err.contains("pytorch_model.bin") && err.contains("convert"),
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
    use arbor_engine_core::speculative::{ComputedStates, SpeculativeConfig, SpeculatorInputs};
    use arbor_engine_core::{DraftRequest, Registry};
    let s = shared();
    let registry = Registry::builtin()?;
    let runner = ModelRunner::new(
        s.target.model.clone(),
        s.backend.clone(),
        None,
        PAGE,
        8,
        DType::F32,
    )?;
    let mut inputs = SpeculatorInputs {
        target: Arc::new(runner),
        draft_model: None,
        draft_path: None,
    };
    let cfg = SpeculativeConfig {
        algorithm: "eagle".into(),
        num_steps: 4,
        ..SpeculativeConfig::default()
    };
    let create = registry.speculators.get("eagle")?;
    let err = create(&cfg, &inputs).err().ok_or("no error")?.to_string();
    assert!(err.contains("--speculative-draft-model-path"), "{err}");
    inputs.draft_path = Some(head_dir());
    let mut drafter = create(&cfg, &inputs)?;
    assert_eq!(drafter.name(), "eagle");
    let layers: Vec<usize> = drafter.hidden_layers().to_vec();
    assert_eq!(layers, [s.target.model.spec().num_layers]);
    let seqs = s.reference["sequences"].as_array().ok_or("sequences")?;
    // Each sequence in its own pages; all extended in one call, drafted in one.
    let pages: Vec<Vec<u32>> = (0..seqs.len() as u32)
        .map(|i| vec![4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3])
        .collect();
    let mut prompts = Vec::new();
    let mut states = Vec::new();
    for seq in seqs {
        let prompt = ints(&seq["prompt_ids"]);
        let f = target_states(layers[0], &prompt)?;
        states.push(f[..prompt.len() - 1].concat());
        prompts.push(prompt);
    }
    let computed: Vec<ComputedStates<'_>> = (0..seqs.len())
        .map(|i| ComputedStates {
            key: i as u64,
            start: 0,
            next_tokens: &prompts[i][1..],
            pages: &pages[i],
            states: &states[i],
        })
        .collect();
    drafter.observe_states(&computed);
    let reqs: Vec<DraftRequest<'_>> = (0..seqs.len())
        .map(|i| DraftRequest {
            key: i as u64,
            tokens: &prompts[i],
            len: prompts[i].len(),
            max_tokens: 4,
            allow_tree: false,
            pages: &pages[i],
            sampling: None,
        })
        .collect();
    let drafts = drafter.propose(&reqs);
    for (seq, d) in seqs.iter().zip(&drafts) {
        let mut want = vec![*ints(&seq["prefill"]["token_ids"]).last().ok_or("ids")?];
        for c in seq["chain"].as_array().ok_or("chain")? {
            want.push(c["token_id"].as_u64().ok_or("token_id")? as u32);
        }
        assert_eq!(d.tokens, want, "EAGLE chain");
        assert!(d.parents.is_none());
    }
    Ok(())
}
