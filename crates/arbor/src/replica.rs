//! One data-parallel replica of the serving engine: its device (or
//! tensor-parallel ranks), model, KV cache, prefix cache, sampler, logits
//! processors and speculator, assembled into [`EngineParts`].
//!
//! The KV size in tokens is whole pages: `--max-total-tokens` rounded up,
//! `--kv-cache-gb` over the bytes per token (a draft model's included), or
//! the memory rule ([`KvAuto`]), split over the ranks of data-parallel
//! attention, and never under the model's context (at most 1,024 tokens)
//! when the memory rule sized it.

use crate::setup::{
    EngineSetup, KvAuto, KvBudget, ModelArgs, ShardDevice, kv_auto_cap_bytes, kv_dtype, load,
};
use anyhow::{Context, Result, bail};
use arbor_engine_core::comm::Communicator;
use arbor_engine_core::engine::EngineParts;
use arbor_engine_core::runner::{KvGeometry, ModelRunner};
use arbor_engine_core::{
    AttentionSharding, Backend, DType, KvSpec, LogitsProcessor, Model, ModelSpec, PrefixCache,
    PrefixCacheOptions, Registry, ResolvedKvDtype, SpeculatorInputs, TpRunners,
};
use arbor_models::LoadedModel;
use std::sync::Arc;

/// One replica's engine parts (one per rank with data-parallel attention)
/// and what the start-up summary reports of it.
pub struct Replica {
    pub parts: Vec<EngineParts>,
    pub model: LoadedModel,
    /// Each rank's device and shard.
    pub devices: Vec<ShardDevice>,
    /// KV bytes per token (the draft model's included).
    pub per_token: u64,
    pub kv_dtype: ResolvedKvDtype,
    pub kv_note: String,
    /// A hybrid model's recurrent state slots (0 for other models).
    pub state_slots: usize,
}

/// A tensor-parallel group's ranks, rank 0 first.
struct RankGroup {
    models: Vec<Arc<dyn Model>>,
    backends: Vec<Arc<dyn Backend>>,
    comms: Vec<Arc<dyn Communicator>>,
}

/// What a replica loads before its KV cache: rank 0's device and model, the
/// group when tensor-parallel, and every rank's device and shard.
struct Loaded {
    backend: Arc<dyn Backend>,
    model: LoadedModel,
    group: Option<RankGroup>,
    devices: Vec<ShardDevice>,
}

/// Loads the model on one device or, with `--tp-size` > 1, one shard per rank.
fn load_devices(registry: &Registry, args: &ModelArgs) -> Result<Loaded> {
    let parallel = args.parallel()?;
    if parallel.tp <= 1 {
        let backend = crate::setup::backend(registry, args)?;
        let mut model = load(registry, backend.clone(), args)?;
        crate::setup::apply_tokenizer_path(&mut model, args)?;
        let device = ShardDevice {
            backend: backend.clone(),
            shard: None,
        };
        return Ok(Loaded {
            backend,
            model,
            group: None,
            devices: vec![device],
        });
    }
    let r = crate::parallel::load_ranks(registry, args, parallel)?;
    let devices = r
        .backends
        .iter()
        .zip(&r.shards)
        .map(|(b, s)| ShardDevice {
            backend: b.clone(),
            shard: Some(s.clone()),
        })
        .collect();
    let mut models = r.models.into_iter();
    let mut first = models.next().context("rank 0")?;
    crate::setup::apply_tokenizer_path(&mut first, args)?;
    let all: Vec<_> = std::iter::once(first.model.clone())
        .chain(models.map(|m| m.model))
        .collect();
    Ok(Loaded {
        backend: r.backends[0].clone(),
        model: first,
        group: Some(RankGroup {
            models: all,
            backends: r.backends,
            comms: r.comms,
        }),
        devices,
    })
}

/// The model as the KV cache sees it: with tensor parallelism the KV heads
/// of all the ranks together (with data-parallel attention each rank's
/// cache holds every head of its own tokens) and every rank's weight bytes.
fn group_spec(model: &LoadedModel, group: Option<&RankGroup>, dp_attention: bool) -> ModelSpec {
    let mut spec = model.model.spec().clone();
    if let Some(g) = group {
        if !dp_attention {
            spec.num_kv_heads *= g.models.len();
        }
        spec.weight_bytes = g.models.iter().map(|m| m.spec().weight_bytes).sum();
    }
    spec
}

/// Refuses what a hybrid model (recurrent layers) cannot be served with
/// yet, naming it, rather than serving wrong output.
fn check_hybrid(spec: &ModelSpec, ranks: bool, setup: &EngineSetup) -> Result<()> {
    if spec.state.is_none() {
        return Ok(());
    }
    let arch = &spec.architecture;
    if ranks {
        bail!(
            "--tp-size / --enable-dp-attention with {arch}: splitting recurrent (Gated DeltaNet) \
             layers over ranks is not supported yet"
        );
    }
    if let Some(sc) = &setup.engine.speculative
        && !matches!(sc.algorithm.as_str(), "ngram" | "nextn")
    {
        bail!(
            "--speculative-algorithm {} with {arch}: only NGRAM and NEXTN (the checkpoint's MTP \
             layer) speculate on recurrent layers yet (EAGLE heads and draft models do not)",
            sc.algorithm
        );
    }
    if setup.hicache.is_some() {
        bail!(
            "--enable-hierarchical-cache with {arch}: a hybrid model's prefixes are not cached \
             yet, so there is nothing to tier"
        );
    }
    Ok(())
}

/// KV bytes of one token: the target's, plus a draft model's (whose KV
/// lives in pages of its own, one per target page).
fn kv_bytes_per_token(
    spec: &ModelSpec,
    page_size: usize,
    dtype: DType,
    draft: Option<&LoadedModel>,
) -> u64 {
    let target = KvSpec {
        num_layers: spec.kv_layers(),
        num_kv_heads: spec.num_kv_heads,
        head_dim: spec.head_dim,
        page_size,
        num_pages: 1,
        dtype,
        values_in_keys: spec.kv_values_in_keys,
    };
    let draft = draft.map_or(0, |d| {
        let s = d.model.spec();
        KvSpec {
            num_layers: s.num_layers,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            ..target
        }
        .bytes_per_token() as u64
    });
    target.bytes_per_token() as u64 + draft
}

/// What sizes a replica's KV cache.
struct KvSizing<'a> {
    setup: &'a EngineSetup,
    spec: &'a ModelSpec,
    /// The longest sequence served (`--context-length`).
    context_len: usize,
    per_token: u64,
    page_size: usize,
    on_cpu: bool,
    dtype: DType,
    /// `MemAvailable` for this replica, when readable.
    available: Option<u64>,
    /// Bytes of a hybrid model's recurrent state slots, set aside like the
    /// weights by the memory rule.
    state_bytes: u64,
    /// The ranks of data-parallel attention, which share the memory rule's tokens.
    dp_ranks: Option<usize>,
}

impl KvSizing<'_> {
    /// The KV cache's size in tokens (whole pages) and the note saying which
    /// rule set it.
    fn tokens(&self) -> Result<(usize, String)> {
        let page_size = self.page_size;
        let (tokens, note) = match self.setup.kv {
            KvBudget::Tokens(t) => (
                t.div_ceil(page_size) * page_size,
                "--max-total-tokens".to_string(),
            ),
            KvBudget::Bytes(b) => (
                ((b / self.per_token.max(1)) as usize / page_size).max(1) * page_size,
                format!("--kv-cache-gb {:.3}", b as f64 / (1u64 << 30) as f64),
            ),
            KvBudget::Fraction(f) => self.by_memory(f)?,
        };
        if !matches!(self.setup.kv, KvBudget::Fraction(_)) {
            return Ok((tokens, note));
        }
        let (tokens, note) = match self.dp_ranks {
            Some(n) => (
                tokens / n / page_size * page_size,
                format!("{note}; split over {n} ranks"),
            ),
            None => (tokens, note),
        };
        let min_tokens = self.context_len.min(1024);
        if tokens < min_tokens {
            bail!(
                "the KV cache would hold only {tokens} tokens (fewer than {min_tokens}); free memory, raise \
                 --mem-fraction-static, or set --max-total-tokens"
            );
        }
        Ok((tokens, note))
    }

    /// The memory rule with `mem_fraction_static` = `fraction`.
    fn by_memory(&self, fraction: f64) -> Result<(usize, String)> {
        let Some(available) = self.available else {
            bail!(
                "cannot read MemAvailable from /proc/meminfo: give the KV size with --max-total-tokens"
            );
        };
        Ok(KvAuto {
            fraction,
            available,
            weight_bytes: self.spec.weight_bytes + self.state_bytes,
            bytes_per_token: self.per_token,
            cap_bytes: kv_auto_cap_bytes(self.on_cpu, self.dtype),
            max_running_requests: self.setup.engine.max_running_requests,
            context_len: self.context_len,
            page_size: self.page_size,
        }
        .tokens())
    }
}

/// Makes the parts every rank of a replica has its own of: prefix caches,
/// samplers and logits processors.
struct RankParts<'a> {
    registry: &'a Registry,
    setup: &'a EngineSetup,
    model: &'a LoadedModel,
    page_size: usize,
    /// The KV layout of a host tier's pages: a tensor-parallel group's hold
    /// every rank's heads (a data-parallel attention rank's, its own
    /// tokens' heads).
    tier_kv: KvSpec,
    /// Memory for a host tier's pages (rank 0's device's: pinned on GPUs).
    host_memory: Option<Arc<dyn arbor_engine_core::HostMemory>>,
}

impl RankParts<'_> {
    fn prefix_cache(&self) -> Result<Box<dyn PrefixCache>> {
        let (registry, setup) = (self.registry, self.setup);
        Ok(if setup.engine.disable_radix_cache {
            Box::new(arbor_engine_core::NoPrefixCache::with_page_size(
                self.page_size,
            )?)
        } else if let Some(h) = &setup.hicache {
            let policy = registry.eviction_policies.get(&setup.eviction_policy)?()?;
            crate::hicache::build(
                h,
                &self.tier_kv,
                policy,
                self.model,
                self.host_memory.clone(),
            )?
        } else {
            let policy = registry.eviction_policies.get(&setup.eviction_policy)?()?;
            registry.prefix_caches.get("radix")?(&PrefixCacheOptions {
                page_size: self.page_size,
                policy,
            })?
        })
    }

    fn sampler(&self) -> Result<Arc<dyn arbor_engine_core::Sampler>> {
        Ok(self.registry.samplers.get(&self.setup.sampler)?()?)
    }

    fn processors(&self) -> Result<Vec<Arc<dyn LogitsProcessor>>> {
        self.setup
            .processors
            .iter()
            .map(|(name, config)| {
                self.registry
                    .logits_processors
                    .get(name)
                    .and_then(|f| f(config))
                    .with_context(|| format!("logits processor '{name}'"))
            })
            .collect()
    }
}

/// Builds one replica: its device (or tensor-parallel ranks), model, KV
/// cache sized from `available` bytes, prefix cache, sampler, processors and
/// speculator.
pub fn build_replica(
    registry: &Registry,
    args: &ModelArgs,
    setup: &EngineSetup,
    available: Option<u64>,
) -> Result<Replica> {
    let parallel = args.parallel()?;
    let Loaded {
        backend,
        model,
        group,
        devices,
    } = load_devices(registry, args)?;
    check_hybrid(model.model.spec(), group.is_some(), setup)?;
    let context_len = args.context_len(model.model.spec())?;
    let resolved = kv_dtype(args, &*backend, model.model.spec())?;
    let standalone = setup
        .engine
        .speculative
        .as_ref()
        .is_some_and(|s| s.algorithm == "standalone");
    let draft = match &setup.draft_model {
        Some(p) if standalone => Some(load_draft(registry, backend.clone(), args, p, &model)?),
        _ => None,
    };
    let dp_attention = parallel.attention == AttentionSharding::DataParallel;
    let spec = group_spec(&model, group.as_ref(), dp_attention);
    let page_size = args.page_size.max(1);
    let kv_dtype = resolved.dtype;
    let per_token = kv_bytes_per_token(&spec, page_size, kv_dtype, draft.as_ref());
    let mut sizing = KvSizing {
        setup,
        spec: &spec,
        context_len,
        per_token,
        page_size,
        on_cpu: backend.info().backend == "cpu",
        dtype: kv_dtype,
        available,
        state_bytes: 0,
        dp_ranks: group
            .as_ref()
            .filter(|_| dp_attention)
            .map(|g| g.models.len()),
    };
    let state_slots = match spec.state {
        Some(st) => state_slot_count(args, setup, &sizing, st.bytes_per_slot())?,
        None => 0,
    };
    sizing.state_bytes = spec
        .state
        .map_or(0, |s| s.bytes_per_slot() * state_slots as u64);
    let (tokens, kv_note) = sizing.tokens()?;
    let num_pages = (tokens / page_size).max(1);
    let runner = Arc::new(
        ModelRunner::with_state_slots(
            model.model.clone(),
            backend.clone(),
            None,
            KvGeometry {
                page_size,
                num_pages,
                kv_dtype,
                state_slots,
            },
        )
        .context("allocating the KV cache")?,
    );
    let tier_kv = match &group {
        Some(g) if !dp_attention => {
            arbor_engine_core::TpExecutor::group_kv_spec(runner.kv_spec(), g.models.len())
        }
        _ => *runner.kv_spec(),
    };
    let make = RankParts {
        registry,
        setup,
        model: &model,
        page_size,
        tier_kv,
        host_memory: backend.host_memory(),
    };
    let mut parts = EngineParts::local(
        runner.clone(),
        make.prefix_cache()?,
        make.sampler()?,
        make.processors()?,
        model.tokenizer.clone(),
        model.tokenizer.eos_token_ids.clone(),
    );
    let mut target_group = None;
    if let Some(group) = group {
        let runners = rank_runners(&runner, &group, page_size, num_pages, kv_dtype)?;
        if dp_attention {
            let parts = dp_attention_parts(parts, &make, runners, group.comms)?;
            return Ok(Replica {
                parts,
                model,
                devices,
                per_token,
                kv_dtype: resolved,
                kv_note,
                state_slots,
            });
        }
        let executors = local_executors(&make, &runners)?;
        target_group = Some(Arc::new(TpRunners::new(runners, group.comms.clone())?));
        parts.executor = Box::new(arbor_engine_core::TpExecutor::new(executors, group.comms)?);
    }
    if let Some(sc) = &setup.engine.speculative {
        let create = registry
            .speculators
            .get(&sc.algorithm)
            .context("--speculative-algorithm")?;
        let inputs = SpeculatorInputs {
            target: runner,
            target_group,
            draft_model: draft.map(|d| d.model),
            // NEXTN's layers live in the target's checkpoint by default.
            draft_path: setup
                .draft_model
                .clone()
                .or_else(|| (sc.algorithm == "nextn").then(|| model.path.clone())),
        };
        let speculator = create(sc, &inputs).map_err(|e| match e {
            e @ arbor_engine_core::CoreError::InvalidSetting { .. } => {
                crate::settings::named_setting(e, "speculative")
            }
            e => anyhow::Error::from(e).context("--speculative-algorithm"),
        })?;
        parts.speculator = Some(speculator);
    }
    Ok(Replica {
        parts: vec![parts],
        model,
        devices,
        per_token,
        kv_dtype: resolved,
        kv_note,
        state_slots,
    })
}

/// A hybrid model's recurrent state slots: `--max-mamba-cache-size`; else,
/// with `--mamba-full-memory-ratio` r, the slots that r times the KV cache's
/// memory holds (SGLang's rule: under the memory rule the slots and the KV
/// cache share what the weights leave, r : 1; with a fixed KV budget the
/// slots get r times it); else twice `--max-running-requests`. Never fewer
/// than one per running request (then no snapshots: prefix reuse is off).
fn state_slot_count(
    args: &ModelArgs,
    setup: &EngineSetup,
    sizing: &KvSizing<'_>,
    bytes_per_slot: u64,
) -> Result<usize> {
    let running = setup.engine.max_running_requests.max(1);
    if let Some(n) = args.max_mamba_cache_size {
        return Ok(n);
    }
    let Some(ratio) = args.mamba_full_memory_ratio else {
        return Ok(2 * running);
    };
    let (tokens, _) = sizing.tokens()?;
    let kv_bytes = tokens as f64 * sizing.per_token as f64;
    let state_bytes = match setup.kv {
        KvBudget::Fraction(_) => kv_bytes * ratio / (1.0 + ratio),
        KvBudget::Tokens(_) | KvBudget::Bytes(_) => kv_bytes * ratio,
    };
    Ok(((state_bytes / bytes_per_slot.max(1) as f64) as usize).max(running))
}

/// Every rank's model runner: rank 0's is `first`, the others get KV caches
/// of the same shape.
fn rank_runners(
    first: &Arc<ModelRunner>,
    group: &RankGroup,
    page_size: usize,
    num_pages: usize,
    kv_dtype: DType,
) -> Result<Vec<Arc<ModelRunner>>> {
    let mut runners = vec![first.clone()];
    for (rank, (m, b)) in group.models.iter().zip(&group.backends).enumerate().skip(1) {
        let runner = ModelRunner::new(m.clone(), b.clone(), None, page_size, num_pages, kv_dtype)
            .with_context(|| format!("allocating rank {rank}'s KV cache"))?;
        runners.push(Arc::new(runner));
    }
    Ok(runners)
}

/// One local executor per rank, each with its own sampler and processors.
fn local_executors(
    make: &RankParts,
    runners: &[Arc<ModelRunner>],
) -> Result<Vec<arbor_engine_core::LocalExecutor>> {
    runners
        .iter()
        .map(|r| {
            Ok(arbor_engine_core::LocalExecutor::new(
                r.clone(),
                make.sampler()?,
                make.processors()?,
                make.model.tokenizer.eos_token_ids.clone(),
            ))
        })
        .collect()
}

/// Data-parallel attention: one scheduler per rank, each with its own
/// prefix cache; rank 0's are `parts` with its executor replaced.
fn dp_attention_parts(
    mut parts: EngineParts,
    make: &RankParts,
    runners: Vec<Arc<ModelRunner>>,
    comms: Vec<Arc<dyn Communicator>>,
) -> Result<Vec<EngineParts>> {
    if make.setup.engine.speculative.is_some() {
        bail!("speculative decoding with --enable-dp-attention is not supported yet");
    }
    let executors = local_executors(make, &runners)?;
    let group = arbor_engine_core::DpAttentionGroup::new(executors, comms)?;
    let mut ranks = group.executors().into_iter();
    parts.executor = Box::new(ranks.next().context("rank 0")?);
    let mut all = vec![parts];
    for r in ranks {
        all.push(EngineParts {
            executor: Box::new(r),
            prefix_cache: make.prefix_cache()?,
            decoder: make.model.tokenizer.clone(),
            eos_token_ids: make.model.tokenizer.eos_token_ids.clone(),
            speculator: None,
        });
    }
    Ok(all)
}

/// Loads the STANDALONE draft model at `path` like the target (device and
/// `--dtype`), and checks that it shares the target's tokenizer.
fn load_draft(
    registry: &Registry,
    backend: Arc<dyn Backend>,
    args: &ModelArgs,
    path: &std::path::Path,
    target: &LoadedModel,
) -> Result<LoadedModel> {
    if !path.exists() {
        bail!(
            "--speculative-draft-model-path {}: no such file or folder",
            path.display()
        );
    }
    let draft_args = ModelArgs {
        model_path: Some(path.to_path_buf()),
        revision: None,
        tokenizer_path: None,
        ..args.clone()
    };
    let draft = load(registry, backend, &draft_args).context("--speculative-draft-model-path")?;
    let (t, d) = (&target.tokenizer, &draft.tokenizer);
    if t.inner().get_vocab(true) != d.inner().get_vocab(true) {
        bail!(
            "--speculative-draft-model-path {}: its tokenizer ({} tokens) is not the target's ({} tokens); \
             a draft model must share the target's vocabulary",
            path.display(),
            d.vocab_size(),
            t.vocab_size()
        );
    }
    Ok(draft)
}
