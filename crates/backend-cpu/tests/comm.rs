//! The in-process communicator (`comm::LocalGroup`) against a serial
//! reference: three ranks on three threads, each with its own CPU backend,
//! run every collective on seeded data; results must equal what one thread
//! computes from all the inputs (sums in rank order, bit for bit, the same on
//! every rank). An aborted collective wakes the ranks waiting in it.

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::comm::{Communicator, LocalGroup};
use arbor_engine_core::{Backend, DType, SeqRng};
use std::sync::Arc;

const WORLD: usize = 3;

fn data(rank: usize, n: usize) -> Vec<f32> {
    let mut rng = SeqRng::new(100 + rank as u64);
    (0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect()
}

fn serial_sum(n: usize) -> Vec<f32> {
    let mut acc = data(0, n);
    for r in 1..WORLD {
        for (a, b) in acc.iter_mut().zip(data(r, n)) {
            *a += b;
        }
    }
    acc
}

fn group() -> Vec<(Arc<dyn Backend>, Arc<dyn Communicator>)> {
    let backends: Vec<Arc<dyn Backend>> = (0..WORLD)
        .map(|_| Arc::new(CpuBackend::new(1).expect("cpu")) as Arc<dyn Backend>)
        .collect();
    let g = LocalGroup::new(WORLD).expect("group");
    let comms = g.ranks(&backends).expect("ranks");
    backends
        .into_iter()
        .zip(comms)
        .map(|(b, c)| (b, c as Arc<dyn Communicator>))
        .collect()
}

#[test]
fn collectives_match_a_serial_reference() {
    let (m, n) = (6, 5);
    let ranks = group();
    std::thread::scope(|s| {
        for (b, c) in &ranks {
            s.spawn(move || {
                let r = c.rank();
                // all_reduce, twice in a row (rounds must not mix).
                for _ in 0..2 {
                    let t = b.upload_f32(&[m, n], &data(r, m * n)).expect("t");
                    c.all_reduce(&t).expect("all_reduce");
                    assert_eq!(b.download_f32(&t).expect("d"), serial_sum(m * n));
                }
                // all_gather along the last dimension.
                let x = b.upload_f32(&[m, n], &data(r, m * n)).expect("x");
                let out = b.alloc(DType::F32, &[m, n * WORLD]).expect("out");
                c.all_gather(&x, &out).expect("all_gather");
                let got = b.download_f32(&out).expect("d");
                for row in 0..m {
                    for src in 0..WORLD {
                        let want = &data(src, m * n)[row * n..(row + 1) * n];
                        let at = row * n * WORLD + src * n;
                        assert_eq!(&got[at..at + n], want);
                    }
                }
                // reduce_scatter: this rank's rows of the sum.
                let rows = WORLD * 2;
                let x = b.upload_f32(&[rows, n], &data(r, rows * n)).expect("x");
                let out = b.alloc(DType::F32, &[2, n]).expect("out");
                c.reduce_scatter(&x, &out).expect("reduce_scatter");
                let sum = serial_sum(rows * n);
                assert_eq!(
                    b.download_f32(&out).expect("d"),
                    sum[r * 2 * n..(r + 1) * 2 * n]
                );
                // all_to_all with a different row count per pair.
                let blocks: Vec<_> = (0..WORLD)
                    .map(|to| {
                        let k = r + to + 1;
                        b.upload_f32(&[k, n], &vec![(r * 10 + to) as f32; k * n])
                            .expect("block")
                    })
                    .collect();
                let got = c.all_to_all(&blocks).expect("all_to_all");
                for (src, t) in got.iter().enumerate() {
                    assert_eq!(t.rows(), src + r + 1);
                    let v = b.download_f32(t).expect("d");
                    assert!(v.iter().all(|&x| x == (src * 10 + r) as f32));
                }
                // A ring of send/recv.
                let next = (r + 1) % WORLD;
                let prev = (r + WORLD - 1) % WORLD;
                let x = b.upload_f32(&[n], &data(r, n)).expect("x");
                c.send(&x, next).expect("send");
                let out = b.alloc(DType::F32, &[n]).expect("out");
                c.recv(&out, prev).expect("recv");
                assert_eq!(b.download_f32(&out).expect("d"), data(prev, n));
                c.barrier().expect("barrier");
            });
        }
    });
}

#[test]
fn an_abort_wakes_the_waiting_ranks_and_reset_recovers() {
    let ranks = group();
    std::thread::scope(|s| {
        for (b, c) in &ranks {
            s.spawn(move || {
                let t = b.upload_f32(&[4], &[1.0; 4]).expect("t");
                if c.rank() == 2 {
                    // This rank fails before the collective.
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    c.abort();
                } else {
                    let e = c.all_reduce(&t).expect_err("aborted");
                    assert!(e.to_string().contains("aborted"), "{e}");
                }
            });
        }
    });
    ranks[0].1.reset().expect("reset");
    std::thread::scope(|s| {
        for (b, c) in &ranks {
            s.spawn(move || {
                let t = b.upload_f32(&[4], &[1.0; 4]).expect("t");
                c.all_reduce(&t).expect("after reset");
                assert_eq!(b.download_f32(&t).expect("d"), vec![3.0; 4]);
            });
        }
    });
}

#[test]
fn bad_arguments_are_refused() {
    let ranks = group();
    let (b, c) = &ranks[0];
    let x = b.alloc(DType::F32, &[2, 2]).expect("x");
    let out = b.alloc(DType::F32, &[2, 5]).expect("out");
    assert!(c.all_gather(&x, &out).is_err());
    assert!(c.send(&x, 0).is_err(), "send to itself");
    assert!(c.recv(&x, 7).is_err(), "rank 7 of 3");
    assert!(c.all_to_all(std::slice::from_ref(&x)).is_err());
    assert!(LocalGroup::new(0).is_err());
}
