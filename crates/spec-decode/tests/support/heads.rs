//! Shared pieces of the draft-head reference tests (`eagle3_reference`,
//! `eagle_reference`, `mtp_reference`; included with `#[path]`): the target
//! and the head's `reference.json` loaded once per test binary on a
//! 2-thread CPU backend, the JSON readers, the target's hidden states
//! through `ForwardBatch::hidden_layers`, a head's batched prefill and greedy
//! chain steps through a KV cache of its `kv_spec` (any [`DraftHead`]), the
//! comparison of those runs with the reference, edited copies of a
//! checkpoint folder, and a registered drafter fed the reference prompts.
//!
//! The including test names its fixture folders (under `tests/fixtures`)
//! with `const TARGET: &str` (the target model) and `const HEAD: &str` (the
//! head and its `reference.json`) at its crate root.
#![allow(dead_code)]

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::runner::{KvGeometry, ModelRunner};
use arbor_engine_core::speculative::{ComputedStates, SpeculatorInputs};
use arbor_engine_core::{
    AttentionBackend, Backend, BatchLayout, DType, Draft, DraftRequest, DraftSampling,
    ForwardBatch, ForwardContext, KvCache, LoadOptions, Registry, SamplingParams, Speculator,
    Tensor,
};
use arbor_models::{LoadedModel, load_model};
use arbor_spec_decode::DraftHead;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

pub type R<T = ()> = Result<T, Box<dyn std::error::Error>>;
/// Logits rows and state rows of one forward.
type Rows2 = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Allowed error, relative to `max(1, max|reference|)` of the compared row set.
pub const TOL: f32 = 1e-4;
pub const PAGE: usize = 16;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The head's folder (`tests/fixtures/{HEAD}`).
pub fn head_dir() -> PathBuf {
    fixtures().join(crate::HEAD)
}

pub struct Shared {
    pub target: LoadedModel,
    pub backend: Arc<dyn Backend>,
    pub reference: Value,
}

/// The target (`tests/fixtures/{TARGET}`) and the head's `reference.json`.
pub fn shared() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| {
        let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2).expect("cpu"));
        let target = load_on(&backend, crate::TARGET).expect(crate::TARGET);
        let text = std::fs::read_to_string(head_dir().join("reference.json")).expect("reference");
        Shared {
            target,
            backend,
            reference: serde_json::from_str(&text).expect("json"),
        }
    })
}

/// The fixture `name` (under `tests/fixtures`) in f32 on `backend`.
pub fn load_on(backend: &Arc<dyn Backend>, name: &str) -> R<LoadedModel> {
    let registry = Registry::builtin()?;
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("f32")?(&Default::default())?,
        progress: None,
    };
    Ok(load_model(&fixtures().join(name), &registry, &opts)?)
}

/// The reference's `sequences`.
pub fn sequences() -> &'static [Value] {
    shared().reference["sequences"].as_array().unwrap()
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

pub fn rows(v: &Value) -> Vec<Vec<f32>> {
    v.as_array().unwrap().iter().map(floats).collect()
}

pub fn ints(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Max |got - want| and the tolerance `TOL · max(1, max|want|)` over row sets.
pub fn compare(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
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

pub fn split_rows(flat: &[f32], width: usize) -> Vec<Vec<f32>> {
    flat.chunks_exact(width).map(<[f32]>::to_vec).collect()
}

/// A runner over the shared target (pages of `PAGE`, 8 pages, f32 KV).
pub fn target_runner() -> R<ModelRunner> {
    runner_of(&shared().target)
}

/// A runner over `target` (pages of `PAGE`, 8 pages, f32 KV; one recurrent
/// state slot for a hybrid model).
pub fn runner_of(target: &LoadedModel) -> R<ModelRunner> {
    Ok(ModelRunner::with_state_slots(
        target.model.clone(),
        shared().backend.clone(),
        None,
        KvGeometry {
            page_size: PAGE,
            num_pages: 8,
            kv_dtype: DType::F32,
            state_slots: 1,
        },
    )?)
}

/// Arbor's target hidden states of `layers` (`hidden_layers` indices) for
/// `prompt` at every position: `[n, layers.len() * hidden]`, the layers
/// concatenated in order.
pub fn target_states(layers: &[usize], prompt: &[u32]) -> R<Vec<Vec<f32>>> {
    states_of(&shared().target, layers, prompt)
}

/// [`target_states`] of `target`.
pub fn states_of(target: &LoadedModel, layers: &[usize], prompt: &[u32]) -> R<Vec<Vec<f32>>> {
    let s = shared();
    let runner = runner_of(target)?;
    let n = prompt.len();
    let mut layout = BatchLayout::new(PAGE);
    layout.push_seq(0, n, &[0, 1, 2, 3])?;
    if target.model.spec().state.is_some() {
        layout.state_slots.push(0);
    }
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
    let h = target.model.spec().hidden_size;
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

/// What the head produced for one sequence (tokens are target ids).
#[derive(Default)]
pub struct SeqRun {
    pub prefill_logits: Vec<Vec<f32>>,
    pub prefill_state: Vec<Vec<f32>>,
    pub prefill_tokens: Vec<u32>,
    pub chain_inputs: Vec<u32>,
    pub chain_logits: Vec<Vec<f32>>,
    pub chain_state: Vec<Vec<f32>>,
    pub chain_tokens: Vec<u32>,
}

/// The prefill of every sequence in one batch (ids `ids[s]`, target states
/// or features `states[s]` at positions `0..`), then `steps` greedy chain
/// steps batched over the sequences, each feeding the previous output state
/// and the previous token's target id.
pub fn run_head(
    head: &dyn DraftHead,
    ids: &[Vec<u32>],
    states: &[Vec<Vec<f32>>],
    steps: usize,
) -> R<Vec<SeqRun>> {
    let b = &shared().backend;
    let h = head.hidden_size();
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
            split_rows(&b.download_f32(&out.logits)?, out.logits.row_len()),
            split_rows(&b.download_f32(&out.state)?, h),
        ))
    };

    // Prefill: the target's states (or features, which the head fuses).
    let mut layout = BatchLayout::new(PAGE);
    let (mut all_ids, mut all_pos, mut all_states) = (Vec::new(), Vec::new(), Vec::new());
    for (s, seq_ids) in ids.iter().enumerate() {
        layout.push_seq(0, seq_ids.len(), &pages[s])?;
        all_ids.extend_from_slice(seq_ids);
        all_pos.extend(0..seq_ids.len() as u32);
        all_states.extend(states[s].iter().flatten().copied());
    }
    let t = all_ids.len();
    let width = all_states.len() / t;
    let hidden = b.upload_f32(&[t, width], &all_states)?;
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

    // Chain: the previous output state (width h) and the previous token.
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

/// The reference JSON's names for a head's outputs.
pub struct Keys {
    /// The output state's rows, in `prefill` and each `chain` step.
    pub state: &'static str,
    /// The prefill's chosen tokens.
    pub tokens: &'static str,
    /// A chain step's chosen token.
    pub token: &'static str,
}

/// Compares runs with the reference; returns the max abs errors (logits, state).
pub fn check_runs(what: &str, keys: &Keys, runs: &[SeqRun], seqs: &[Value]) -> (f32, f32) {
    let st = keys.state;
    let (mut el, mut es) = (0f32, 0f32);
    for (i, (r, s)) in runs.iter().zip(seqs).enumerate() {
        let pf = &s["prefill"];
        el = el.max(compare(
            &format!("{what} seq {i} prefill logits"),
            &r.prefill_logits,
            &rows(&pf["logits"]),
        ));
        es = es.max(compare(
            &format!("{what} seq {i} prefill {st}"),
            &r.prefill_state,
            &rows(&pf[st]),
        ));
        assert_eq!(
            r.prefill_tokens,
            ints(&pf[keys.tokens]),
            "{what} seq {i} prefill tokens"
        );
        let chain = s["chain"].as_array().unwrap();
        let want_logits: Vec<Vec<f32>> = chain.iter().map(|c| floats(&c["logits"])).collect();
        let want_state: Vec<Vec<f32>> = chain.iter().map(|c| floats(&c[st])).collect();
        let want_inputs: Vec<u32> = chain
            .iter()
            .map(|c| c["input_id"].as_u64().unwrap() as u32)
            .collect();
        let want_tokens: Vec<u32> = chain
            .iter()
            .map(|c| c[keys.token].as_u64().unwrap() as u32)
            .collect();
        assert_eq!(r.chain_inputs, want_inputs, "{what} seq {i} chain inputs");
        assert_eq!(r.chain_tokens, want_tokens, "{what} seq {i} chain tokens");
        el = el.max(compare(
            &format!("{what} seq {i} chain logits"),
            &r.chain_logits,
            &want_logits,
        ));
        es = es.max(compare(
            &format!("{what} seq {i} chain {st}"),
            &r.chain_state,
            &want_state,
        ));
    }
    (el, es)
}

/// The reference's chain for `seq`: the prefill's last token, then each
/// chain step's.
pub fn reference_chain(keys: &Keys, seq: &Value) -> R<Vec<u32>> {
    let mut want = vec![*ints(&seq["prefill"][keys.tokens]).last().ok_or("ids")?];
    for c in seq["chain"].as_array().ok_or("chain")? {
        want.push(c[keys.token].as_u64().ok_or(keys.token)? as u32);
    }
    Ok(want)
}

/// A copy of the head's folder (every file when `all_files`, else only
/// `config.json` and `weights`) with its config edited and `drop_tensor`
/// removed from `weights`.
pub fn edited_copy(
    all_files: bool,
    weights: &str,
    edit_config: impl Fn(&mut Value),
    drop_tensor: Option<&str>,
) -> R<tempfile::TempDir> {
    let src = head_dir();
    let dir = tempfile::tempdir()?;
    if all_files {
        for entry in std::fs::read_dir(&src)? {
            let entry = entry?;
            std::fs::copy(entry.path(), dir.path().join(entry.file_name()))?;
        }
    }
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json"))?)?;
    edit_config(&mut cfg);
    std::fs::write(dir.path().join("config.json"), serde_json::to_string(&cfg)?)?;
    let bytes = std::fs::read(src.join(weights))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let keep: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| Some(n.as_str()) != drop_tensor)
        .collect();
    std::fs::write(
        dir.path().join(weights),
        safetensors::serialize(keep, None)?,
    )?;
    Ok(dir)
}

/// What a registered speculator is built over: a runner of the shared
/// target and `draft_path`.
pub fn speculator_inputs(draft_path: Option<PathBuf>) -> R<SpeculatorInputs> {
    Ok(SpeculatorInputs {
        target: Arc::new(target_runner()?),
        target_group: None,
        draft_model: None,
        draft_path,
    })
}

/// Feeds `drafter` the target's states (its `hidden_layers`) of each
/// reference prompt, all but its last position (whose next token is the
/// prompt's last), each sequence in its own pages, all in one call; then
/// drafts up to `max_tokens` for every sequence in one call.
pub fn propose_on_reference(
    drafter: &mut dyn Speculator,
    max_tokens: usize,
    allow_tree: bool,
) -> R<Vec<Draft>> {
    propose_sampled_on_reference(drafter, max_tokens, allow_tree, None)
}

/// [`propose_on_reference`] for requests sampled under `sampling`
/// (parameters and seed) when it is set.
pub fn propose_sampled_on_reference(
    drafter: &mut dyn Speculator,
    max_tokens: usize,
    allow_tree: bool,
    sampling: Option<(&SamplingParams, u64)>,
) -> R<Vec<Draft>> {
    let layers: Vec<usize> = drafter.hidden_layers().to_vec();
    let seqs = shared().reference["sequences"]
        .as_array()
        .ok_or("sequences")?;
    let pages: Vec<Vec<u32>> = (0..seqs.len() as u32)
        .map(|i| vec![4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3])
        .collect();
    let mut prompts = Vec::new();
    let mut states = Vec::new();
    for seq in seqs {
        let prompt = ints(&seq["prompt_ids"]);
        let f = target_states(&layers, &prompt)?;
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
            max_tokens,
            allow_tree,
            pages: &pages[i],
            sampling: sampling.map(|(params, seed)| DraftSampling {
                params,
                seed: seed + i as u64,
            }),
        })
        .collect();
    Ok(drafter.propose(&reqs))
}
