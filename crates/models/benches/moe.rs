//! Mixture-of-experts block throughput on a Qwen3-MoE-shaped layer with
//! random weights (issue 20's measurement): 64 experts, top-8, hidden 2048,
//! expert width 768, bf16 weights. For each token count (decode batches of 1
//! and 8, prefill chunks of 64 and 256) it times one block — the router
//! GEMM, top-k routing, and the experts — with the grouped expert GEMM
//! (`arbor_models::moe::routing::run_experts`) and with the per-token loop
//! (`routing::run_experts_per_token`), alternating the two round by round, and
//! prints median tok/s and their ratio.
//!
//! Then expert parallelism over two in-process ranks (each a CPU backend
//! with half the threads, holding half the experts, as `--tp-size 2
//! --ep-size 2` runs them): the same block with the experts' shares
//! all-reduced (`--moe-a2a-backend none`: every rank routes every token)
//! and with all-to-all dispatch and combine (`--moe-a2a-backend
//! all-to-all`), alternated round by round.
//!
//! Run: `cargo bench -p arbor-models --bench moe` (ARBOR_BENCH_THREADS,
//! default 2; ARBOR_BENCH_ROUNDS, default 5).

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::comm::{Communicator, LocalGroup};
use arbor_engine_core::{Backend, DType, HostTensor, SeqRng, Tensor};
use arbor_models::moe::all_to_all::{all_gather_rows, run_experts_all_to_all, token_block};
use arbor_models::moe::routing::{
    ExpertWeights, RouterScoring, route, run_experts, run_experts_per_token,
};
use std::sync::Arc;
use std::time::Instant;

const EXPERTS: usize = 64;
const TOP_K: usize = 8;
const HIDDEN: usize = 2048;
const INTER: usize = 768;

fn random(
    b: &dyn Backend,
    rng: &mut SeqRng,
    shape: &[usize],
    dtype: DType,
    scale: f32,
) -> arbor_engine_core::Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| (rng.next_f32() * 2.0 - 1.0) * scale)
        .collect();
    let t = HostTensor::from_f32(shape, &v).cast(dtype).expect("cast");
    b.upload(&t).expect("upload")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let threads = env("ARBOR_BENCH_THREADS", 2);
    let rounds = env("ARBOR_BENCH_ROUNDS", 5);
    let cpu = CpuBackend::new(threads).expect("cpu");
    let b: &dyn Backend = &cpu;
    let mut rng = SeqRng::new(20);
    let router = random(b, &mut rng, &[EXPERTS, HIDDEN], DType::F32, 0.05);
    let experts: Vec<Option<ExpertWeights>> = (0..EXPERTS)
        .map(|_| {
            Some(ExpertWeights::new(
                random(b, &mut rng, &[INTER, HIDDEN], DType::BF16, 0.03),
                random(b, &mut rng, &[INTER, HIDDEN], DType::BF16, 0.03),
                random(b, &mut rng, &[HIDDEN, INTER], DType::BF16, 0.03),
            ))
        })
        .collect();
    println!(
        "MoE block: {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, expert width {INTER}, bf16 weights, {threads} threads, {rounds} rounds"
    );
    println!("| tokens | grouped tok/s | per-token loop tok/s | grouped / loop | experts hit |");
    println!("|---|---|---|---|---|");
    let scoring = RouterScoring::SoftmaxTopK { renormalize: true };
    for t in [1usize, 8, 64, 256] {
        let x = random(b, &mut rng, &[t, HIDDEN], DType::F32, 1.0);
        let out = b.alloc(DType::F32, &[t, HIDDEN]).expect("out");
        let logits = b.alloc(DType::F32, &[t, EXPERTS]).expect("logits");
        let block = |grouped: bool| -> (f64, usize) {
            let start = Instant::now();
            b.linear(&x, &router, None, &logits).expect("router");
            let r = route(
                &b.download_f32(&logits).expect("logits"),
                EXPERTS,
                TOP_K,
                &scoring,
            )
            .expect("route");
            if grouped {
                run_experts(b, &x, &r, &experts, &out).expect("grouped");
            } else {
                run_experts_per_token(b, &x, &r, &experts, &out).expect("loop");
            }
            b.synchronize().expect("sync");
            (start.elapsed().as_secs_f64(), r.groups().len())
        };
        block(true);
        let (mut a, mut l, mut hit) = (Vec::new(), Vec::new(), 0);
        for _ in 0..rounds {
            let (s, h) = block(true);
            a.push(t as f64 / s);
            hit = h;
            l.push(t as f64 / block(false).0);
        }
        let (ga, gl) = (median(a), median(l));
        println!("| {t} | {ga:.1} | {gl:.1} | {:.2} | {hit} |", ga / gl);
    }
    expert_parallel(threads, rounds);
}

/// One rank of the expert-parallel comparison.
struct Rank {
    b: Arc<dyn Backend>,
    comm: Arc<dyn Communicator>,
    router: Tensor,
    experts: Vec<Option<ExpertWeights>>,
}

impl Rank {
    fn route(&self, x: &Tensor) -> arbor_models::moe::routing::MoeRouting {
        let logits = self
            .b
            .alloc(DType::F32, &[x.rows(), EXPERTS])
            .expect("logits");
        if x.rows() > 0 {
            self.b
                .linear(x, &self.router, None, &logits)
                .expect("router");
        }
        let l = self.b.download_f32(&logits).expect("logits");
        route(
            &l,
            EXPERTS,
            TOP_K,
            &RouterScoring::SoftmaxTopK { renormalize: true },
        )
        .expect("route")
    }

    /// One block, the whole output on this rank.
    fn block(&self, x: &Tensor, out: &Tensor, all_to_all: bool) {
        let b = self.b.as_ref();
        let c = self.comm.as_ref();
        if all_to_all {
            let mine = token_block(x.rows(), c.rank(), c.world_size());
            let xo = x.narrow(mine.start, mine.len()).expect("narrow");
            let r = self.route(&xo);
            let own = b.alloc(DType::F32, &[mine.len(), HIDDEN]).expect("own");
            run_experts_all_to_all(b, c, &xo, &r, &self.experts, None, &own).expect("a2a");
            all_gather_rows(b, c, &own, out).expect("gather");
        } else {
            let r = self.route(x);
            run_experts(b, x, &r, &self.experts, out).expect("experts");
            c.all_reduce(out).expect("all_reduce");
        }
    }
}

/// Expert parallelism over two ranks: all-reduce against all-to-all.
fn expert_parallel(threads: usize, rounds: usize) {
    let world = 2;
    let backends: Vec<Arc<dyn Backend>> = (0..world)
        .map(|_| {
            Arc::new(CpuBackend::new((threads / world).max(1)).expect("cpu")) as Arc<dyn Backend>
        })
        .collect();
    let comms = LocalGroup::new(world)
        .expect("group")
        .ranks(&backends)
        .expect("ranks");
    let per = EXPERTS / world;
    let ranks: Vec<Rank> = backends
        .iter()
        .zip(comms)
        .enumerate()
        .map(|(r, (b, c))| {
            let mut rng = SeqRng::new(20);
            let router = random(b.as_ref(), &mut rng, &[EXPERTS, HIDDEN], DType::F32, 0.05);
            let experts = (0..EXPERTS)
                .map(|e| {
                    let w = [
                        random(b.as_ref(), &mut rng, &[INTER, HIDDEN], DType::BF16, 0.03),
                        random(b.as_ref(), &mut rng, &[INTER, HIDDEN], DType::BF16, 0.03),
                        random(b.as_ref(), &mut rng, &[HIDDEN, INTER], DType::BF16, 0.03),
                    ];
                    (e / per == r).then(|| {
                        let [gate, up, down] = w;
                        ExpertWeights::new(gate, up, down)
                    })
                })
                .collect();
            Rank {
                b: b.clone(),
                comm: c as Arc<dyn Communicator>,
                router,
                experts,
            }
        })
        .collect();
    println!();
    println!(
        "Expert parallelism, {world} in-process ranks of {} thread(s), {per} experts each:",
        (threads / world).max(1)
    );
    println!("| tokens | all-reduce tok/s | all-to-all tok/s | all-to-all / all-reduce |");
    println!("|---|---|---|---|");
    let mut rng = SeqRng::new(21);
    for t in [1usize, 8, 64, 256] {
        let xs: Vec<f32> = (0..t * HIDDEN)
            .map(|_| rng.next_f32() * 2.0 - 1.0)
            .collect();
        let inputs: Vec<(Tensor, Tensor)> = ranks
            .iter()
            .map(|r| {
                (
                    r.b.upload_f32(&[t, HIDDEN], &xs).expect("x"),
                    r.b.alloc(DType::F32, &[t, HIDDEN]).expect("out"),
                )
            })
            .collect();
        // Both ranks on their own threads, as `TpExecutor` runs them.
        let step = |a2a: bool| -> f64 {
            let start = Instant::now();
            std::thread::scope(|s| {
                for (r, (x, out)) in ranks.iter().zip(&inputs) {
                    s.spawn(move || r.block(x, out, a2a));
                }
            });
            start.elapsed().as_secs_f64()
        };
        step(false);
        step(true);
        let (mut ar, mut aa) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            ar.push(t as f64 / step(false));
            aa.push(t as f64 / step(true));
        }
        let (ar, aa) = (median(ar), median(aa));
        println!("| {t} | {ar:.1} | {aa:.1} | {:.2} |", aa / ar);
    }
}
