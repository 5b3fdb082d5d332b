//! Tensor and expert parallelism with the in-process communicator: every
//! tiny fixture architecture (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE,
//! Mixtral, DeepSeek-V2 and -V3 with latent attention: heads split, the
//! latent KV replicated) served by an engine over a `TpExecutor` of two ranks — each rank
//! a CPU backend holding only its shard (heads, MLP and expert widths split,
//! a vocab-parallel LM head), the MoE ones also with their experts
//! partitioned (`--ep-size 2`, with the experts' shares all-reduced and
//! with all-to-all dispatch and combine) — continues the reference prompts greedily
//! exactly as transformers did (the fixtures' reference.json), as one batch
//! with chunked prefill and again from the radix cache, and ends with the
//! KV pool empty; so do pre-quantized checkpoints (FP8, GPTQ, W8A8 with
//! static input scales) against their numpy references. Shapes the group
//! size does not divide are clear errors.

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::attention::BatchLayout;
use arbor_engine_core::comm::{Communicator, LocalGroup};
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, FinishKind, GenerateRequest};
use arbor_engine_core::model::ForwardBatch;
use arbor_engine_core::moe::ExpertSharding;
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{
    Backend, DType, Executor, LoadOptions, LocalExecutor, PrefixCacheOptions, Registry,
    SamplingParams, ShardSpec, TpExecutor, TpRunners,
};
use arbor_kv_radix as _;
use arbor_models::{LoadedModel, load_model, load_model_shard};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

/// Each rank's model shard, device and communicator.
type Shards = (
    Vec<LoadedModel>,
    Vec<Arc<dyn Backend>>,
    Vec<Arc<dyn Communicator>>,
);

/// The ranks' shards of `name`, each on its own one-thread CPU backend.
fn shards(
    registry: &Registry,
    name: &str,
    world: usize,
    experts: ExpertSharding,
) -> Result<Shards> {
    shards_as(registry, name, world, experts, "f32")
}

/// [`shards`] loaded by the quantization method `method`.
fn shards_as(
    registry: &Registry,
    name: &str,
    world: usize,
    experts: ExpertSharding,
    method: &str,
) -> Result<Shards> {
    let backends: Vec<Arc<dyn Backend>> = (0..world)
        .map(|_| Ok(Arc::new(CpuBackend::new(1)?) as Arc<dyn Backend>))
        .collect::<Result<_>>()?;
    let group = LocalGroup::new(world)?;
    let comms: Vec<Arc<dyn Communicator>> = group
        .ranks(&backends)?
        .into_iter()
        .map(|c| c as Arc<dyn Communicator>)
        .collect();
    let mut models = Vec::new();
    for (b, c) in backends.iter().zip(&comms) {
        let opts = LoadOptions {
            backend: b.clone(),
            quant: registry.quant_methods.get(method)?(&Default::default())?,
            progress: None,
        };
        let shard = ShardSpec {
            comm: c.clone(),
            experts,
            attention: Default::default(),
        };
        models.push(load_model_shard(&fixture(name), registry, &opts, &shard)?);
    }
    Ok((models, backends, comms))
}

fn engine(registry: &Registry, name: &str, world: usize, ep: ExpertSharding) -> Result<Engine> {
    engine_as(registry, name, world, ep, "f32")
}

/// [`engine`] over shards loaded by the quantization method `method`.
fn engine_as(
    registry: &Registry,
    name: &str,
    world: usize,
    ep: ExpertSharding,
    method: &str,
) -> Result<Engine> {
    let (models, backends, comms) = shards_as(registry, name, world, ep, method)?;
    let ranks = models
        .iter()
        .zip(&backends)
        .map(|(m, b)| {
            let runner = ModelRunner::new(m.model.clone(), b.clone(), None, 4, 128, DType::F32)?;
            Ok(LocalExecutor::new(
                runner,
                registry.samplers.get("standard")?()?,
                vec![],
                vec![],
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    // Each rank holds its share of the heads and about 1/world of the
    // split weights.
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json"))?)?;
    let heads = cfg["num_attention_heads"].as_u64().context("heads")? as usize;
    for m in &models {
        assert_eq!(
            m.model.spec().num_heads * world,
            heads,
            "{name}: heads per rank"
        );
    }
    let tp = TpExecutor::new(ranks, comms)?;
    assert_eq!(tp.model_spec().num_heads, heads);
    assert_eq!(tp.world_size(), world);
    let cache = registry.prefix_caches.get("radix")?(&PrefixCacheOptions {
        page_size: 4,
        policy: registry.eviction_policies.get("lru")?()?,
    })?;
    let parts = EngineParts {
        executor: Box::new(tp),
        prefix_cache: cache,
        decoder: models[0].tokenizer.clone(),
        eos_token_ids: vec![],
        speculator: None,
    };
    let cfg = EngineConfig {
        chunked_prefill_size: 8,
        ..EngineConfig::default()
    };
    Ok(Engine::new(cfg, parts)?)
}

fn run(e: &Engine, prompts: &[Vec<u32>]) -> Result<Vec<Vec<u32>>> {
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            e.submit(GenerateRequest::new(
                p.clone(),
                SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(32)
                },
            ))
        })
        .collect::<Result<_, _>>()?;
    streams
        .into_iter()
        .map(|st| {
            let chunks = st.collect_blocking();
            let f = chunks
                .last()
                .and_then(|c| c.finish.clone())
                .context("finish")?;
            anyhow::ensure!(f.kind != FinishKind::Abort, "{f:?}");
            Ok(chunks.iter().flat_map(|c| c.token_ids.clone()).collect())
        })
        .collect()
}

fn assert_pool_empty(e: &Engine) {
    assert!(e.flush_cache().expect("flush"), "engine should be idle");
    for _ in 0..100 {
        let s = e.stats();
        if s.num_used_tokens == 0 && s.evictable_tokens == 0 {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("KV pages still in use: {:?}", e.stats());
}

fn check(name: &str, ep: ExpertSharding) -> Result<()> {
    let registry = Registry::builtin()?;
    let text = std::fs::read_to_string(fixture(name).join("reference.json"))?;
    let r: Value = serde_json::from_str(&text)?;
    let prompts: Vec<Vec<u32>> = r["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .map(|p| ids(&p["input_ids"]))
        .collect();
    let want: Vec<Vec<u32>> = r["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .map(|p| ids(&p["greedy_ids"]))
        .collect();
    let e = engine(&registry, name, 2, ep).with_context(|| format!("{name}: tp 2, {ep:?}"))?;
    assert_eq!(
        run(&e, &prompts)?,
        want,
        "{name} (tp 2, {ep:?}): batched greedy"
    );
    // Again, the prompts now cached.
    assert_eq!(
        run(&e, &prompts)?,
        want,
        "{name} (tp 2, {ep:?}): from the cache"
    );
    assert!(
        e.stats().cached_tokens_total > 0,
        "{name}: nothing was cached"
    );
    assert_pool_empty(&e);
    Ok(())
}

#[test]
fn dense_models_under_tp2_continue_as_transformers() -> Result<()> {
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] {
        check(name, ExpertSharding::Split)?;
    }
    Ok(())
}

#[test]
fn moe_models_under_tp2_and_ep2_continue_as_transformers() -> Result<()> {
    for name in [
        "tiny-qwen3-moe",
        "tiny-qwen2-moe",
        "tiny-mixtral",
        "tiny-deepseek-v2",
        "tiny-deepseek-v3",
    ] {
        check(name, ExpertSharding::Split)?;
        check(name, ExpertSharding::PartitionedAllReduce)?;
        check(name, ExpertSharding::PartitionedAllToAll)?;
    }
    Ok(())
}

#[test]
fn group_sizes_that_do_not_divide_are_named_errors() -> Result<()> {
    let registry = Registry::builtin()?;
    let err = |name: &str, world: usize, ep: ExpertSharding| -> String {
        match shards(&registry, name, world, ep) {
            Ok(_) => format!("{name} loaded on {world} ranks"),
            Err(e) => format!("{e:#}"),
        }
    };
    // tiny-mistral has one KV head.
    let e = err("tiny-mistral", 2, ExpertSharding::Split);
    assert!(
        e.contains("tp_size 2 does not divide num_key_value_heads (1)"),
        "{e}"
    );
    // tiny-mixtral has 4 experts; 8 heads would be needed for 8 ranks anyway,
    // so take 3 ranks: heads (4) first.
    let e = err("tiny-mixtral", 3, ExpertSharding::PartitionedAllToAll);
    assert!(e.contains("does not divide num_attention_heads (4)"), "{e}");
    let e = err("tiny-llama", 2, ExpertSharding::PartitionedAllReduce);
    assert!(
        e.contains("ep_size applies to mixture-of-experts models only"),
        "{e}"
    );
    // A pre-quantized checkpoint splits its layers in whole blocks of 32
    // inputs: tiny-llama's down_proj share at 2 ranks is 80.
    let e = err("quant/fp8-dynamic", 2, ExpertSharding::Split);
    assert!(
        e.contains("cannot split tensor 'model.layers.0.mlp.down_proj.weight'")
            && e.contains("whole blocks"),
        "{e}"
    );
    Ok(())
}

/// Pre-quantized checkpoints (compressed-tensors FP8 per channel, 8-bit
/// GPTQ) over two ranks: each rank loads a layer whole in the method's
/// block form and keeps its rows or whole blocks of its columns, so the
/// ranks hold exactly the one-device weights; the engine continues the
/// prompts as the numpy forward of those weights does (up to its first
/// step with a margin under 1e-3), batched and from the cache, and ends with
/// the KV pool empty. With `--quantization w8a8_fp8` the FP8 one rounds
/// each share's inputs with the layer's static scale, so the tie-clear
/// prompts continue as its W8A8 reference does; so does the FP8 MoE
/// checkpoint with its experts partitioned over the ranks (all-to-all),
/// each rank's experts rounding with the block's largest scales, those of
/// the other rank's experts included.
#[test]
fn quantized_checkpoints_under_tp2_continue_their_reference() -> Result<()> {
    let registry = Registry::builtin()?;
    let split = ExpertSharding::Split;
    for (name, method, reference, stored, ep) in [
        (
            "quant/tp-fp8",
            "f32",
            "reference.json",
            DType::F8_S32,
            split,
        ),
        (
            "quant/tp-gptq8",
            "f32",
            "reference.json",
            DType::U8_S32,
            split,
        ),
        (
            "quant/tp-fp8",
            "w8a8_fp8",
            "w8a8-reference.json",
            DType::F8A8_S32,
            split,
        ),
        (
            "quant/moe-fp8-static",
            "w8a8_fp8",
            "w8a8-reference.json",
            DType::F8A8_S32,
            ExpertSharding::PartitionedAllToAll,
        ),
    ] {
        let (models, ..) = shards_as(&registry, name, 2, ep, method)?;
        for m in &models {
            assert_eq!(m.model.spec().weight_dtype, stored, "{name} {method}");
        }
        let text = std::fs::read_to_string(fixture(name).join(reference))?;
        let r: Value = serde_json::from_str(&text)?;
        let cases: Vec<&Value> = r["prompts"]
            .as_array()
            .context("prompts")?
            .iter()
            .filter(|p| p["closest_tie"].as_f64().unwrap_or(1.0) >= 1e-6)
            .collect();
        assert!(
            !cases.is_empty(),
            "{name} {method}: no prompt clear of ties"
        );
        let prompts: Vec<Vec<u32>> = cases.iter().map(|p| ids(&p["input_ids"])).collect();
        let e = engine_as(&registry, name, 2, ep, method)?;
        for pass in ["batched", "cached"] {
            for ((got, p), i) in run(&e, &prompts)?.iter().zip(&cases).zip(0..) {
                let want = ids(&p["greedy_ids"]);
                let sure = p["margins"]
                    .as_array()
                    .context("margins")?
                    .iter()
                    .position(|m| m.as_f64().unwrap_or(0.0) < 1e-3)
                    .unwrap_or(want.len());
                assert_eq!(
                    got[..sure],
                    want[..sure],
                    "{name} {method} prompt {i}, {pass} (up to step {sure})"
                );
            }
        }
        assert_pool_empty(&e);
    }
    Ok(())
}

/// A LAYERSKIP draft forward (`exit_after`: the first layers, then the
/// final norm and LM head) run on both ranks through `TpRunners` gives the
/// logits one rank gives for the whole model, for a prompt and then for a
/// token that reads the prompt's KV (so every rank wrote its shard of the
/// draft KV); a dense model and a MoE one with experts partitioned.
#[test]
fn draft_forwards_run_on_every_rank() -> Result<()> {
    let registry = Registry::builtin()?;
    for (name, experts) in [
        ("tiny-llama", ExpertSharding::Split),
        ("tiny-qwen3-moe", ExpertSharding::PartitionedAllToAll),
    ] {
        let (models, backends, comms) = shards(&registry, name, 2, experts)?;
        let runners = models
            .iter()
            .zip(&backends)
            .map(|(m, b)| {
                Ok(Arc::new(ModelRunner::new(
                    m.model.clone(),
                    b.clone(),
                    None,
                    4,
                    16,
                    DType::F32,
                )?))
            })
            .collect::<Result<Vec<_>>>()?;
        let group = TpRunners::new(runners, comms)?;
        let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new(1)?);
        let opts = LoadOptions {
            backend: cpu.clone(),
            quant: registry.quant_methods.get("f32")?(&Default::default())?,
            progress: None,
        };
        let whole = load_model(&fixture(name), &registry, &opts)?;
        let one = ModelRunner::new(whole.model.clone(), cpu.clone(), None, 4, 16, DType::F32)?;
        let prompt: Vec<u32> = (0..10).map(|i| 3 + 7 * i).collect();
        let pages: Vec<u32> = vec![5, 2, 9];
        let batch = |prefix: usize, ids: &[u32]| -> Result<ForwardBatch> {
            let mut layout = BatchLayout::new(4);
            layout.push_seq(prefix, ids.len(), &pages)?;
            Ok(ForwardBatch {
                input_ids: ids.to_vec(),
                positions: (prefix..prefix + ids.len()).map(|p| p as u32).collect(),
                layout: Arc::new(layout),
                logits_rows: vec![(ids.len() - 1) as u32],
                hidden_layers: Vec::new(),
                lora: Vec::new(),
                exit_after: Some(1),
                hidden_at_every_row: false,
            })
        };
        for (prefix, ids) in [(0, &prompt[..]), (prompt.len(), &[42u32][..])] {
            let b = batch(prefix, ids)?;
            let got = group
                .first()
                .backend()
                .download_f32(&group.forward(&b)?.logits)?;
            let want = cpu.download_f32(&one.forward(&b)?.logits)?;
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            let err = got
                .iter()
                .zip(&want)
                .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            eprintln!("{name} draft logits at {prefix}: max abs error {err:.3e} of {scale:.3}");
            assert!(
                got.len() == want.len() && err <= 1e-4 * scale,
                "{name}: draft logits after {prefix} tokens differ by {err} (scale {scale})"
            );
        }
    }
    Ok(())
}

/// A draft head on rank 0 (EAGLE, EAGLE3, NEXTN) reads the whole model's
/// shape and the LM head over the whole vocabulary from `TpRunners`: for a
/// vocab-parallel head (tiny-llama, untied) the ranks' rows gathered in
/// order, byte for byte one device's head in f32 and bf16; for tied weights
/// (tiny-qwen3) the replicated table itself, not a copy.
#[test]
fn the_whole_lm_head_is_gathered_on_rank_zero() -> Result<()> {
    let registry = Registry::builtin()?;
    for (name, method, tied) in [
        ("tiny-llama", "f32", false),
        ("tiny-llama", "bf16", false),
        ("tiny-qwen3", "f32", true),
    ] {
        let world = 2;
        let (models, backends, comms) =
            shards_as(&registry, name, world, ExpertSharding::Split, method)?;
        let runners = models
            .iter()
            .zip(&backends)
            .map(|(m, b)| {
                let r = ModelRunner::new(m.model.clone(), b.clone(), None, 4, 8, DType::F32)?;
                Ok(Arc::new(r))
            })
            .collect::<Result<Vec<_>>>()?;
        let group = TpRunners::new(runners, comms)?;
        let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new(1)?);
        let opts = LoadOptions {
            backend: cpu.clone(),
            quant: registry.quant_methods.get(method)?(&Default::default())?,
            progress: None,
        };
        let whole = load_model(&fixture(name), &registry, &opts)?;
        let spec = whole.model.spec();
        let g = group.spec();
        assert_eq!(
            (
                g.num_heads,
                g.num_kv_heads,
                g.intermediate_size,
                g.vocab_size
            ),
            (
                spec.num_heads,
                spec.num_kv_heads,
                spec.intermediate_size,
                spec.vocab_size
            ),
            "{name}: the group's shape"
        );
        let rank_rows = group.first().model().lm_head().context("rank head")?.rows();
        assert_eq!(rank_rows, spec.vocab_size / world, "{name}: vocab-parallel");
        let got = group.whole_lm_head()?.context("gathered head")?;
        let want = whole.model.lm_head().context("whole head")?;
        assert_eq!((got.dtype(), got.shape()), (want.dtype(), want.shape()));
        let bytes = |b: &Arc<dyn Backend>, t: &arbor_engine_core::Tensor| -> Result<Vec<u8>> {
            let mut v = vec![0u8; t.byte_len()?];
            b.download(t, &mut v)?;
            Ok(v)
        };
        assert!(
            bytes(group.first().backend(), &got)? == bytes(&cpu, &want)?,
            "{name} {method}: the gathered LM head differs from one device's"
        );
        let table = group.first().model().input_embedding();
        let is_table = table.is_some_and(|t| t.buffer_id() == got.buffer_id());
        assert_eq!(is_table, tied, "{name}: the tied table is used in place");
    }
    Ok(())
}
