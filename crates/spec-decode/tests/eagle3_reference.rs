//! The EAGLE3 draft head against the independent float64 PyTorch reference
//! of `tools/reference/make_eagle3_fixture.py` (tests/fixtures/eagle3-tiny-llama):
//!
//! - the target features Arbor computes for tiny-llama (`hidden_layers` =
//!   the head's aux layers) match the reference's, which come from
//!   transformers' decoder-layer outputs;
//! - `fuse` matches the reference's `fc(features)`;
//! - the head's prefill (both prompts in one batch, ids shifted by one) and
//!   three greedy chain steps (each feeding the previous `aux` and the
//!   previous draft token mapped to its target id) through a KV cache of
//!   the head's `kv_spec` match the reference's logits and aux within
//!   `TOL · max(1, max|x|)`, and choose exactly its tokens; once on the
//!   reference's features, once end to end on Arbor's own;
//! - a head without `embed_tokens.weight` runs on the target's embedding;
//! - a hidden size that does not fit the target, a missing `d2t`, a wrong
//!   `draft_vocab_size` and aux layers outside the target are refused with
//!   errors that name the key or tensor.
#![allow(clippy::unwrap_used)]

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{
    AttentionBackend, Backend, BatchLayout, DType, ForwardBatch, ForwardContext, KvCache,
    LoadOptions, Registry, Tensor, WeightSource,
};
use arbor_models::safetensors_source::SafetensorsSource;
use arbor_models::{LoadedModel, load_model};
use arbor_spec_decode::Eagle3Head;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

type R<T = ()> = Result<T, Box<dyn std::error::Error>>;
/// Logits rows and aux rows of one forward.
type Rows2 = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Allowed error, relative to `max(1, max|reference|)` of the compared row set.
const TOL: f32 = 1e-4;
const PAGE: usize = 16;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn head_dir() -> PathBuf {
    fixtures().join("eagle3-tiny-llama")
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

fn load_head(dir: &Path, embed: Option<Tensor>) -> arbor_engine_core::Result<Eagle3Head> {
    let s = shared();
    Eagle3Head::load(dir, s.target.model.spec(), embed, s.backend.clone())
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

/// Arbor's target features `[n, 3 * hidden]` of `prompt` at every position.
fn target_features(layers: [usize; 3], prompt: &[u32]) -> R<Vec<Vec<f32>>> {
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
        hidden_layers: layers.to_vec(),
        lora: Vec::new(),
        exit_after: None,
        hidden_at_every_row: false,
    })?;
    let h = s.target.model.spec().hidden_size;
    let per_layer: Vec<Vec<f32>> = out
        .hidden
        .iter()
        .map(|t| s.backend.download_f32(t))
        .collect::<Result<_, _>>()?;
    Ok((0..n)
        .map(|r| {
            per_layer
                .iter()
                .flat_map(|l| l[r * h..(r + 1) * h].iter().copied())
                .collect()
        })
        .collect())
}

/// What the head produced for one sequence.
#[derive(Default)]
struct SeqRun {
    prefill_logits: Vec<Vec<f32>>,
    prefill_aux: Vec<Vec<f32>>,
    prefill_targets: Vec<u32>,
    chain_inputs: Vec<u32>,
    chain_logits: Vec<Vec<f32>>,
    chain_aux: Vec<Vec<f32>>,
    chain_targets: Vec<u32>,
}

/// The prefill of every sequence in one batch (draft ids `ids[s]`,
/// features `feats[s]` at positions `0..`), then `steps` greedy chain steps
/// batched over the sequences.
fn run_head(
    head: &Eagle3Head,
    ids: &[Vec<u32>],
    feats: &[Vec<Vec<f32>>],
    steps: usize,
) -> R<Vec<SeqRun>> {
    let b = &shared().backend;
    let (h, dv) = (head.hidden_size(), head.draft_vocab_size());
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
            split_rows(&b.download_f32(&out.logits)?, dv),
            split_rows(&b.download_f32(&out.aux)?, h),
        ))
    };

    // Prefill: target features of width 3h, fused inside the forward.
    let mut layout = BatchLayout::new(PAGE);
    let (mut all_ids, mut all_pos, mut all_feats) = (Vec::new(), Vec::new(), Vec::new());
    for (s, seq_ids) in ids.iter().enumerate() {
        layout.push_seq(0, seq_ids.len(), &pages[s])?;
        all_ids.extend_from_slice(seq_ids);
        all_pos.extend(0..seq_ids.len() as u32);
        all_feats.extend(feats[s].iter().flatten().copied());
    }
    let t = all_ids.len();
    let width = all_feats.len() / t;
    let features = b.upload_f32(&[t, width], &all_feats)?;
    let (logits, aux) = forward(layout, all_ids, all_pos, (0..t as u32).collect(), &features)?;
    let mut runs: Vec<SeqRun> = Vec::new();
    let mut start = 0;
    let mut last_aux = Vec::new();
    let mut last_tok = Vec::new();
    for seq_ids in ids {
        let n = seq_ids.len();
        let mut r = SeqRun {
            prefill_logits: logits[start..start + n].to_vec(),
            prefill_aux: aux[start..start + n].to_vec(),
            ..SeqRun::default()
        };
        for row in &r.prefill_logits {
            r.prefill_targets.push(head.target_id(argmax(row))?);
        }
        last_aux.extend_from_slice(&aux[start + n - 1]);
        last_tok.push(*r.prefill_targets.last().unwrap());
        runs.push(r);
        start += n;
    }

    // Chain: the previous aux as the hidden (width h: no fc), the previous
    // draft token's target id as the input.
    for step in 0..steps {
        let mut layout = BatchLayout::new(PAGE);
        let mut positions = Vec::new();
        for (s, seq_ids) in ids.iter().enumerate() {
            let pos = seq_ids.len() + step;
            layout.push_seq(pos, 1, &pages[s])?;
            positions.push(pos as u32);
        }
        let n = ids.len();
        let hidden = b.upload_f32(&[n, h], &last_aux)?;
        let inputs = last_tok.clone();
        let (logits, aux) = forward(
            layout,
            inputs.clone(),
            positions,
            (0..n as u32).collect(),
            &hidden,
        )?;
        last_aux = aux.iter().flatten().copied().collect();
        last_tok.clear();
        for (s, r) in runs.iter_mut().enumerate() {
            let tok = head.target_id(argmax(&logits[s]))?;
            r.chain_inputs.push(inputs[s]);
            r.chain_logits.push(logits[s].clone());
            r.chain_aux.push(aux[s].clone());
            r.chain_targets.push(tok);
            last_tok.push(tok);
        }
    }
    Ok(runs)
}

/// Compares runs with the reference; returns the max abs errors (logits, aux).
fn check_runs(what: &str, runs: &[SeqRun], seqs: &[Value]) -> (f32, f32) {
    let (mut el, mut ea) = (0f32, 0f32);
    for (i, (r, s)) in runs.iter().zip(seqs).enumerate() {
        let pf = &s["prefill"];
        el = el.max(compare(
            &format!("{what} seq {i} prefill logits"),
            &r.prefill_logits,
            &rows(&pf["logits"]),
        ));
        ea = ea.max(compare(
            &format!("{what} seq {i} prefill aux"),
            &r.prefill_aux,
            &rows(&pf["aux"]),
        ));
        assert_eq!(
            r.prefill_targets,
            ints(&pf["target_ids"]),
            "{what} seq {i} prefill tokens"
        );
        let chain = s["chain"].as_array().unwrap();
        let want_logits: Vec<Vec<f32>> = chain.iter().map(|c| floats(&c["logits"])).collect();
        let want_aux: Vec<Vec<f32>> = chain.iter().map(|c| floats(&c["aux"])).collect();
        let want_inputs: Vec<u32> = chain
            .iter()
            .map(|c| c["input_id"].as_u64().unwrap() as u32)
            .collect();
        let want_targets: Vec<u32> = chain
            .iter()
            .map(|c| c["target_id"].as_u64().unwrap() as u32)
            .collect();
        assert_eq!(r.chain_inputs, want_inputs, "{what} seq {i} chain inputs");
        assert_eq!(r.chain_targets, want_targets, "{what} seq {i} chain tokens");
        el = el.max(compare(
            &format!("{what} seq {i} chain logits"),
            &r.chain_logits,
            &want_logits,
        ));
        ea = ea.max(compare(
            &format!("{what} seq {i} chain aux"),
            &r.chain_aux,
            &want_aux,
        ));
    }
    (el, ea)
}

#[test]
fn prefill_and_chain_match_the_reference() -> R {
    let s = shared();
    let reference = &s.reference;
    let head = load_head(&head_dir(), None)?;
    let layers = head.aux_layers();
    assert_eq!(
        layers.to_vec(),
        ints(&reference["aux_layer_ids"])
            .iter()
            .map(|&l| l as usize)
            .collect::<Vec<_>>()
    );
    assert_eq!(head.draft_vocab_size(), 128);
    let hot = ints(&reference["hot_ids"]);
    for (d, &t) in hot.iter().enumerate() {
        assert_eq!(head.target_id(d as u32)?, t);
    }
    assert!(head.target_id(hot.len() as u32).is_err());

    let seqs = reference["sequences"].as_array().unwrap();
    let (mut ids, mut ref_feats, mut own_feats) = (Vec::new(), Vec::new(), Vec::new());
    let (mut feat_err, mut fuse_err) = (0f32, 0f32);
    for (i, seq) in seqs.iter().enumerate() {
        let pf = &seq["prefill"];
        let prompt = ints(&seq["prompt_ids"]);
        let want = rows(&pf["features"]);
        let n = want.len();
        assert_eq!(ints(&pf["input_ids"]), prompt[1..].to_vec());
        let mut own = target_features(layers, &prompt)?;
        own.truncate(n);
        feat_err = feat_err.max(compare(&format!("seq {i} target features"), &own, &want));
        // fc alone.
        let flat: Vec<f32> = want.iter().flatten().copied().collect();
        let fused = head.fuse(&s.backend.upload_f32(&[n, want[0].len()], &flat)?)?;
        let fused = split_rows(&s.backend.download_f32(&fused)?, head.hidden_size());
        fuse_err = fuse_err.max(compare(
            &format!("seq {i} fuse"),
            &fused,
            &rows(&pf["fused"]),
        ));
        ids.push(ints(&pf["input_ids"]));
        ref_feats.push(want);
        own_feats.push(own);
    }
    let runs = run_head(&head, &ids, &ref_feats, 3)?;
    let (el, ea) = check_runs("reference features", &runs, seqs);
    let runs = run_head(&head, &ids, &own_feats, 3)?;
    let (el2, ea2) = check_runs("Arbor features", &runs, seqs);
    eprintln!(
        "max abs errors: target features {feat_err:.2e}, fuse {fuse_err:.2e}; \
         on the reference's features: logits {el:.2e}, aux {ea:.2e}; \
         end to end on Arbor's features: logits {el2:.2e}, aux {ea2:.2e} (tolerance {TOL:e} x max(1, max|x|))"
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

#[test]
fn a_head_without_embeddings_uses_the_targets() -> R {
    let s = shared();
    let dir = edited_head(|_| {}, Some("embed_tokens.weight"))?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("embed_tokens.weight") && err.contains("missing"),
        "{err}"
    );
    let wrong = s.backend.alloc(DType::F32, &[500, 32])?;
    let err = load_head(dir.path(), Some(wrong)).unwrap_err().to_string();
    assert!(err.contains("[500, 64]"), "{err}");
    let src = SafetensorsSource::open(&fixtures().join("tiny-llama"))?;
    let embed = src.tensor("model.embed_tokens.weight")?.unwrap();
    let head = load_head(dir.path(), Some(s.backend.upload(&embed)?))?;
    let own = load_head(&head_dir(), None)?;
    let seqs = s.reference["sequences"].as_array().unwrap();
    let ids = vec![ints(&seqs[0]["prefill"]["input_ids"])];
    let feats = vec![rows(&seqs[0]["prefill"]["features"])];
    let a = run_head(&head, &ids, &feats, 1)?;
    let b = run_head(&own, &ids, &feats, 1)?;
    assert_eq!(a[0].prefill_logits, b[0].prefill_logits);
    assert_eq!(a[0].chain_logits, b[0].chain_logits);
    Ok(())
}

#[test]
fn heads_that_do_not_fit_are_refused() -> R {
    // Hidden size 32 against tiny-llama's 64 (without target_hidden_size,
    // which then defaults to hidden_size).
    let dir = edited_head(
        |c| {
            c["hidden_size"] = 32.into();
            c.as_object_mut().unwrap().remove("target_hidden_size");
        },
        None,
    )?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("'hidden_size'") && err.contains("64") && err.contains("32"),
        "{err}"
    );
    // With target_hidden_size 64 the head itself may be narrower, but then
    // its tensors must be, and it cannot borrow the target's embedding.
    let dir = edited_head(|c| c["hidden_size"] = 32.into(), None)?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("embed_tokens.weight") && err.contains("[500, 32]"),
        "{err}"
    );
    let dir = edited_head(
        |c| c["hidden_size"] = 32.into(),
        Some("embed_tokens.weight"),
    )?;
    let embed = shared().backend.alloc(DType::F32, &[500, 64])?;
    let err = load_head(dir.path(), Some(embed)).unwrap_err().to_string();
    assert!(
        err.contains("'hidden_size'") && err.contains("embedding"),
        "{err}"
    );
    let dir = edited_head(|c| c["target_hidden_size"] = 48.into(), None)?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(err.contains("'target_hidden_size'"), "{err}");
    // No d2t with a draft vocabulary smaller than the target's.
    let dir = edited_head(|_| {}, Some("d2t"))?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(err.contains("'d2t'") && err.contains("missing"), "{err}");
    // draft_vocab_size that the tensors do not have.
    let dir = edited_head(|c| c["draft_vocab_size"] = 100.into(), None)?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("lm_head.weight") && err.contains("[100, 64]"),
        "{err}"
    );
    let dir = edited_head(|c| c["draft_vocab_size"] = 600.into(), None)?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(err.contains("'draft_vocab_size'"), "{err}");
    // Aux layers outside the 3-layer target, and no default for 3 layers.
    let dir = edited_head(
        |c| c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([0, 1, 3]),
        None,
    )?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("eagle_aux_hidden_state_layer_ids") && err.contains("layer 3"),
        "{err}"
    );
    let dir = edited_head(
        |c| {
            c.as_object_mut().unwrap().remove("eagle_config");
        },
        None,
    )?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("eagle_aux_hidden_state_layer_ids") && err.contains("default"),
        "{err}"
    );
    // Head geometry that its tensors do not have.
    let dir = edited_head(|c| c["num_key_value_heads"] = 4.into(), None)?;
    let err = load_head(dir.path(), None).unwrap_err().to_string();
    assert!(
        err.contains("k_proj.weight") && err.contains("[64, 128]"),
        "{err}"
    );
    Ok(())
}

/// The registered `eagle3` speculator, fed the target's states of each
/// reference prompt (all but its last position, whose next token is the
/// prompt's last), proposes the reference's chain: the prefill's last token,
/// then the three chain steps' (positions, state passing and d2t wiring).
#[test]
fn eagle3_drafter_proposes_the_reference_chain() -> R {
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
    let inputs = SpeculatorInputs {
        target: Arc::new(runner),
        draft_model: None,
        draft_path: Some(head_dir()),
    };
    let cfg = SpeculativeConfig {
        algorithm: "eagle3".into(),
        num_steps: 4,
        ..SpeculativeConfig::default()
    };
    let mut drafter = registry.speculators.get("eagle3")?(&cfg, &inputs)?;
    let layers: Vec<usize> = drafter.hidden_layers().to_vec();
    assert_eq!(layers.len(), 3);
    let seqs = s.reference["sequences"].as_array().ok_or("sequences")?;
    // Each sequence in its own pages; all extended in one call, drafted in one.
    let pages: Vec<Vec<u32>> = (0..seqs.len() as u32)
        .map(|i| vec![4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3])
        .collect();
    let mut prompts = Vec::new();
    let mut states = Vec::new();
    for seq in seqs {
        let prompt = ints(&seq["prompt_ids"]);
        let f = target_features([layers[0], layers[1], layers[2]], &prompt)?;
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
        let mut want = vec![*ints(&seq["prefill"]["target_ids"]).last().ok_or("ids")?];
        for c in seq["chain"].as_array().ok_or("chain")? {
            want.push(c["target_id"].as_u64().ok_or("target_id")? as u32);
        }
        assert_eq!(d.tokens, want, "EAGLE3 chain");
        assert!(d.parents.is_none());
    }
    Ok(())
}

/// With `eagle_topk` 3 the `eagle3` speculator drafts a valid tree whose
/// greedy path starts with the reference chain: the best first-level node is
/// the prefill's token, and its best child is the first chain step's.
#[test]
fn eagle3_drafter_grows_a_tree_along_the_reference_chain() -> R {
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
    let inputs = SpeculatorInputs {
        target: Arc::new(runner),
        draft_model: None,
        draft_path: Some(head_dir()),
    };
    let cfg = SpeculativeConfig {
        algorithm: "eagle3".into(),
        num_steps: 3,
        num_draft_tokens: 10,
        eagle_topk: 3,
        ..SpeculativeConfig::default()
    };
    let mut drafter = registry.speculators.get("eagle3")?(&cfg, &inputs)?;
    let layers: Vec<usize> = drafter.hidden_layers().to_vec();
    let seqs = s.reference["sequences"].as_array().ok_or("sequences")?;
    let pages: Vec<Vec<u32>> = (0..seqs.len() as u32)
        .map(|i| vec![4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3])
        .collect();
    let mut prompts = Vec::new();
    let mut states = Vec::new();
    for seq in seqs {
        let prompt = ints(&seq["prompt_ids"]);
        let f = target_features([layers[0], layers[1], layers[2]], &prompt)?;
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
            max_tokens: 10,
            allow_tree: true,
            pages: &pages[i],
            sampling: None,
        })
        .collect();
    let drafts = drafter.propose(&reqs);
    for (seq, d) in seqs.iter().zip(&drafts) {
        d.validate()?;
        let parents = d.parents.as_ref().ok_or("a tree")?;
        assert!(d.len() <= 10 && d.len() > 3, "{d:?}");
        // Three first-level nodes (the top 3 of the kept logits).
        assert_eq!(parents.iter().filter(|p| p.is_none()).count(), 3, "{d:?}");
        let chain = d.first_chain();
        let first = *ints(&seq["prefill"]["target_ids"]).last().ok_or("ids")?;
        let second = seq["chain"][0]["target_id"].as_u64().ok_or("target_id")? as u32;
        assert_eq!(chain[..2], [first, second], "{d:?}");
    }
    Ok(())
}
