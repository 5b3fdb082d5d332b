//! NCCL collectives on the device (`arbor_backend_cuda::nccl`) against a
//! serial reference computed on the host: all_reduce and reduce_scatter
//! (bit-identical to rank-order f32 sums), all_gather of one and of several
//! rows (the column layout of a vocab-parallel LM head), all_to_all with
//! blocks of different and zero row counts, send/recv around a ring, a
//! barrier, and a group that is aborted and reset. One rank on device 0
//! always; two ranks on devices 0 and 1 where the machine has them. Skipped
//! with the reason printed without a device or without NCCL (unless
//! `ARBOR_REQUIRE_NCCL=1`).

use crate::common::gpu_with;
use arbor_backend_cuda::nccl::{self, NcclComm, NcclGroup};
use arbor_backend_cuda::{GpuBackend, open};
use arbor_engine_core::comm::Communicator;
use arbor_engine_core::{Backend, BackendOptions, HostTensor, Tensor};
use std::sync::Arc;

/// `world` ranks on devices 0.. with their communicators, or `None` (printed why).
fn ranks(world: usize) -> Option<Vec<(GpuBackend, Arc<NcclComm>)>> {
    let first = gpu_with(true)?;
    if let Err(e) = nccl::library() {
        assert!(
            !std::env::var("ARBOR_REQUIRE_NCCL").is_ok_and(|v| v == "1"),
            "ARBOR_REQUIRE_NCCL=1 but NCCL did not load: {e}"
        );
        println!("skipped: {e}");
        return None;
    }
    let mut backends = vec![(*first).clone()];
    for d in 1..world {
        match open(&BackendOptions {
            device_index: d,
            disable_cuda_graph: true,
            ..Default::default()
        }) {
            Ok(b) => backends.push(b),
            Err(e) => {
                // Not a skip of the suite: the machine has fewer devices.
                println!("not run: {world} ranks need {world} devices; device {d}: {e}");
                return None;
            }
        }
    }
    let devices: Vec<usize> = (0..world).collect();
    let group = NcclGroup::new(&devices).expect("an NCCL group");
    let comms = group.ranks(&backends).expect("ranks");
    Some(backends.into_iter().zip(comms).collect())
}

fn put(b: &GpuBackend, shape: &[usize], v: &[f32]) -> Tensor {
    b.upload(&HostTensor::from_f32(shape, v)).expect("upload")
}

fn get(b: &GpuBackend, t: &Tensor) -> Vec<f32> {
    let b: &dyn Backend = b;
    b.download_f32(t).expect("download")
}

/// Rank `r`'s contribution: values that do not sum exactly in f32, so a
/// different order of addition would show.
fn contribution(r: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((r * 7919 + i * 104_729) % 1000) as f32 * 0.001_37 + 1.0 / (r + 3) as f32)
        .collect()
}

/// Σ over ranks in rank order, as the host-staged group adds.
fn rank_order_sum(world: usize, n: usize) -> Vec<f32> {
    let mut acc = contribution(0, n);
    for r in 1..world {
        for (a, b) in acc.iter_mut().zip(contribution(r, n)) {
            *a += b;
        }
    }
    acc
}

/// Every collective on one rank of a group of `world`.
fn exercise(b: &GpuBackend, c: &NcclComm) {
    let (r, w) = (c.rank(), c.world_size());
    // all_reduce of a [5, 9] tensor.
    let t = put(b, &[5, 9], &contribution(r, 45));
    c.all_reduce(&t).expect("all_reduce");
    assert_eq!(get(b, &t), rank_order_sum(w, 45), "all_reduce on rank {r}");

    // all_gather of one row and of three rows.
    for m in [1usize, 3] {
        let n = 4;
        let x = put(b, &[m, n], &contribution(r, m * n));
        let out = b.alloc(arbor_engine_core::DType::F32, &[m, n * w]).unwrap();
        c.all_gather(&x, &out).expect("all_gather");
        let mut want = Vec::new();
        for row in 0..m {
            for s in 0..w {
                want.extend_from_slice(&contribution(s, m * n)[row * n..(row + 1) * n]);
            }
        }
        assert_eq!(get(b, &out), want, "all_gather of {m} rows on rank {r}");
    }

    // reduce_scatter of [2w, 6]: this rank's two rows of the sum.
    let (m, n) = (2 * w, 6);
    let x = put(b, &[m, n], &contribution(r, m * n));
    let out = b.alloc(arbor_engine_core::DType::F32, &[2, n]).unwrap();
    c.reduce_scatter(&x, &out).expect("reduce_scatter");
    let sum = rank_order_sum(w, m * n);
    assert_eq!(
        get(b, &out),
        sum[r * 2 * n..(r + 1) * 2 * n],
        "reduce_scatter on rank {r}"
    );

    // all_to_all: (s + j) % 3 rows from rank s to rank j (some empty).
    let d = 5;
    let block = |s: usize, j: usize| -> Vec<f32> {
        let rows = (s + j) % 3;
        (0..rows * d)
            .map(|i| (s * 100 + j * 10) as f32 + i as f32 * 0.5)
            .collect()
    };
    let blocks: Vec<Tensor> = (0..w)
        .map(|j| put(b, &[(r + j) % 3, d], &block(r, j)))
        .collect();
    let got = c.all_to_all(&blocks).expect("all_to_all");
    assert_eq!(got.len(), w);
    for (s, g) in got.iter().enumerate() {
        assert_eq!(g.shape(), [(s + r) % 3, d], "from rank {s} on rank {r}");
        assert_eq!(get(b, g), block(s, r), "from rank {s} on rank {r}");
    }

    // send/recv around a ring.
    if w > 1 {
        let x = put(b, &[1, 7], &contribution(r, 7));
        let from = (r + w - 1) % w;
        let got = b.alloc(arbor_engine_core::DType::F32, &[1, 7]).unwrap();
        c.send(&x, (r + 1) % w).expect("send");
        c.recv(&got, from).expect("recv");
        assert_eq!(get(b, &got), contribution(from, 7), "recv on rank {r}");
    }
    c.barrier().expect("barrier");
}

fn run(world: usize) {
    let Some(ranks) = ranks(world) else { return };
    std::thread::scope(|s| {
        for (b, c) in &ranks {
            s.spawn(move || exercise(b, c));
        }
    });
    // An aborted group fails its collectives until it is reset.
    let (b0, c0) = &ranks[0];
    c0.abort();
    let t = put(b0, &[1, 3], &[1.0, 2.0, 3.0]);
    let e = c0.all_reduce(&t).unwrap_err().to_string();
    assert!(e.contains("aborted"), "{e}");
    c0.reset().expect("reset");
    std::thread::scope(|s| {
        for (b, c) in &ranks {
            s.spawn(move || exercise(b, c));
        }
    });
    println!("NCCL collectives of {world} rank(s) match the serial reference");
}

#[test]
fn nccl_collectives_of_one_rank() {
    run(1);
}

#[test]
fn nccl_collectives_of_two_ranks_on_two_devices() {
    run(2);
}
