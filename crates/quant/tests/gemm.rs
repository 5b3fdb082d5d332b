//! The tiled GEMM path (`gemm_with`, and `dot_rows`/`dot_rows_raw` when they
//! pick it) against the scalar reference, at every SIMD level, on random
//! shapes with ragged tails: `n` not a multiple of the 32-row panel or the
//! 16-row vector, `m` not a multiple of the row tile, `k` spanning one or
//! several 24-block chunks with a partial last chunk.
#![allow(clippy::unwrap_used)]
#![allow(unsafe_code)]

use arbor_quant::{
    DType, PreparedActs, QuantError, SimdLevel, dot_rows, dot_rows_raw, dot_rows_with,
    gemm_supported, gemm_with, prepare_acts, row_bytes,
};

const FORMATS: [DType; 5] = [
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
];

mod common;
use common::Rng;

/// Random block bytes (every quant pattern) with finite scales of both signs.
fn random_weights(rng: &mut Rng, dtype: DType, n_rows: usize, k: usize) -> Vec<u8> {
    let mut w: Vec<u8> = (0..n_rows * row_bytes(dtype, k).unwrap())
        .map(|_| rng.next() as u8)
        .collect();
    let offs: &[usize] = match dtype {
        DType::Q4_1 | DType::Q5_1 => &[0, 2],
        _ => &[0],
    };
    for blk in w.chunks_exact_mut(dtype.block_bytes()) {
        for &o in offs {
            let v = (rng.unit() - 0.3) * 0.05;
            blk[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
        }
    }
    w
}

/// Σ|w·y| in f64 per (activation row, weight row) of the dequantized
/// values: the scale of the f32 rounding differences.
fn abs_dots(dtype: DType, w: &[u8], acts: &PreparedActs, n_rows: usize, k: usize) -> Vec<f64> {
    let mut wf = vec![0.0f32; n_rows * k];
    arbor_quant::dequantize(dtype, w, &mut wf).unwrap();
    let ad = acts.dtype().unwrap();
    let ab = acts.to_ggml_bytes();
    let mut af = vec![0.0f32; acts.m() * k];
    arbor_quant::dequantize(ad, &ab, &mut af).unwrap();
    let m = acts.m();
    let mut r = vec![0.0; m * n_rows];
    for i in 0..m {
        for j in 0..n_rows {
            r[i * n_rows + j] = (0..k)
                .map(|e| (wf[j * k + e] as f64 * af[i * k + e] as f64).abs())
                .sum();
        }
    }
    r
}

fn case(rng: &mut Rng, dtype: DType, n_rows: usize, k: usize, m: usize) {
    let w = random_weights(rng, dtype, n_rows, k);
    let mut x: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
    // An all-zero activation row and an all-zero block, when there is room.
    if m > 2 {
        x[k..2 * k].fill(0.0);
    }
    if k >= 64 {
        x[32..64].fill(0.0);
    }
    let acts = prepare_acts(dtype, &x, m, k).unwrap();
    let absd = abs_dots(dtype, &w, &acts, n_rows, k);
    let stride = n_rows + 5;
    let len = (m - 1) * stride + n_rows;
    let mut base = vec![f32::NAN; len];
    dot_rows_with(
        SimdLevel::Scalar,
        dtype,
        &w,
        n_rows,
        k,
        &acts,
        &mut base,
        stride,
    )
    .unwrap();
    for level in SimdLevel::available() {
        if level == SimdLevel::Scalar {
            continue;
        }
        let mut out = vec![f32::NAN; len];
        gemm_with(level, dtype, &w, n_rows, k, &acts, &mut out, stride).unwrap();
        for i in 0..m {
            for j in 0..n_rows {
                let (a, b) = (out[i * stride + j], base[i * stride + j]);
                let tol = 2e-6 * absd[i * n_rows + j] as f32 + 1e-6;
                assert!(
                    (a - b).abs() <= tol,
                    "{dtype} {level:?} n={n_rows} k={k} m={m} i={i} r={j}: {a} vs scalar {b} (tol {tol})"
                );
            }
            if i + 1 < m {
                for j in n_rows..stride {
                    assert!(
                        out[i * stride + j].is_nan(),
                        "{dtype} {level:?} n={n_rows} k={k} m={m}: wrote into the stride gap"
                    );
                }
            }
        }
    }
}

#[test]
fn gemm_matches_scalar_on_ragged_shapes() {
    let mut rng = Rng(2024);
    // k: 1, 2, 7, 18 blocks (one chunk), 24 (one full chunk), 25 and 48
    // (a full chunk plus a partial or full second one).
    let ks = [32, 64, 224, 576, 768, 800, 1536];
    let ns = [1, 5, 16, 17, 31, 32, 33, 70];
    let ms = [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 21];
    for dtype in FORMATS {
        for (ci, &k) in ks.iter().enumerate() {
            for (cj, &n) in ns.iter().enumerate() {
                // A spread of m per (k, n) keeps the test fast.
                for t in 0..3 {
                    let m = ms[(ci + 2 * cj + 3 * t) % ms.len()];
                    case(&mut rng, dtype, n, k, m);
                }
            }
        }
    }
}

#[test]
fn gemm_random_shapes() {
    let mut rng = Rng(77);
    for _ in 0..60 {
        let dtype = FORMATS[rng.below(FORMATS.len())];
        let k = 32 * (1 + rng.below(60));
        let n = 1 + rng.below(100);
        let m = 1 + rng.below(20);
        case(&mut rng, dtype, n, k, m);
    }
}

#[test]
fn dot_rows_picks_gemm_and_agrees() {
    let mut rng = Rng(5);
    let (n, k) = (45, 576);
    for dtype in FORMATS {
        for m in [1, 3, 4, 16, 31, 32, 37] {
            let w = random_weights(&mut rng, dtype, n, k);
            let x: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
            let acts = prepare_acts(dtype, &x, m, k).unwrap();
            let absd = abs_dots(dtype, &w, &acts, n, k);
            let mut base = vec![0.0f32; m * n];
            dot_rows_with(SimdLevel::Scalar, dtype, &w, n, k, &acts, &mut base, n).unwrap();
            let mut out = vec![0.0f32; m * n];
            dot_rows(dtype, &w, n, k, &acts, &mut out, n).unwrap();
            for (idx, (a, b)) in out.iter().zip(&base).enumerate() {
                let tol = 2e-6 * absd[idx] as f32 + 1e-6;
                assert!((a - b).abs() <= tol, "{dtype} m={m} [{idx}]: {a} vs {b}");
            }
        }
    }
}

/// Two "threads" (calls) writing disjoint column ranges of one output, as the
/// CPU backend does, each through `dot_rows_raw`.
#[test]
fn raw_output_writes_only_its_columns() {
    let mut rng = Rng(9);
    let (n, k, m) = (70, 320, 9);
    for dtype in [DType::Q4_1, DType::Q8_0, DType::Q4_K] {
        let k = if dtype == DType::Q4_K { 512 } else { k };
        let w = random_weights_any(&mut rng, dtype, n, k);
        let x: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
        let acts = prepare_acts(dtype, &x, m, k).unwrap();
        let mut want = vec![0.0f32; m * n];
        dot_rows(dtype, &w, n, k, &acts, &mut want, n).unwrap();
        let mut out = vec![f32::NAN; m * n];
        let rb = row_bytes(dtype, k).unwrap();
        let split = 37;
        // SAFETY: columns 0..split and split..n of rows 0..m lie inside `out`,
        // and the two calls run one after the other.
        unsafe {
            dot_rows_raw(
                dtype,
                &w[..split * rb],
                split,
                k,
                &acts,
                out.as_mut_ptr(),
                n,
            )
            .unwrap();
            let first_ok =
                (0..m).all(|i| out[i * n + split..(i + 1) * n].iter().all(|v| v.is_nan()));
            assert!(
                first_ok,
                "{dtype}: the first call wrote outside its columns"
            );
            dot_rows_raw(
                dtype,
                &w[split * rb..],
                n - split,
                k,
                &acts,
                out.as_mut_ptr().add(split),
                n,
            )
            .unwrap();
        }
        for (idx, (a, b)) in out.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                "{dtype} [{idx}]: {a} vs {b}"
            );
        }
    }
}

fn random_weights_any(rng: &mut Rng, dtype: DType, n: usize, k: usize) -> Vec<u8> {
    if dtype == DType::Q4_K {
        let x: Vec<f32> = (0..n * k).map(|_| rng.normal()).collect();
        let mut w = vec![0u8; row_bytes(dtype, n * k).unwrap()];
        arbor_quant::quantize(dtype, &x, &mut w).unwrap();
        w
    } else {
        random_weights(rng, dtype, n, k)
    }
}

#[test]
fn gemm_bad_input() {
    let k = 64;
    let x = vec![0.5f32; 4 * k];
    let acts = prepare_acts(DType::Q4_1, &x, 4, k).unwrap();
    let w = vec![0u8; 3 * row_bytes(DType::Q4_1, k).unwrap()];
    let mut out = vec![0.0f32; 12];
    let top = arbor_quant::detected_level();
    if top > SimdLevel::Scalar {
        gemm_with(top, DType::Q4_1, &w, 3, k, &acts, &mut out, 3).unwrap();
        assert!(gemm_with(top, DType::Q4_1, &w[1..], 3, k, &acts, &mut out, 3).is_err());
        assert!(gemm_with(top, DType::Q4_1, &w, 3, k, &acts, &mut out[..11], 3).is_err());
        assert!(matches!(
            gemm_with(top, DType::Q4_1, &w, 3, k, &acts, &mut out, 2),
            Err(QuantError::BadStride { .. })
        ));
    }
    assert!(matches!(
        gemm_with(SimdLevel::Scalar, DType::Q4_1, &w, 3, k, &acts, &mut out, 3),
        Err(QuantError::Unsupported { .. })
    ));
    let ak = prepare_acts(DType::Q4_K, &vec![0.5f32; 4 * 256], 4, 256).unwrap();
    let wk = vec![0u8; row_bytes(DType::Q4_K, 256).unwrap()];
    assert!(gemm_with(top, DType::Q4_K, &wk, 1, 256, &ak, &mut out, 1).is_err());
    assert!(gemm_supported(DType::Q8_0) && !gemm_supported(DType::Q6_K));
    // Raw output: the arguments are validated like dot_rows'.
    // SAFETY: nothing is written on the error paths.
    unsafe {
        assert!(dot_rows_raw(DType::Q4_1, &w[1..], 3, k, &acts, out.as_mut_ptr(), 3).is_err());
        assert!(dot_rows_raw(DType::Q4_1, &w, 3, k, &acts, out.as_mut_ptr(), 2).is_err());
        assert!(dot_rows_raw(DType::Q4_1, &w, 3, k, &acts, out.as_mut_ptr(), usize::MAX).is_err());
    }
}
