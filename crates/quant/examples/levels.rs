//! Prints this CPU's SIMD level and the tiled GEMM's and row kernels'
//! speed at each available level on one of the default model's shapes
//! (`ffn_up`, 1536 x 576 Q4_1, at 1 and 16 activation rows), after checking
//! that every level agrees with the scalar reference.
//!
//! Built in release by `scripts/check-kernel-inlining.sh`, which also reads
//! its symbols: an intrinsic left out of line (a kernel closure compiled
//! without its caller's target features) shows up as a `core_arch` symbol.
//!
//! Run: `cargo run --release -p arbor-quant --example levels`.
#![allow(clippy::unwrap_used)]

use arbor_quant::{DType, SimdLevel, dot_rows_with, prepare_acts, quantize, row_bytes};
use std::time::Instant;

fn main() {
    let (n, k) = (1536usize, 576usize);
    let mut seed = 1u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    };
    let wf: Vec<f32> = (0..n * k).map(|_| next()).collect();
    let mut w = vec![0u8; row_bytes(DType::Q4_1, n * k).unwrap()];
    quantize(DType::Q4_1, &wf, &mut w).unwrap();
    println!("detected level: {:?}", arbor_quant::detected_level());
    for m in [1usize, 16] {
        let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
        let acts = prepare_acts(DType::Q4_1, &x, m, k).unwrap();
        let mut base = vec![0.0f32; m * n];
        dot_rows_with(
            SimdLevel::Scalar,
            DType::Q4_1,
            &w,
            n,
            k,
            &acts,
            &mut base,
            n,
        )
        .unwrap();
        for level in SimdLevel::available() {
            let mut out = vec![0.0f32; m * n];
            dot_rows_with(level, DType::Q4_1, &w, n, k, &acts, &mut out, n).unwrap();
            let worst = out
                .iter()
                .zip(&base)
                .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
                .fold(0.0f32, f32::max);
            assert!(worst < 1e-4, "{level:?} m={m}: relative error {worst}");
            let reps = 200;
            let t = Instant::now();
            for _ in 0..reps {
                dot_rows_with(level, DType::Q4_1, &w, n, k, &acts, &mut out, n).unwrap();
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            let gmacs = (m * n * k) as f64 / s / 1e9;
            println!(
                "q4_1 {n}x{k} m={m:<2} {:<7} {gmacs:7.1} GMAC/s",
                level.name()
            );
        }
    }
}
