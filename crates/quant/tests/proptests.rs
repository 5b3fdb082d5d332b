//! Property tests: random shapes, random weight bytes and activations;
//! every SIMD level agrees with the scalar path, and arbitrary (often wrong)
//! lengths never panic.
#![allow(clippy::unwrap_used)]

use arbor_quant::{
    DOT_WEIGHT_DTYPES, DType, SimdLevel, dequantize_with, dot_rows_with, prepare_acts, quantize,
    row_bytes,
};
use proptest::prelude::*;
use std::sync::LazyLock;

/// The weight dtypes whose blocks [`weights`] can fill from random bytes:
/// the floats and ggml's blocks (their scale fields are at
/// [`scale_offsets`]); the scaled blocks of HF checkpoints are tested in
/// `kernels.rs`.
static DOT: LazyLock<Vec<DType>> = LazyLock::new(|| {
    DOT_WEIGHT_DTYPES
        .into_iter()
        .filter(|d| !d.is_scaled_block())
        .collect()
});

/// Offsets of the f16 scale fields in a block (overwritten with finite values).
fn scale_offsets(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        _ => &[0],
    }
}

fn weights(dtype: DType, bytes: &[u8], floats: &[f32], n_rows: usize, k: usize) -> Vec<u8> {
    let n = n_rows * row_bytes(dtype, k).unwrap();
    if dtype.is_float() {
        let x: Vec<f32> = (0..n_rows * k).map(|i| floats[i % floats.len()]).collect();
        let mut w = vec![0u8; n];
        quantize(dtype, &x, &mut w).unwrap();
        return w;
    }
    let mut w: Vec<u8> = (0..n)
        .map(|i| bytes[i % bytes.len()] ^ (i / bytes.len()) as u8)
        .collect();
    for (bi, blk) in w.chunks_exact_mut(dtype.block_bytes()).enumerate() {
        for &o in scale_offsets(dtype) {
            let v = floats[(bi + o) % floats.len()] * 0.01;
            blk[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
        }
    }
    w
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn levels_agree_with_scalar(
        di in 0usize..DOT.len(),
        n_rows in 1usize..12,
        blocks in 1usize..6,
        m in 1usize..11,
        bytes in proptest::collection::vec(any::<u8>(), 64..256),
        floats in proptest::collection::vec(-4.0f32..4.0, 16..128),
        xs in proptest::collection::vec(-8.0f32..8.0, 16..128),
    ) {
        let dtype = DOT[di];
        let k = if dtype.is_float() { blocks * 13 } else { blocks * dtype.block_size() };
        let w = weights(dtype, &bytes, &floats, n_rows, k);
        let x: Vec<f32> = (0..m * k).map(|i| xs[i % xs.len()] * (1.0 + (i % 7) as f32)).collect();
        let acts = prepare_acts(dtype, &x, m, k).unwrap();
        let mut base = vec![0.0f32; m * n_rows];
        dot_rows_with(SimdLevel::Scalar, dtype, &w, n_rows, k, &acts, &mut base, n_rows).unwrap();
        // Scale of the rounding error: the dot of absolute values.
        let mut wf = vec![0.0f32; n_rows * k];
        dequantize_with(SimdLevel::Scalar, dtype, &w, &mut wf).unwrap();
        for level in SimdLevel::available() {
            let mut out = vec![0.0f32; m * n_rows];
            dot_rows_with(level, dtype, &w, n_rows, k, &acts, &mut out, n_rows).unwrap();
            let mut y = vec![0.0f32; n_rows * k];
            dequantize_with(level, dtype, &w, &mut y).unwrap();
            prop_assert!(y.iter().zip(&wf).all(|(a, b)| a.to_bits() == b.to_bits()));
            for i in 0..m {
                let absd: f32 = (0..n_rows)
                    .map(|r| (0..k).map(|e| (wf[r * k + e] * x[i * k + e]).abs()).sum::<f32>())
                    .fold(0.0, f32::max);
                for r in 0..n_rows {
                    let (a, mut b) = (out[i * n_rows + r], base[i * n_rows + r]);
                    if dtype == DType::BF16 && level >= SimdLevel::Amx {
                        // `vdpbf16ps` multiplies the bf16-rounded activations.
                        b = (0..k)
                            .map(|e| {
                                let xe = half::bf16::from_f32(x[i * k + e]).to_f32();
                                wf[r * k + e] as f64 * xe as f64
                            })
                            .sum::<f64>() as f32;
                    }
                    prop_assert!(
                        (a - b).abs() <= 1e-5 * absd + 1e-6,
                        "{} {:?} m={} k={} i={} r={}: {} vs {}", dtype, level, m, k, i, r, a, b
                    );
                }
            }
        }
    }

    #[test]
    fn arbitrary_lengths_never_panic(
        di in 0usize..DOT.len(),
        n_rows in 0usize..5,
        k in 0usize..600,
        m in 0usize..4,
        wlen in 0usize..3000,
        olen in 0usize..40,
        stride in 0usize..12,
        xlen in 0usize..2000,
    ) {
        let dtype = DOT[di];
        let x = vec![0.5f32; xlen];
        let w = vec![0x5Au8; wlen];
        let mut out = vec![0.0f32; olen];
        if let Ok(acts) = prepare_acts(dtype, &x, m, k) {
            for level in SimdLevel::available() {
                let _ = dot_rows_with(level, dtype, &w, n_rows, k, &acts, &mut out, stride);
            }
        }
        let mut y = vec![0.0f32; olen * 8];
        for level in SimdLevel::available() {
            let _ = dequantize_with(level, dtype, &w, &mut y);
        }
        let mut q = vec![0u8; wlen];
        let _ = quantize(dtype, &x, &mut q);
    }
}
