//! What the quantized-checkpoint tests share: loading a fixture under a
//! method on the CPU backend, and checking a model's last-position logits
//! and greedy continuations against a fixture's reference.json (within a
//! [`Tolerance`]; W8A8 prompts split by their distance from E4M3 ties),
//! with the KV pool back to empty after every run.

#![allow(dead_code)] // each test binary uses its own part

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::runner::{ModelRunner, SamplingSetup, SeqStep, generate_static};
use arbor_engine_core::sampling::StandardSampler;
use arbor_engine_core::{
    Backend, DType, LoadOptions, Model, PagePool, QuantInit, QuantMatmul, Registry, SamplingParams,
};
use arbor_models::{LoadedModel, load_model};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

pub fn options(
    registry: &Registry,
    backend: &Arc<dyn Backend>,
    quantization: Option<&str>,
) -> Result<LoadOptions> {
    let float = registry.quant_methods.get("f32")?(&Default::default())?;
    let quant = match quantization {
        None => float,
        Some(q) => registry.quant_methods.get(q)?(&QuantInit {
            checkpoint: None,
            base: Some(float),
        })?,
    };
    Ok(LoadOptions {
        backend: backend.clone(),
        quant,
        progress: None,
    })
}

pub fn load(dir: &Path, quantization: Option<&str>) -> Result<(LoadedModel, Arc<dyn Backend>)> {
    load_as(dir, quantization, QuantMatmul::F32)
}

/// [`load`] on a CPU backend multiplying the scaled formats as `matmul` says.
pub fn load_as(
    dir: &Path,
    quantization: Option<&str>,
    matmul: QuantMatmul,
) -> Result<(LoadedModel, Arc<dyn Backend>)> {
    let registry = Registry::builtin()?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2)?.with_quant_matmul(matmul));
    let opts = options(&registry, &backend, quantization)?;
    Ok((load_model(dir, &registry, &opts)?, backend))
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_f64)
                .map(|x| x as f32)
                .collect()
        })
        .unwrap_or_default()
}

/// How close a run must come to its reference: last-position logits
/// within `logits × max|logit|`, and greedy tokens equal up to the first
/// step whose top-2 margin is under `margin`.
#[derive(Clone, Copy)]
pub struct Tolerance {
    pub logits: f32,
    pub margin: f32,
}

/// The f32 products' tolerance (the module documentation's).
pub const EXACT: Tolerance = Tolerance {
    logits: 1e-4,
    margin: 1e-3,
};

/// Logits and greedy tokens of `m` against `reference`.
pub fn check_against(
    name: &str,
    m: &LoadedModel,
    backend: &Arc<dyn Backend>,
    reference: &Value,
) -> Result<()> {
    check_within(name, m, backend, reference, EXACT)
}

/// [`check_against`] within `tol`.
pub fn check_within(
    name: &str,
    m: &LoadedModel,
    backend: &Arc<dyn Backend>,
    reference: &Value,
    tol: Tolerance,
) -> Result<()> {
    let runner = ModelRunner::new(m.model.clone(), backend.clone(), None, 16, 64, DType::F32)?;
    let pool = runner.new_page_pool();
    let prompts = reference["prompts"].as_array().context("prompts")?;
    let inputs = reference_prompts(reference)?;
    let all = runner_last_logits(&runner, &pool, &inputs)?;
    for (i, (p, got)) in prompts.iter().zip(&all).enumerate() {
        let want = floats(&p["last_logits"]);
        let max = want.iter().fold(0f32, |a, b| a.max(b.abs()));
        let err = max_abs_diff(got, &want);
        println!("{name} prompt {i}: max |logit| {max:.3}, max abs error {err:.2e}");
        assert_eq!(got.len(), want.len());
        assert!(
            err <= tol.logits * max,
            "{name} prompt {i}: logits error {err} > {} * {max}",
            tol.logits
        );
    }
    let params = vec![
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(32)
        };
        prompts.len()
    ];
    let setup = SamplingSetup {
        sampler: &StandardSampler,
        processors: &[],
        eos_token_ids: &[],
    };
    let (outs, _) = generate_static(&runner, &pool, &inputs, &params, &setup, &mut |_, _| {})?;
    for (i, (o, p)) in outs.iter().zip(prompts).enumerate() {
        let want = ids(&p["greedy_ids"]);
        let margins = floats(&p["margins"]);
        let sure = margins
            .iter()
            .position(|&m| m < tol.margin)
            .unwrap_or(want.len());
        println!("{name} prompt {i}: greedy tokens compared up to step {sure}");
        assert_eq!(
            o.tokens[..sure],
            want[..sure],
            "{name} prompt {i}: greedy tokens (compared up to step {sure})"
        );
    }
    assert_eq!(
        pool.free_pages(),
        pool.total_pages(),
        "{name}: KV pages leaked"
    );
    Ok(())
}

pub fn check_format(name: &str, stored: DType) -> Result<()> {
    let dir = fixtures().join("quant").join(name);
    let (m, backend) = load(&dir, None).with_context(|| format!("loading {name}"))?;
    assert_eq!(
        m.model.spec().weight_dtype,
        stored,
        "{name}: stored weight dtype"
    );
    let reference: Value = reference_at(&dir.join("reference.json"))?;
    check_against(name, &m, &backend, &reference)
}

/// W8A8 FP8 where an input may round to the other E4M3 neighbour than in the
/// float64 reference: an input within [`NEAR_TIE`] (relative) of a midpoint
/// between two E4M3 values, which f32 rounding of the activations can move
/// across it. One such input moved by one E4M3 step shifts the logits by up
/// to about 1.5% of their scale here.
pub const W8A8_NEAR_TIE: Tolerance = Tolerance {
    logits: 5e-2,
    margin: 0.5,
};

/// Closer to an E4M3 rounding midpoint than this, an input may round either way.
pub const NEAR_TIE: f64 = 1e-6;

pub fn reference_at(path: &Path) -> Result<Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(path)?)?)
}

/// `m` against a W8A8 reference: its prompts clear of E4M3 ties (at least
/// one when `some_far`) within the f32 tolerance, the others within
/// [`W8A8_NEAR_TIE`] (an input that near a midpoint may round the other way
/// in an f32 forward).
pub fn check_by_tie(
    name: &str,
    m: &LoadedModel,
    backend: &Arc<dyn Backend>,
    reference: &Value,
    some_far: bool,
) -> Result<()> {
    let some = |r: &Value| r["prompts"].as_array().is_some_and(|p| !p.is_empty());
    let far = prompts_by_tie(reference, true);
    assert!(
        !some_far || some(&far),
        "{name}: no prompt clear of E4M3 ties"
    );
    if some(&far) {
        check_within(name, m, backend, &far, EXACT)?;
    }
    let near = prompts_by_tie(reference, false);
    if some(&near) {
        check_within(
            &format!("{name} near a tie"),
            m,
            backend,
            &near,
            W8A8_NEAR_TIE,
        )?;
    }
    Ok(())
}

/// `reference` with only the prompts whose `closest_tie` is (`far`) or is
/// not at least [`NEAR_TIE`].
pub fn prompts_by_tie(reference: &Value, far: bool) -> Value {
    let mut r = reference.clone();
    if let Some(ps) = r["prompts"].as_array_mut() {
        ps.retain(|p| (p["closest_tie"].as_f64().unwrap_or(0.0) >= NEAR_TIE) == far);
    }
    r
}

/// Checks that each prompt's last logits in `got` (another product of the
/// same weights, `what`) miss `reference`'s by more than ten times the f32
/// tolerance.
pub fn misses_far(what: &str, got: &[Vec<f32>], reference: &Value) -> Result<()> {
    let prompts = reference["prompts"].as_array().context("prompts")?;
    for (i, (got, p)) in got.iter().zip(prompts).enumerate() {
        let want = floats(&p["last_logits"]);
        let max = want.iter().fold(0f32, |a, b| a.max(b.abs()));
        let err = max_abs_diff(got, &want);
        println!("{what} prompt {i}: {err:.2e} from the reference");
        assert!(err > 10.0 * EXACT.logits * max, "{what} prompt {i}: {err}");
    }
    Ok(())
}

/// A copy of a fixture folder whose config.json and tensors `edit` rewrites.
pub fn edited(
    name: &str,
    edit_config: impl FnOnce(&mut Value),
    edit_tensors: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) -> Result<tempfile::TempDir> {
    let src = fixtures().join("quant").join(name);
    let dir = tempfile::tempdir()?;
    for e in std::fs::read_dir(&src)? {
        let e = e?;
        std::fs::copy(e.path(), dir.path().join(e.file_name()))?;
    }
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json"))?)?;
    edit_config(&mut cfg);
    std::fs::write(dir.path().join("config.json"), serde_json::to_string(&cfg)?)?;
    let bytes = std::fs::read(src.join("model.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit_tensors(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            Ok((
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b)?,
            ))
        })
        .collect::<Result<_>>()?;
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors"))?;
    Ok(dir)
}

pub fn load_error(dir: &Path, quantization: Option<&str>) -> String {
    match load(dir, quantization) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

/// Last-position logits of every reference prompt with a KV cache of `kv`.
pub fn last_logits(
    m: &LoadedModel,
    backend: &Arc<dyn Backend>,
    kv: DType,
    reference: &Value,
) -> Result<Vec<Vec<f32>>> {
    prompts_last_logits(m.model.clone(), backend, kv, &reference_prompts(reference)?)
}

/// The `input_ids` of every prompt of a reference.json.
pub fn reference_prompts(reference: &Value) -> Result<Vec<Vec<u32>>> {
    Ok(reference["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .map(|p| ids(&p["input_ids"]))
        .collect())
}

/// Last-position logits of each of `prompts`, each run whole through
/// `model` with a KV cache of `kv`.
pub fn prompts_last_logits(
    model: Arc<dyn Model>,
    backend: &Arc<dyn Backend>,
    kv: DType,
    prompts: &[Vec<u32>],
) -> Result<Vec<Vec<f32>>> {
    let runner = ModelRunner::new(model, backend.clone(), None, 16, 64, kv)?;
    runner_last_logits(&runner, &runner.new_page_pool(), prompts)
}

/// [`prompts_last_logits`] through `runner` with pages of `pool`; checks
/// that every page is back in the pool after.
pub fn runner_last_logits(
    runner: &ModelRunner,
    pool: &PagePool,
    prompts: &[Vec<u32>],
) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::new();
    for tokens in prompts {
        let pages = pool.alloc(pool.pages_for(tokens.len()))?;
        let mut got = runner.step(&[SeqStep {
            tokens,
            prefix_len: 0,
            pages: pages.pages(),
            want_logits: true,
            state_slot: None,
        }])?;
        out.push(got.swap_remove(0));
    }
    assert_eq!(pool.free_pages(), pool.total_pages(), "KV pages leaked");
    Ok(out)
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}
