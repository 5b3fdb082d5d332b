//! Loads a PEFT LoRA folder (`adapter_config.json` +
//! `adapter_model.safetensors`) onto the device for one served model.
//!
//! Tensor names are PEFT's: `base_model.model.model.layers.{i}.{path}.lora_A.weight`
//! `[r, in]` and `...lora_B.weight` `[out, r]` (the `base_model.model.`
//! prefix is optional). Every factor is checked against the served model's
//! shapes, the config's targets and layers, and the limits; `B` is multiplied
//! by the module's scaling once here. Any other tensor is refused, naming it.

use crate::error::{LoraError, Result};
use crate::peft::{PeftConfig, TargetModules};
use arbor_engine_core::{
    Backend, DType, HostTensor, LoraAdapter, LoraLayer, LoraPair, LoraTarget, ModelSpec,
};
use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

/// What an adapter may be, set by the server's flags.
#[derive(Clone, Debug, Default)]
pub struct LoraLimits {
    /// Largest rank (`--max-lora-rank`; `None`: any).
    pub max_rank: Option<usize>,
    /// Modules adapters may target (`--lora-target-modules`; `None`: all seven).
    pub targets: Option<Vec<LoraTarget>>,
}

/// Input and output widths of `target` in a model of `spec`.
pub fn target_shape(spec: &ModelSpec, target: LoraTarget) -> (usize, usize) {
    let q = spec.num_heads * spec.head_dim;
    let kv = spec.num_kv_heads * spec.head_dim;
    let (h, i) = (spec.hidden_size, spec.intermediate_size);
    match target {
        LoraTarget::Q => (h, q),
        LoraTarget::K | LoraTarget::V => (h, kv),
        LoraTarget::O => (q, h),
        LoraTarget::Gate | LoraTarget::Up => (h, i),
        LoraTarget::Down => (i, h),
    }
}

/// Which factor a tensor name holds.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Factor {
    A,
    B,
}

/// `(layer, target, factor)` of a PEFT tensor name.
fn parse_name(name: &str) -> Option<(usize, LoraTarget, Factor)> {
    let rest = name.strip_prefix("base_model.model.").unwrap_or(name);
    let rest = rest.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (path, factor) = if let Some(p) = rest.strip_suffix(".lora_A.weight") {
        (p, Factor::A)
    } else {
        (rest.strip_suffix(".lora_B.weight")?, Factor::B)
    };
    let target = LoraTarget::ALL.into_iter().find(|t| t.path() == path)?;
    Some((layer, target, factor))
}

fn read(name: &str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| LoraError::Io {
        name: name.to_string(),
        path: path.to_path_buf(),
        source,
    })
}

/// A digest of the config and weight bytes (hex, 128 bits).
fn digest(config: &[u8], weights: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update((config.len() as u64).to_le_bytes());
    h.update(config);
    h.update(weights);
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Loads the adapter in `dir` under `name` for a model of `spec` on `backend`.
pub fn load_adapter(
    name: &str,
    dir: &Path,
    spec: &ModelSpec,
    backend: &(dyn Backend + 'static),
    limits: &LoraLimits,
) -> Result<LoraAdapter> {
    load_adapter_on(name, dir, spec, &[backend], limits)
}

/// Whether a target's linear is column-parallel (its output rows are split
/// over tensor-parallel ranks) rather than row-parallel (its input columns).
fn column_parallel(target: LoraTarget) -> bool {
    !matches!(target, LoraTarget::O | LoraTarget::Down)
}

/// One rank's factors of a linear (`a` `[r, inp]`, scaled `b` `[out, r]`
/// of the whole model) as that rank's `LoraPair` on `backend`: rows
/// `[rank·out/w, (rank+1)·out/w)` of `b` for a column-parallel target,
/// columns `[rank·inp/w, (rank+1)·inp/w)` of `a` for a row-parallel one (the
/// slices `arbor_models::shard` gives the linears).
fn rank_pair(
    backend: &(dyn Backend + 'static),
    (a, b): (&[f32], &[f32]),
    (r, inp, out): (usize, usize, usize),
    (rank, world, column): (usize, usize, bool),
) -> arbor_engine_core::Result<LoraPair> {
    let (a, inp): (Vec<f32>, usize) = if column || world == 1 {
        (a.to_vec(), inp)
    } else {
        let w = inp / world;
        let cols = rank * w..(rank + 1) * w;
        (
            a.chunks_exact(inp)
                .flat_map(|row| &row[cols.clone()])
                .copied()
                .collect(),
            w,
        )
    };
    let (b, out): (&[f32], usize) = if column && world > 1 {
        let n = out / world;
        (&b[rank * n * r..(rank + 1) * n * r], n)
    } else {
        (b, out)
    };
    let mut bt = vec![0f32; b.len()];
    for (j, row) in b.chunks_exact(r).enumerate() {
        for (k, v) in row.iter().enumerate() {
            bt[k * out + j] = *v;
        }
    }
    Ok(LoraPair {
        a: backend.upload_f32(&[r, inp], &a)?,
        b: backend.upload_f32(&[out, r], b)?,
        bt: backend.upload_f32(&[r, out], &bt)?,
    })
}

/// Loads the adapter in `dir` under `name` for a model of `spec` (the
/// whole model's shape) split over the ranks of a tensor-parallel group,
/// `backends[r]` rank `r`'s device: each rank gets its slices of the
/// factors ([`LoraAdapter::sharded`]); one backend loads it whole.
pub fn load_adapter_on(
    name: &str,
    dir: &Path,
    spec: &ModelSpec,
    backends: &[&(dyn Backend + 'static)],
    limits: &LoraLimits,
) -> Result<LoraAdapter> {
    if backends.is_empty() {
        return Err(LoraError::Invalid {
            name: name.to_string(),
            msg: "no device to load it on".into(),
        });
    }
    let world = backends.len();
    let invalid = |msg: String| LoraError::Invalid {
        name: name.to_string(),
        msg,
    };
    let config_bytes = read(name, &dir.join("adapter_config.json"))?;
    let config_text = String::from_utf8(config_bytes.clone())
        .map_err(|_| invalid("adapter_config.json is not UTF-8".into()))?;
    let config = PeftConfig::parse(name, &config_text)?;
    let weights_path = dir.join("adapter_model.safetensors");
    let weights = read(name, &weights_path)?;
    let st = SafeTensors::deserialize(&weights)
        .map_err(|e| invalid(format!("{}: {e}", weights_path.display())))?;
    let factors = collect_factors(name, &st, &weights_path, spec, &config)?;
    let mut layers: Vec<Vec<LoraLayer>> = vec![vec![LoraLayer::default(); spec.num_layers]; world];
    let mut max_rank = 0;
    for ((layer, target), [a, b]) in factors {
        let module = format!("model.layers.{layer}.{}", target.path());
        let (Some(a), Some(b)) = (a, b) else {
            return Err(invalid(format!(
                "{module} has only one of lora_A and lora_B"
            )));
        };
        if let Some(allowed) = &limits.targets
            && !allowed.contains(&target)
        {
            return Err(LoraError::Limit {
                name: name.to_string(),
                setting: "lora_target_modules",
                msg: format!(
                    "it targets {}, outside lora_target_modules",
                    target.module()
                ),
            });
        }
        let (r, scaling) = config.rank_and_scaling(&module);
        let (inp, out) = target_shape(spec, target);
        if a.shape != [r, inp] || b.shape != [out, r] {
            return Err(invalid(format!(
                "{module}: lora_A {:?} and lora_B {:?}, expected [{r}, {inp}] and [{out}, {r}] (rank {r} from the config)",
                a.shape, b.shape
            )));
        }
        if let Some(m) = limits.max_rank
            && r > m
        {
            return Err(LoraError::Limit {
                name: name.to_string(),
                setting: "max_lora_rank",
                msg: format!("rank {r} ({module}) is above max_lora_rank {m}"),
            });
        }
        max_rank = max_rank.max(r);
        let host = |t: &HostTensor<'_>| -> Result<Vec<f32>> {
            t.validate(&module)
                .and_then(|()| t.to_f32_vec())
                .map_err(|e| invalid(format!("{module}: {e}")))
        };
        let a_vals = host(&a)?;
        let mut b_vals = host(&b)?;
        if let Some(bad) = a_vals.iter().chain(&b_vals).find(|v| !v.is_finite()) {
            return Err(invalid(format!("{module} holds a non-finite value {bad}")));
        }
        for v in &mut b_vals {
            *v = (*v as f64 * scaling) as f32;
        }
        let device = |e| LoraError::Device {
            name: name.to_string(),
            source: e,
        };
        let column = column_parallel(target);
        let split = if column { out } else { inp };
        if !split.is_multiple_of(world) {
            return Err(invalid(format!(
                "{module}: its {split} {} do not split over {world} tensor-parallel ranks",
                if column { "outputs" } else { "inputs" }
            )));
        }
        for (rank, (backend, rank_layers)) in backends.iter().zip(&mut layers).enumerate() {
            let pair = rank_pair(
                *backend,
                (&a_vals, &b_vals),
                (r, inp, out),
                (rank, world, column),
            )
            .map_err(device)?;
            rank_layers[layer].set(target, pair);
        }
    }
    let d = digest(&config_bytes, &weights);
    let device = |e| LoraError::Device {
        name: name.to_string(),
        source: e,
    };
    let mut adapters = layers
        .into_iter()
        .map(|l| LoraAdapter::new(name, &d, max_rank, l).map_err(device))
        .collect::<Result<Vec<_>>>()?;
    if adapters.len() == 1 {
        return Ok(adapters.remove(0));
    }
    LoraAdapter::sharded(name, &d, adapters).map_err(device)
}

/// A LoRA factor pair's host values by (layer, target): `[lora_A, lora_B]`.
type Factors<'a> = BTreeMap<(usize, LoraTarget), [Option<HostTensor<'a>>; 2]>;

/// The adapter's factors, each checked to be a LoRA factor of a decoder
/// layer of the model, within the config's target modules and layers, in a
/// float dtype; an adapter with none is an error.
fn collect_factors<'a>(
    name: &str,
    st: &SafeTensors<'a>,
    weights_path: &Path,
    spec: &ModelSpec,
    config: &PeftConfig,
) -> Result<Factors<'a>> {
    let invalid = |msg: String| LoraError::Invalid {
        name: name.to_string(),
        msg,
    };
    let mut factors = Factors::new();
    for (tname, view) in st.tensors() {
        let (layer, target, factor) = parse_name(&tname).ok_or_else(|| {
            invalid(format!(
                "tensor '{tname}' is not a LoRA factor of q/k/v/o/gate/up/down_proj in a decoder layer"
            ))
        })?;
        if layer >= spec.num_layers {
            return Err(invalid(format!(
                "tensor '{tname}': layer {layer} of a model with {} layers",
                spec.num_layers
            )));
        }
        if let TargetModules::Listed(t) = &config.targets
            && !t.contains(&target)
        {
            return Err(invalid(format!(
                "tensor '{tname}': {} is not in the config's target_modules",
                target.module()
            )));
        }
        if let Some(l) = &config.layers
            && !l.contains(&layer)
        {
            return Err(invalid(format!(
                "tensor '{tname}': layer {layer} is not in layers_to_transform {l:?}"
            )));
        }
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(invalid(format!(
                    "tensor '{tname}' has dtype {other:?}; supported: F32, F16, BF16"
                )));
            }
        };
        let host = HostTensor {
            dtype,
            shape: view.shape().to_vec(),
            data: Cow::Borrowed(view.data()),
        };
        let slot = &mut factors.entry((layer, target)).or_default()[factor as usize];
        *slot = Some(host);
    }
    if factors.is_empty() {
        return Err(invalid(format!(
            "{} holds no LoRA factors",
            weights_path.display()
        )));
    }
    Ok(factors)
}
