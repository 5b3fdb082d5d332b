//! Mixture-of-experts block throughput on a Qwen3-MoE-shaped layer with
//! random weights (issue 20's measurement): 64 experts, top-8, hidden 2048,
//! expert width 768, bf16 weights. For each token count (decode batches of 1
//! and 8, prefill chunks of 64 and 256) it times one block — the router
//! GEMM, top-k routing, and the experts — with the grouped expert GEMM
//! (`moe::run_experts`) and with the per-token loop
//! (`moe::run_experts_per_token`), alternating the two round by round, and
//! prints median tok/s and their ratio.
//!
//! Run: `cargo bench -p arbor-models --bench moe` (ARBOR_BENCH_THREADS,
//! default 2; ARBOR_BENCH_ROUNDS, default 5).

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::moe::{
    ExpertWeights, RouterScoring, route, run_experts, run_experts_per_token,
};
use arbor_engine_core::{Backend, DType, HostTensor, SeqRng};
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
            Some(ExpertWeights {
                gate: random(b, &mut rng, &[INTER, HIDDEN], DType::BF16, 0.03),
                up: random(b, &mut rng, &[INTER, HIDDEN], DType::BF16, 0.03),
                down: random(b, &mut rng, &[HIDDEN, INTER], DType::BF16, 0.03),
            })
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
}
