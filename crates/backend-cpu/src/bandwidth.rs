//! Measures sustained memory read bandwidth, the bound of batch-1 decode
//! (every weight byte is read once per token).

use crate::pool::{ThreadPool, share};
use std::time::Instant;

/// Reads `bytes` bytes `rounds` times with `threads` threads; returns the best GB/s.
pub fn read_bandwidth_gbs(bytes: usize, rounds: usize, threads: usize) -> f64 {
    let n = bytes / 8;
    let data: Vec<u64> = (0..n as u64).collect();
    let Ok(pool) = ThreadPool::new(threads) else {
        return 0.0;
    };
    let mut best = 0.0f64;
    let sink = std::sync::atomic::AtomicU64::new(0);
    for _ in 0..rounds.max(1) {
        let t = Instant::now();
        pool.run(&|i, nt| {
            let (a, b) = share(n, i, nt, 64);
            let mut acc = [0u64; 8];
            for chunk in data[a..b].chunks_exact(8) {
                for l in 0..8 {
                    acc[l] = acc[l].wrapping_add(chunk[l]);
                }
            }
            let s = acc.iter().fold(0u64, |x, y| x.wrapping_add(*y));
            sink.fetch_add(s, std::sync::atomic::Ordering::Relaxed);
        });
        let gbs = (n * 8) as f64 / t.elapsed().as_secs_f64() / 1e9;
        best = best.max(gbs);
    }
    std::hint::black_box(sink.load(std::sync::atomic::Ordering::Relaxed));
    best
}
