//! Tensor parallelism on the CPU (issue 20's measurement): a Llama-shaped
//! decoder with random bf16 weights (hidden 1024, 16 heads / 4 KV heads,
//! MLP 2816, 8 layers, vocab 32000) run whole on one backend with all the
//! threads (TP 1) and as two in-process ranks with half the threads each
//! (TP 2), alternating the two round by round: prefill tok/s of a 256-token
//! prompt and decode tok/s at batch 1 and 8, and the time rank 0 spends in
//! collectives per step (the communicator's cost). Each round's TP-2 step
//! runs both ranks on their own threads, as `TpExecutor` does.
//!
//! Run: `cargo bench -p arbor-models --bench tp` (ARBOR_BENCH_THREADS,
//! default 2; ARBOR_BENCH_ROUNDS, default 3).

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::comm::{Communicator, LocalGroup};
use arbor_engine_core::runner::{ModelRunner, SeqStep};
use arbor_engine_core::{
    Backend, DType, LoadOptions, QuantMethod, Registry, Result, ShardSpec, Tensor,
};
use arbor_models::DecoderConfig;
use arbor_models::decoder::{ArchFlags, DecoderModel};
use arbor_models::random::RandomWeights;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

const FLAGS: ArchFlags = ArchFlags {
    qkv_bias: false,
    qk_norm: false,
    moe: None,
    mla: false,
};

/// A communicator that adds the time spent in each collective to a counter.
struct Timed {
    inner: Arc<dyn Communicator>,
    nanos: Arc<AtomicU64>,
}

impl Timed {
    fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }
}

impl Communicator for Timed {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&self, t: &Tensor) -> Result<()> {
        self.time(|| self.inner.all_reduce(t))
    }
    fn all_gather(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        self.time(|| self.inner.all_gather(x, out))
    }
    fn reduce_scatter(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        self.time(|| self.inner.reduce_scatter(x, out))
    }
    fn all_to_all(&self, blocks: &[Tensor]) -> Result<Vec<Tensor>> {
        self.time(|| self.inner.all_to_all(blocks))
    }
    fn send(&self, x: &Tensor, to: usize) -> Result<()> {
        self.inner.send(x, to)
    }
    fn recv(&self, out: &Tensor, from: usize) -> Result<()> {
        self.inner.recv(out, from)
    }
    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }
    fn abort(&self) {
        self.inner.abort()
    }
    fn reset(&self) -> Result<()> {
        self.inner.reset()
    }
}

fn config() -> DecoderConfig {
    let v = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
        "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": false
    });
    DecoderConfig::from_json(&v, "bench").expect("config")
}

/// Runs one step on every rank at once (rank 0 on this thread).
fn step(ranks: &[ModelRunner], seqs: &[SeqStep<'_>]) {
    std::thread::scope(|s| {
        for r in &ranks[1..] {
            s.spawn(move || r.step(seqs).expect("step"));
        }
        ranks[0].step(seqs).expect("step");
    });
}

/// TP 2: two ranks with half the threads each; rank 0's collectives add
/// their time to `nanos`.
fn tp2_ranks(
    cfg: &DecoderConfig,
    src: &RandomWeights,
    quant: &Arc<dyn QuantMethod>,
    threads: usize,
    pages: usize,
    nanos: &Arc<AtomicU64>,
) -> Vec<ModelRunner> {
    let backends: Vec<Arc<dyn Backend>> = (0..2)
        .map(|_| Arc::new(CpuBackend::new((threads / 2).max(1)).expect("cpu")) as Arc<dyn Backend>)
        .collect();
    let group = LocalGroup::new(2).expect("group");
    let comms = group.ranks(&backends).expect("ranks");
    backends
        .iter()
        .zip(comms)
        .enumerate()
        .map(|(rank, (b, c))| {
            let comm: Arc<dyn Communicator> = if rank == 0 {
                Arc::new(Timed {
                    inner: c,
                    nanos: nanos.clone(),
                })
            } else {
                c
            };
            let opts = LoadOptions {
                backend: b.clone(),
                quant: quant.clone(),
                progress: None,
            };
            let shard = ShardSpec {
                comm,
                experts: Default::default(),
                attention: Default::default(),
            };
            let m = DecoderModel::load_shard(cfg.clone(), None, FLAGS, src, &opts, &shard)
                .expect("shard");
            ModelRunner::new(Arc::new(m), b.clone(), None, 16, pages, DType::F32).expect("r")
        })
        .collect()
}

fn main() {
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let threads = env("ARBOR_BENCH_THREADS", 2);
    let rounds = env("ARBOR_BENCH_ROUNDS", 3);
    let registry = Registry::builtin().expect("registry");
    let cfg = config();
    let src = RandomWeights::new(&cfg, FLAGS, DType::BF16, 1).expect("weights");
    let quant = registry.quant_methods.get("auto").expect("auto")(&Default::default()).expect("q");
    let pages = 128;
    // TP 1: one backend with every thread.
    let one: Arc<dyn Backend> = Arc::new(CpuBackend::new(threads).expect("cpu"));
    let opts = LoadOptions {
        backend: one.clone(),
        quant: quant.clone(),
        progress: None,
    };
    let model = DecoderModel::load(cfg.clone(), None, FLAGS, &src, &opts).expect("model");
    let tp1 = vec![ModelRunner::new(Arc::new(model), one, None, 16, pages, DType::F32).expect("r")];
    let nanos = Arc::new(AtomicU64::new(0));
    let tp2 = tp2_ranks(&cfg, &src, &quant, threads, pages, &nanos);
    let page_ids: Vec<u32> = (0..pages as u32).collect();
    let prompt: Vec<u32> = (0..256u32).map(|i| (i * 7919) % 32000).collect();
    // Each returns tok/s and the seconds rank 0 spent in collectives per timed step.
    let comm_secs = || nanos.swap(0, Ordering::Relaxed) as f64 / 1e9;
    let prefill = |ranks: &[ModelRunner]| -> (f64, f64) {
        comm_secs();
        let t = Instant::now();
        step(
            ranks,
            &[SeqStep {
                tokens: &prompt,
                prefix_len: 0,
                pages: &page_ids[..16],
                want_logits: true,
                state_slot: None,
            }],
        );
        (256.0 / t.elapsed().as_secs_f64(), comm_secs())
    };
    let decode = |ranks: &[ModelRunner], b: usize| -> (f64, f64) {
        for s in 0..b {
            step(
                ranks,
                &[SeqStep {
                    tokens: &prompt,
                    prefix_len: 0,
                    pages: &page_ids[s * 16..s * 16 + 16],
                    want_logits: false,
                    state_slot: None,
                }],
            );
        }
        let steps = 16;
        let toks = [[5u32]; 8];
        comm_secs();
        let t = Instant::now();
        for i in 0..steps {
            let seqs: Vec<SeqStep<'_>> = (0..b)
                .map(|s| SeqStep {
                    tokens: &toks[s],
                    prefix_len: 240 + i,
                    pages: &page_ids[s * 16..s * 16 + 16],
                    want_logits: true,
                    state_slot: None,
                })
                .collect();
            step(ranks, &seqs);
        }
        let rate = (steps * b) as f64 / t.elapsed().as_secs_f64();
        (rate, comm_secs() / steps as f64)
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "Llama 1024/16h/4kv/2816/8 layers, bf16, {threads} threads, {rounds} rounds (A B A B)"
    );
    println!(
        "| step | TP 1 tok/s | TP 2 tok/s | TP 2 / TP 1 | TP 2: rank 0 in collectives per step (incl. waiting for rank 1) |"
    );
    println!("|---|---|---|---|---|");
    type Case<'a> = (&'a str, f64, Box<dyn Fn(&[ModelRunner]) -> (f64, f64) + 'a>);
    let cases: Vec<Case<'_>> = vec![
        ("prefill 256", 256.0, Box::new(prefill)),
        (
            "decode bs1",
            1.0,
            Box::new(|r: &[ModelRunner]| decode(r, 1)),
        ),
        (
            "decode bs8",
            8.0,
            Box::new(|r: &[ModelRunner]| decode(r, 8)),
        ),
    ];
    for (name, tokens_per_step, run) in &cases {
        let (mut a, mut b, mut comm) = (Vec::new(), Vec::new(), Vec::new());
        run(&tp1);
        run(&tp2);
        for _ in 0..rounds {
            a.push(run(&tp1).0);
            let (rate, c) = run(&tp2);
            b.push(rate);
            comm.push((c, 100.0 * c * rate / tokens_per_step));
        }
        let (ma, mb) = (median(a), median(b));
        comm.sort_by(|x, y| x.0.total_cmp(&y.0));
        let (per_step, share) = comm[comm.len() / 2];
        println!(
            "| {name} | {ma:.1} | {mb:.1} | {:.2} | {:.2} ms ({share:.0}% of the step) |",
            mb / ma,
            per_step * 1e3
        );
    }
}
