//! `[parallel]`: tensor, expert and data parallelism (SGLang's `--tp-size`,
//! `--ep-size` and `--dp-size`), the flags, their checks, and loading one
//! model shard per rank.
//!
//! With `dp_size` D > 1 the engine runs D replicas of the whole model (each
//! its own tensor-parallel group when `tp_size` > 1), each with its own
//! scheduler, KV cache and prefix cache, on its share of the CPU threads
//! or on devices from `base_gpu_id + d * tp_size * gpu_id_step`
//! ([`replica_args`]); `load_balance_method` spreads the requests
//! (engine-core `engine::data_parallel`). A weight update loads one copy
//! per replica (`setup::DiskWeightLoader`), and so does every LoRA adapter
//! (`arbor_lora::LoraRegistry::replicated`); a PD decode worker sends each
//! request to the replica that imported its prefix (engine-core
//! `engine::transfer`).
//!
//! With `tp_size` N > 1 the model is split over N ranks in one process:
//! each rank is a CPU backend with its share of the threads, or a device at
//! `base_gpu_id + rank * gpu_id_step` (SGLang's placement), holding only its slices of the weights
//! (`arbor_models::shard`) and a KV cache of its heads; a `TpExecutor` runs
//! every step on all of them. `ep_size` equal to `tp_size` partitions the
//! routed experts of a MoE model over the ranks instead of splitting each
//! expert's width; `moe_a2a_backend` says how the ranks then exchange
//! tokens (`none`: every rank routes every token and the experts' shares
//! are all-reduced; `all-to-all`: each rank routes its block of the tokens
//! and dispatches the rows to the experts' ranks, `arbor_models::moe::all_to_all`).
//! HiCache, PD disaggregation, every speculative algorithm and LoRA
//! adapters run with it (the group's tier pages are in the single-engine
//! layout; a STANDALONE draft model runs whole on rank 0's device;
//! LAYERSKIP's draft forwards run on every rank, `TpRunners`; an EAGLE,
//! EAGLE3 or NEXTN head runs whole on rank 0's device with the target's
//! LM head gathered there over the whole vocabulary; each rank applies its
//! slices of an adapter's factors). The ranks meet in the registry's device
//! group of their backend where it has one (`cuda`: NCCL between distinct
//! GPUs, `arbor_backend_cuda::nccl`), else in engine-core's
//! `comm::LocalGroup` (collectives through host memory), which the device
//! suite validated on the CPU and on wgpu (`TP_DEVICES`); ROCm ranks are
//! refused at start-up until validated.

use crate::settings::Section;
use crate::setup::ModelArgs;
use anyhow::{Context, Result, bail};
use arbor_engine_core::comm::{Communicator, DeviceGroup};
use arbor_engine_core::engine::LoadBalance;
use arbor_engine_core::moe::ExpertSharding;
use arbor_engine_core::{AttentionSharding, Backend, BackendOptions, Registry, ShardSpec};
use arbor_models::LoadedModel;
use clap::Args;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// `[parallel]` and the parallelism flags of `arbor serve` (SGLang's
/// names). One declaration per setting ([`crate::settings`]).
#[derive(Args, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ParallelSection {
    /// Tensor-parallel ranks (CPU: in-process ranks on split cores).
    #[arg(
        long,
        visible_aliases = ["tp", "tensor-parallel-size"],
        help_heading = "Parallelism"
    )]
    pub tp_size: Option<usize>,
    /// Expert-parallel ranks of a MoE model: 1, or equal to --tp-size.
    #[arg(
        long,
        visible_aliases = ["ep", "expert-parallel-size"],
        help_heading = "Parallelism"
    )]
    pub ep_size: Option<usize>,
    /// How expert-parallel ranks exchange tokens: none (each rank routes
    /// every token; the experts' shares are all-reduced) or all-to-all
    /// (each rank routes its block of the tokens and dispatches them to the
    /// experts' ranks) [default: none].
    #[arg(long, help_heading = "Parallelism")]
    pub moe_a2a_backend: Option<String>,
    /// The device index of rank 0 (of the one device without tensor parallelism).
    #[arg(long, help_heading = "Parallelism")]
    pub base_gpu_id: Option<usize>,
    /// Rank r runs on device base-gpu-id + r * gpu-id-step; 0 puts every
    /// rank on the same device.
    #[arg(long, help_heading = "Parallelism")]
    pub gpu_id_step: Option<usize>,
    /// Data-parallel replicas of the model, each with its own scheduler and
    /// KV cache (CPU: on split cores).
    #[arg(
        long,
        visible_aliases = ["dp", "data-parallel-size"],
        help_heading = "Parallelism"
    )]
    pub dp_size: Option<usize>,
    /// How requests are spread over the data-parallel replicas: round_robin,
    /// shortest_queue (fewest requests in flight) or minimum_tokens (fewest
    /// tokens in flight).
    #[arg(long, help_heading = "Parallelism")]
    pub load_balance_method: Option<String>,
    /// Data-parallel attention (with --dp-size equal to --tp-size > 1): each
    /// rank runs attention whole for its own requests with a KV cache of its
    /// own; the feed-forward layers stay split over the ranks.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "Parallelism")]
    pub enable_dp_attention: Option<bool>,
}

impl Section for ParallelSection {
    fn defaults() -> Self {
        Self {
            tp_size: Some(1),
            ep_size: Some(1),
            moe_a2a_backend: None,
            base_gpu_id: Some(0),
            gpu_id_step: Some(1),
            dp_size: Some(1),
            load_balance_method: Some("round_robin".into()),
            enable_dp_attention: Some(false),
        }
    }
}

/// Checked parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parallel {
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// How the ranks share the routed experts.
    pub experts: ExpertSharding,
    /// The device index of rank 0.
    pub base_gpu_id: usize,
    /// Device indices between consecutive ranks (0: all on one device).
    pub gpu_id_step: usize,
    /// Data-parallel replicas.
    pub dp: usize,
    /// How requests are spread over the replicas.
    pub balance: LoadBalance,
    /// How the ranks of a group share attention (data-parallel attention:
    /// `dp` equals `tp` and the ranks are one group, not `dp` replicas).
    pub attention: AttentionSharding,
}

impl Parallel {
    /// Data-parallel replicas to build: `dp`, or one group of `tp` ranks
    /// with data-parallel attention.
    pub fn replicas(&self) -> usize {
        match self.attention {
            AttentionSharding::DataParallel => 1,
            AttentionSharding::Heads => self.dp,
        }
    }

    /// The device index rank `rank` runs on (SGLang's placement:
    /// `base_gpu_id + rank * gpu_id_step`).
    pub fn device_index(&self, rank: usize) -> usize {
        self.base_gpu_id + rank * self.gpu_id_step
    }

    /// The device index data-parallel replica `d`'s first rank runs on (the
    /// replicas' ranks in turn: `d * tp`).
    pub fn replica_device_index(&self, d: usize) -> usize {
        self.device_index(d * self.tp)
    }
}

impl Default for Parallel {
    fn default() -> Self {
        Self {
            tp: 1,
            experts: ExpertSharding::Split,
            base_gpu_id: 0,
            gpu_id_step: 1,
            dp: 1,
            balance: LoadBalance::RoundRobin,
            attention: AttentionSharding::Heads,
        }
    }
}

impl ParallelSection {
    /// The checked settings; errors name the key.
    pub fn to_settings(&self) -> Result<Parallel> {
        let tp = self.tp_size.unwrap_or(1);
        let ep = self.ep_size.unwrap_or(1);
        if tp == 0 {
            bail!("[parallel] tp_size / --tp-size must be at least 1");
        }
        if ep != 1 && ep != tp {
            bail!("[parallel] ep_size / --ep-size must be 1 or equal tp_size ({tp}), got {ep}");
        }
        let a2a = match self.moe_a2a_backend.as_deref().unwrap_or("none") {
            "none" => false,
            "all-to-all" => true,
            other => bail!(
                "[parallel] moe_a2a_backend / --moe-a2a-backend: unknown backend '{other}' \
                 (none: the experts' shares are all-reduced; all-to-all: tokens are \
                 dispatched to the experts' ranks and combined)"
            ),
        };
        let experts = match (ep > 1, a2a) {
            (false, false) => ExpertSharding::Split,
            (true, false) => ExpertSharding::PartitionedAllReduce,
            (true, true) => ExpertSharding::PartitionedAllToAll,
            (false, true) => bail!(
                "[parallel] moe_a2a_backend / --moe-a2a-backend all-to-all needs \
                 ep_size / --ep-size > 1 (experts partitioned over the ranks)"
            ),
        };
        let dp = self.dp_size.unwrap_or(1);
        if dp == 0 {
            bail!("[parallel] dp_size / --dp-size must be at least 1");
        }
        let balance = self
            .load_balance_method
            .as_deref()
            .unwrap_or("round_robin")
            .parse::<LoadBalance>()
            .map_err(|e| {
                anyhow::anyhow!("[parallel] load_balance_method / --load-balance-method: {e}")
            })?;
        let attention = if self.enable_dp_attention.unwrap_or(false) {
            if tp < 2 || dp != tp {
                bail!(
                    "[parallel] enable_dp_attention / --enable-dp-attention needs dp_size / \
                     --dp-size equal to tp_size / --tp-size, both above 1 (got dp {dp}, tp {tp})"
                );
            }
            AttentionSharding::DataParallel
        } else {
            AttentionSharding::Heads
        };
        Ok(Parallel {
            tp,
            experts,
            base_gpu_id: self.base_gpu_id.unwrap_or(0),
            gpu_id_step: self.gpu_id_step.unwrap_or(1),
            dp,
            balance,
            attention,
        })
    }
}

/// Devices whose ranks are validated with the in-process group's
/// host-staged collectives (the device suite's tensor-parallel tests ran on
/// them: the CPU, and wgpu on lavapipe).
const TP_DEVICES: [&str; 2] = ["cpu", "wgpu"];

/// Refuses a device that tensor parallelism does not run on: one of
/// [`TP_DEVICES`], or a backend with a device group of its own in the
/// registry (`cuda`: NCCL).
pub fn check_supported(registry: &Registry, p: Parallel, device: &str) -> Result<()> {
    if p.tp == 1 || TP_DEVICES.contains(&device) || registry.device_groups.get(device).is_ok() {
        return Ok(());
    }
    bail!(
        "--tp-size {} runs on --device cpu or wgpu (ranks in one process, collectives \
         through host memory){}; on '{device}' it is not validated yet",
        p.tp,
        match registry.device_groups.names() {
            n if n.is_empty() => String::new(),
            n => format!(" and on {} (its own collectives)", n.join(", ")),
        }
    )
}

/// The model arguments of data-parallel replica `d` of `p.dp`: one
/// replica (`--dp-size 1`), its first rank on device
/// [`Parallel::device_index`]`(d * p.tp)`, and on the CPU its share of the
/// threads (all of them with one replica).
pub fn replica_args(args: &ModelArgs, p: Parallel, d: usize) -> ModelArgs {
    let mut a = args.clone();
    if p.replicas() > 1 {
        a.dp_size = 1;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let total = if args.threads == 0 {
            cores
        } else {
            args.threads
        };
        a.threads = (total / p.dp).max(1);
        a.base_gpu_id = p.replica_device_index(d);
    }
    a
}

/// `f(i, item)` for every item, each on a thread of its own (one item runs
/// on the caller's), the results in the items' order: loads of weights for
/// several devices or replicas overlap. A panic in `f` is resumed here.
pub fn on_threads<T: Sync, R: Send>(items: &[T], f: impl Fn(usize, &T) -> R + Sync) -> Vec<R> {
    if items.len() <= 1 {
        return items.iter().enumerate().map(|(i, t)| f(i, t)).collect();
    }
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = items
            .iter()
            .enumerate()
            .map(|(i, t)| s.spawn(move || f(i, t)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// One rank's device, model shard and communicator, for every rank.
pub struct Ranks {
    pub models: Vec<LoadedModel>,
    pub backends: Vec<Arc<dyn Backend>>,
    pub comms: Vec<Arc<dyn Communicator>>,
    /// Each rank's share of the model (what a weight update loads again).
    pub shards: Vec<ShardSpec>,
}

/// Starts `p.tp` backends (on the CPU the threads split between them;
/// elsewhere rank r on device [`Parallel::device_index`]`(r)`) and loads
/// each rank's shard of the model.
pub fn load_ranks(registry: &Registry, args: &ModelArgs, p: Parallel) -> Result<Ranks> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let total = if args.threads == 0 {
        cores
    } else {
        args.threads
    };
    let per_rank = (total / p.tp).max(1);
    let options: Vec<BackendOptions> = (0..p.tp)
        .map(|rank| BackendOptions {
            threads: per_rank,
            device_index: p.device_index(rank),
            ..crate::setup::backend_options(args)
        })
        .collect();
    let placement = || {
        format!(
            "starting {} ranks on device '{}' {:?} (--base-gpu-id {}, --gpu-id-step {})",
            p.tp,
            args.device,
            options.iter().map(|o| o.device_index).collect::<Vec<_>>(),
            p.base_gpu_id,
            p.gpu_id_step
        )
    };
    let DeviceGroup { backends, comms } = match registry.device_groups.get(&args.device) {
        Ok(open) => open(&options).with_context(placement)?,
        Err(_) => {
            let factory = registry.backends.get(&args.device)?;
            let backends = options
                .iter()
                .map(|o| factory(o))
                .collect::<arbor_engine_core::Result<Vec<_>>>()
                .with_context(placement)?;
            DeviceGroup::local(backends)?
        }
    };
    let path =
        crate::fetch::resolve_model_path(args.model_path.as_deref(), args.revision.as_deref())?;
    let quant = crate::setup::quant_method(registry, &args.dtype, args.quantization.as_deref())?;
    let shards: Vec<ShardSpec> = comms
        .iter()
        .map(|c| ShardSpec {
            comm: c.clone(),
            experts: p.experts,
            attention: p.attention,
        })
        .collect();
    let ranks: Vec<(&Arc<dyn Backend>, &ShardSpec)> = backends.iter().zip(&shards).collect();
    // The ranks load their shards at once (each on its own device, or its
    // share of the CPU threads).
    let models = on_threads(&ranks, |rank, (b, shard)| {
        let opts = arbor_engine_core::LoadOptions {
            backend: (*b).clone(),
            quant: quant.clone(),
            progress: None,
        };
        arbor_models::load_model_shard(&path, registry, &opts, shard)
            .map_err(|e| crate::settings::named_setting(e, "parallel"))
            .with_context(|| format!("loading rank {rank} of {} of {}", p.tp, path.display()))
    })
    .into_iter()
    .collect::<Result<Vec<_>>>()?;
    Ok(Ranks {
        models,
        backends,
        comms,
        shards,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_and_errors() {
        let a = ParallelSection {
            tp_size: Some(2),
            gpu_id_step: Some(0),
            ..Default::default()
        };
        let mut s = crate::settings::layered(
            ParallelSection {
                tp_size: Some(4),
                ep_size: Some(2),
                base_gpu_id: Some(3),
                gpu_id_step: Some(2),
                ..Default::default()
            },
            &a,
        );
        let p = s.to_settings().unwrap();
        assert_eq!(
            p,
            Parallel {
                tp: 2,
                experts: ExpertSharding::PartitionedAllReduce,
                base_gpu_id: 3,
                gpu_id_step: 0,
                dp: 1,
                balance: LoadBalance::RoundRobin,
                attention: AttentionSharding::Heads,
            }
        );
        assert_eq!((p.device_index(0), p.device_index(1)), (3, 3));
        let spread = Parallel {
            gpu_id_step: 2,
            ..p
        };
        assert_eq!((spread.device_index(0), spread.device_index(1)), (3, 5));
        assert_eq!(Parallel::default().device_index(1), 1);
        s.moe_a2a_backend = Some("all-to-all".into());
        assert_eq!(
            s.to_settings().unwrap().experts,
            ExpertSharding::PartitionedAllToAll
        );
        s.moe_a2a_backend = Some("deepep".into());
        let e = s.to_settings().unwrap_err().to_string();
        assert!(
            e.contains("--moe-a2a-backend") && e.contains("'deepep'"),
            "{e}"
        );
        s.moe_a2a_backend = Some("all-to-all".into());
        s.ep_size = Some(1);
        let e = s.to_settings().unwrap_err().to_string();
        assert!(
            e.contains("--moe-a2a-backend") && e.contains("--ep-size"),
            "{e}"
        );
        let bad = ParallelSection {
            tp_size: Some(2),
            ep_size: Some(3),
            ..Default::default()
        };
        let e = bad.to_settings().unwrap_err().to_string();
        assert!(e.contains("ep_size") && e.contains("--ep-size"), "{e}");
        let zero = ParallelSection {
            tp_size: Some(0),
            ..Default::default()
        };
        assert!(zero.to_settings().is_err());
    }

    #[test]
    fn tensor_parallelism_is_refused_without_a_device_group() {
        let p = Parallel {
            tp: 2,
            ..Default::default()
        };
        let registry = Registry::builtin().unwrap();
        // A GPU backend with its own device group (cuda with --features
        // cuda) runs tensor parallelism; the others are refused.
        for device in ["cuda", "rocm"] {
            if registry.device_groups.get(device).is_ok() {
                assert!(check_supported(&registry, p, device).is_ok());
                continue;
            }
            let e = check_supported(&registry, p, device)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("--device cpu or wgpu") && e.contains(device),
                "{e}"
            );
        }
        assert!(check_supported(&registry, p, "cpu").is_ok());
        assert!(check_supported(&registry, p, "wgpu").is_ok());
    }

    /// Data parallelism: the replica count, the method, and their errors.
    #[test]
    fn data_parallel_settings_and_errors() {
        let dp = ParallelSection {
            dp_size: Some(2),
            load_balance_method: Some("shortest_queue".into()),
            ..Default::default()
        }
        .to_settings()
        .unwrap();
        assert_eq!((dp.dp, dp.balance), (2, LoadBalance::ShortestQueue));
        assert_eq!(dp.replicas(), 2);
        let dpa = ParallelSection {
            dp_size: Some(2),
            tp_size: Some(2),
            enable_dp_attention: Some(true),
            ..Default::default()
        }
        .to_settings()
        .unwrap();
        assert_eq!(
            (dpa.attention, dpa.replicas()),
            (AttentionSharding::DataParallel, 1)
        );
        for (dp, tp) in [(1, 1), (2, 1), (1, 2), (2, 4)] {
            let e = ParallelSection {
                dp_size: Some(dp),
                tp_size: Some(tp),
                enable_dp_attention: Some(true),
                ..Default::default()
            }
            .to_settings()
            .unwrap_err()
            .to_string();
            assert!(e.contains("--enable-dp-attention needs"), "{e}");
        }
        for (bad, key) in [
            (
                ParallelSection {
                    dp_size: Some(0),
                    ..Default::default()
                },
                "--dp-size",
            ),
            (
                ParallelSection {
                    load_balance_method: Some("cache_aware".into()),
                    ..Default::default()
                },
                "--load-balance-method",
            ),
        ] {
            let e = format!("{:#}", bad.to_settings().unwrap_err());
            assert!(e.contains(key), "{e}");
        }
        assert!(
            format!(
                "{:#}",
                ParallelSection {
                    load_balance_method: Some("cache_aware".into()),
                    ..Default::default()
                }
                .to_settings()
                .unwrap_err()
            )
            .contains("round_robin, shortest_queue, minimum_tokens")
        );
    }
}
