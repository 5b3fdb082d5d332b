//! GEMV throughput of `dot_rows` in GB/s of weight bytes, single thread, at
//! m = 1 and m = 8, on SmolLM2-135M shapes: 576 rows x k=1536 (ffn_down) and
//! 49152 rows x k=576 (the tied embedding / LM head; k=512 for the K formats,
//! whose rows must be multiples of 256).
//!
//! Run: `cargo bench -p arbor-quant --bench dot` (add `-- q4_1` to filter;
//! `ARBOR_QUANT_SIMD=avx2|scalar` lowers the SIMD level).
#![allow(clippy::unwrap_used)]

use arbor_quant::{DType, dot_rows, prepare_acts, row_bytes};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::time::Duration;

const FORMATS: [DType; 13] = [
    DType::Q4_1,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q6_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q2_K,
    DType::Q3_K,
    DType::F32,
    DType::F16,
    DType::BF16,
];

fn lcg(s: &mut u64) -> u64 {
    *s = s
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *s >> 33
}

/// Random weight bytes with finite, moderate scales (quantizing 28M values
/// with the K reference quantizers would take too long for a benchmark).
fn weights(dtype: DType, n_rows: usize, k: usize) -> Vec<u8> {
    let mut s = 1u64;
    if dtype.is_float() {
        let x: Vec<f32> = (0..n_rows * k)
            .map(|_| (lcg(&mut s) % 2000) as f32 / 1000.0 - 1.0)
            .collect();
        let mut w = vec![0u8; row_bytes(dtype, n_rows * k).unwrap()];
        arbor_quant::quantize(dtype, &x, &mut w).unwrap();
        return w;
    }
    let mut w: Vec<u8> = (0..n_rows * row_bytes(dtype, k).unwrap())
        .map(|_| lcg(&mut s) as u8)
        .collect();
    let offs: &[usize] = match dtype {
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        _ => &[0],
    };
    for blk in w.chunks_exact_mut(dtype.block_bytes()) {
        for &o in offs {
            let v = half::f16::from_f32(0.01);
            blk[o..o + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    w
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("dot_rows");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for dtype in FORMATS {
        let big_k = if dtype.block_size() == 256 { 512 } else { 576 };
        for (n_rows, k) in [(576usize, 1536usize), (49152, big_k)] {
            let w = weights(dtype, n_rows, k);
            for m in [1usize, 8] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let acts = prepare_acts(dtype, &x, m, k).unwrap();
                let mut out = vec![0.0f32; m * n_rows];
                g.throughput(Throughput::Bytes(w.len() as u64));
                g.bench_function(format!("{dtype}/{n_rows}x{k}/m{m}"), |b| {
                    b.iter(|| dot_rows(dtype, &w, n_rows, k, &acts, &mut out, n_rows).unwrap())
                });
            }
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
