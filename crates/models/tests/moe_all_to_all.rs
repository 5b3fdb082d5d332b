//! Expert parallelism with all-to-all dispatch and combine
//! (`moe::all_to_all`) against the one-device grouped experts
//! (`moe::routing::run_experts`): 8 experts with random f32 weights, top-2 and top-3
//! softmax routing, on 2 and 4 ranks (threads, each with its own CPU backend
//! holding only its experts), for batches of 0 to 33 tokens — fewer tokens
//! than ranks included. Every rank's gathered output must equal the
//! one-device output bit for bit, and the ranks' expert counts, merged by
//! maximum as `TpExecutor` does, the one-device routing's load. Bad calls
//! are errors that name what is wrong.

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::comm::{Communicator, LocalGroup};
use arbor_engine_core::{Backend, DType, SeqRng};
use arbor_models::moe::all_to_all::{all_gather_rows, run_experts_all_to_all, token_block};
use arbor_models::moe::routing::{
    ExpertCounter, ExpertWeights, MoeRouting, RouterScoring, route, run_experts,
};
use std::sync::Arc;

const EXPERTS: usize = 8;
const HIDDEN: usize = 32;
const INTER: usize = 24;

fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = SeqRng::new(seed);
    (0..n)
        .map(|_| (rng.next_f32() * 2.0 - 1.0) * scale)
        .collect()
}

/// Expert `e`'s weights on `b`.
fn expert(b: &dyn Backend, e: usize) -> ExpertWeights {
    let up = |seed: u64, shape: &[usize]| {
        b.upload_f32(shape, &values(seed, shape[0] * shape[1], 0.3))
            .expect("upload")
    };
    ExpertWeights::new(
        up(1000 + 3 * e as u64, &[INTER, HIDDEN]),
        up(1001 + 3 * e as u64, &[INTER, HIDDEN]),
        up(1002 + 3 * e as u64, &[HIDDEN, INTER]),
    )
}

fn routing(tokens: usize, top_k: usize, seed: u64) -> MoeRouting {
    let logits = values(seed, tokens * EXPERTS, 2.0);
    route(
        &logits,
        EXPERTS,
        top_k,
        &RouterScoring::SoftmaxTopK { renormalize: true },
    )
    .expect("route")
}

/// The routing of rows `r` of a batch's routing.
fn rows_of(all: &MoeRouting, r: std::ops::Range<usize>) -> MoeRouting {
    let k = all.top_k;
    MoeRouting {
        num_experts: all.num_experts,
        top_k: k,
        experts: all.experts[r.start * k..r.end * k].to_vec(),
        weights: all.weights[r.start * k..r.end * k].to_vec(),
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn dispatch_and_combine_match_one_device_bit_for_bit() {
    let one: Arc<dyn Backend> = Arc::new(CpuBackend::new(1).expect("cpu"));
    let all: Vec<Option<ExpertWeights>> = (0..EXPERTS)
        .map(|e| Some(expert(one.as_ref(), e)))
        .collect();
    for world in [2usize, 4] {
        let backends: Vec<Arc<dyn Backend>> = (0..world)
            .map(|_| Arc::new(CpuBackend::new(1).expect("cpu")) as Arc<dyn Backend>)
            .collect();
        let comms = LocalGroup::new(world)
            .expect("group")
            .ranks(&backends)
            .expect("ranks");
        let per = EXPERTS / world;
        for top_k in [2usize, 3] {
            for tokens in [0usize, 1, 3, 8, 33] {
                let seed = (world * 100 + top_k * 10 + tokens) as u64;
                let x_host = values(seed, tokens * HIDDEN, 1.0);
                let r = routing(tokens, top_k, seed + 7);
                let want = {
                    let x = one.upload_f32(&[tokens, HIDDEN], &x_host).expect("x");
                    let out = one.alloc(DType::F32, &[tokens, HIDDEN]).expect("out");
                    if tokens > 0 {
                        run_experts(one.as_ref(), &x, &r, &all, &out).expect("one device");
                    }
                    one.download_f32(&out).expect("download")
                };
                let results: Vec<(Vec<f32>, Vec<u64>)> = std::thread::scope(|s| {
                    let handles: Vec<_> = backends
                        .iter()
                        .zip(&comms)
                        .map(|(b, c)| {
                            let (x_host, r) = (&x_host, &r);
                            s.spawn(move || {
                                let rank = c.rank();
                                let mine: Vec<Option<ExpertWeights>> = (0..EXPERTS)
                                    .map(|e| (e / per == rank).then(|| expert(b.as_ref(), e)))
                                    .collect();
                                let x = b.upload_f32(&[tokens, HIDDEN], x_host).expect("x");
                                let block = token_block(tokens, rank, world);
                                let xo = x.narrow(block.start, block.len()).expect("narrow");
                                let own = b.alloc(DType::F32, &[block.len(), HIDDEN]).expect("own");
                                let load = ExpertCounter::new(EXPERTS);
                                run_experts_all_to_all(
                                    b.as_ref(),
                                    c.as_ref(),
                                    &xo,
                                    &rows_of(r, block),
                                    &mine,
                                    Some(&load),
                                    &own,
                                )
                                .expect("all-to-all");
                                let out = b.alloc(DType::F32, &[tokens, HIDDEN]).expect("out");
                                all_gather_rows(b.as_ref(), c.as_ref(), &own, &out)
                                    .expect("gather");
                                (b.download_f32(&out).expect("download"), load.snapshot())
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().expect("rank"))
                        .collect()
                });
                let mut merged = vec![0u64; EXPERTS];
                for (rank, (out, load)) in results.iter().enumerate() {
                    assert_eq!(
                        bits(out),
                        bits(&want),
                        "world {world}, top {top_k}, {tokens} tokens: rank {rank}'s output"
                    );
                    for (e, (m, &l)) in merged.iter_mut().zip(load).enumerate() {
                        if e / per != rank {
                            assert_eq!(l, 0, "rank {rank} counted another rank's expert {e}");
                        }
                        *m = (*m).max(l);
                    }
                }
                assert_eq!(merged, r.load(), "world {world}, {tokens} tokens: load");
            }
        }
    }
}

#[test]
fn bad_calls_are_named_errors() {
    let b: Arc<dyn Backend> = Arc::new(CpuBackend::new(1).expect("cpu"));
    let solo = LocalGroup::new(1).expect("group");
    let c = solo
        .ranks(std::slice::from_ref(&b))
        .expect("ranks")
        .remove(0);
    let x = b
        .upload_f32(&[2, HIDDEN], &values(1, 2 * HIDDEN, 1.0))
        .expect("x");
    let out = b.alloc(DType::F32, &[2, HIDDEN]).expect("out");
    let r = routing(2, 2, 3);
    // The only rank must hold every expert.
    let mut experts: Vec<Option<ExpertWeights>> =
        (0..EXPERTS).map(|e| Some(expert(b.as_ref(), e))).collect();
    experts[5] = None;
    let e = run_experts_all_to_all(b.as_ref(), c.as_ref(), &x, &r, &experts, None, &out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not hold its expert 5"), "{e}");
    // A routing of another batch size.
    let e = run_experts_all_to_all(
        b.as_ref(),
        c.as_ref(),
        &x,
        &routing(3, 2, 3),
        &experts,
        None,
        &out,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("routing of 3 tokens"), "{e}");
    // Experts that do not divide over the ranks.
    let trio = LocalGroup::new(3).expect("group");
    let bs = vec![b.clone(), b.clone(), b.clone()];
    let c3 = trio.ranks(&bs).expect("ranks").remove(0);
    let e = run_experts_all_to_all(b.as_ref(), c3.as_ref(), &x, &r, &experts, None, &out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("8 experts over 3 ranks"), "{e}");
    // A block that is not the rank's share of the batch.
    let e = all_gather_rows(b.as_ref(), c.as_ref(), &x.narrow(0, 1).expect("n"), &out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 0's block"), "{e}");
}
