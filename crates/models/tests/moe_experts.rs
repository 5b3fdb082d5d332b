//! The grouped expert computation (`moe::routing::run_experts`) on the CPU backend:
//! equal to an f64 host forward of the same weights written from the
//! definition (`Σ_k w_k · down(silu(gate x) ⊙ up x)`), bit-identical to the
//! per-token loop and to itself inside any batch (a row's output depends on
//! that row only), with experts absent from this device (expert
//! parallelism) contributing nothing, and shape errors refused.

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::{Backend, DType, SeqRng};
use arbor_models::moe::routing::{
    ExpertWeights, MoeRouting, RouterScoring, route, run_experts, run_experts_per_token,
};

fn values(rng: &mut SeqRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.next_f32() * 2.0 - 1.0) * scale)
        .collect()
}

struct Case {
    b: CpuBackend,
    h: usize,
    inter: usize,
    /// Host copies of each expert's (gate, up, down).
    host: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>,
    experts: Vec<Option<ExpertWeights>>,
}

fn case(num_experts: usize, h: usize, inter: usize, seed: u64) -> Case {
    let b = CpuBackend::new(2).expect("cpu");
    let mut rng = SeqRng::new(seed);
    let mut host = Vec::new();
    let mut experts = Vec::new();
    for _ in 0..num_experts {
        let g = values(&mut rng, inter * h, 0.3);
        let u = values(&mut rng, inter * h, 0.3);
        let d = values(&mut rng, h * inter, 0.3);
        let dynb: &dyn Backend = &b;
        experts.push(Some(ExpertWeights::new(
            dynb.upload_f32(&[inter, h], &g).expect("upload"),
            dynb.upload_f32(&[inter, h], &u).expect("upload"),
            dynb.upload_f32(&[h, inter], &d).expect("upload"),
        )));
        host.push((g, u, d));
    }
    Case {
        b,
        h,
        inter,
        host,
        experts,
    }
}

fn reference(c: &Case, x: &[f32], r: &MoeRouting, present: &[bool]) -> Vec<f64> {
    let (h, inter) = (c.h, c.inter);
    let mut out = vec![0f64; x.len()];
    for t in 0..r.tokens() {
        let xr = &x[t * h..(t + 1) * h];
        for j in 0..r.top_k {
            let e = r.experts[t * r.top_k + j] as usize;
            if !present[e] {
                continue;
            }
            let (g, u, d) = &c.host[e];
            let dot = |w: &[f32], row: usize, v: &[f64]| -> f64 {
                (0..v.len())
                    .map(|i| w[row * v.len() + i] as f64 * v[i])
                    .sum()
            };
            let xd: Vec<f64> = xr.iter().map(|&v| v as f64).collect();
            let act: Vec<f64> = (0..inter)
                .map(|i| {
                    let a = dot(g, i, &xd);
                    a / (1.0 + (-a).exp()) * dot(u, i, &xd)
                })
                .collect();
            for o in 0..h {
                out[t * h + o] += r.weights[t * r.top_k + j] as f64 * dot(d, o, &act);
            }
        }
    }
    out
}

fn run(c: &Case, x: &[f32], r: &MoeRouting, grouped: bool) -> Vec<f32> {
    let b: &dyn Backend = &c.b;
    let t = x.len() / c.h;
    let xt = b.upload_f32(&[t, c.h], x).expect("x");
    let out = b.alloc(DType::F32, &[t, c.h]).expect("out");
    if grouped {
        run_experts(b, &xt, r, &c.experts, &out).expect("grouped");
    } else {
        run_experts_per_token(b, &xt, r, &c.experts, &out).expect("per token");
    }
    b.download_f32(&out).expect("download")
}

#[test]
fn grouped_experts_match_the_definition_and_the_per_token_loop() {
    let (n_exp, h, inter, t, k) = (8, 64, 48, 13, 3);
    let c = case(n_exp, h, inter, 7);
    let mut rng = SeqRng::new(99);
    let x = values(&mut rng, t * h, 1.0);
    let logits = values(&mut rng, t * n_exp, 2.0);
    let r = route(
        &logits,
        n_exp,
        k,
        &RouterScoring::SoftmaxTopK { renormalize: true },
    )
    .expect("route");
    let grouped = run(&c, &x, &r, true);
    let want = reference(&c, &x, &r, &[true; 8]);
    let max = want.iter().fold(0f64, |a, b| a.max(b.abs()));
    let err = grouped
        .iter()
        .zip(&want)
        .fold(0f64, |a, (&g, &w)| a.max((g as f64 - w).abs()));
    assert!(err <= 1e-5 * max, "error {err} of max {max}");
    assert_eq!(grouped, run(&c, &x, &r, false), "grouped != per-token loop");
    // Row 5 alone gives the same bits as inside the batch.
    let one = MoeRouting {
        num_experts: n_exp,
        top_k: k,
        experts: r.experts[5 * k..6 * k].to_vec(),
        weights: r.weights[5 * k..6 * k].to_vec(),
    };
    assert_eq!(run(&c, &x[5 * h..6 * h], &one, true), grouped[5 * h..6 * h]);
}

#[test]
fn absent_experts_contribute_nothing_and_shares_add_up() {
    let (n_exp, h, inter, t, k) = (4, 32, 32, 6, 2);
    let mut c = case(n_exp, h, inter, 3);
    let mut rng = SeqRng::new(5);
    let x = values(&mut rng, t * h, 1.0);
    let logits = values(&mut rng, t * n_exp, 2.0);
    let r = route(
        &logits,
        n_exp,
        k,
        &RouterScoring::SoftmaxTopK { renormalize: false },
    )
    .expect("route");
    let full = run(&c, &x, &r, true);
    let all = c.experts.clone();
    // Two "ranks", each holding two experts.
    c.experts = vec![all[0].clone(), all[1].clone(), None, None];
    let first = run(&c, &x, &r, true);
    let want = reference(&c, &x, &r, &[true, true, false, false]);
    assert!(
        first
            .iter()
            .zip(&want)
            .all(|(&a, &b)| (a as f64 - b).abs() < 1e-4)
    );
    c.experts = vec![None, None, all[2].clone(), all[3].clone()];
    let second = run(&c, &x, &r, true);
    for ((f, a), b) in full.iter().zip(&first).zip(&second) {
        assert!(
            (f - (a + b)).abs() <= 1e-5 * f.abs().max(1.0),
            "{f} != {a} + {b}"
        );
    }
}

#[test]
fn mismatched_shapes_are_refused() {
    let c = case(4, 32, 16, 1);
    let b: &dyn Backend = &c.b;
    let x = b.alloc(DType::F32, &[3, 32]).expect("x");
    let out = b.alloc(DType::F32, &[3, 32]).expect("out");
    let r = route(
        &[0.0; 8],
        4,
        2,
        &RouterScoring::SoftmaxTopK { renormalize: true },
    )
    .expect("route");
    // A routing of 2 tokens for 3 rows.
    assert!(run_experts(b, &x, &r, &c.experts, &out).is_err());
    let r3 = route(
        &[0.0; 12],
        4,
        2,
        &RouterScoring::SoftmaxTopK { renormalize: true },
    )
    .expect("route");
    // Three expert slots for a routing over four experts.
    assert!(run_experts(b, &x, &r3, &c.experts[..3], &out).is_err());
    let rows = b.upload_u32(&[1], &[7]).expect("rows");
    let s = b.upload_f32(&[1], &[1.0]).expect("scales");
    let y = b.alloc(DType::F32, &[1, 32]).expect("y");
    assert!(
        b.scatter_add_rows(&out, &rows, &s, &y).is_err(),
        "row 7 of 3"
    );
}
