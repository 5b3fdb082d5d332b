//! Kernel tests: quantize/dequantize round trips, every SIMD level's
//! `dot_rows` against the scalar path, the scalar path against f64 dots of
//! dequantized values, and bad input.
#![allow(clippy::unwrap_used)]

use arbor_quant::{
    DType, PreparedActs, QuantError, SimdLevel, act_dtype_for, dequantize, dequantize_with,
    dot_rows, dot_rows_gemv_with, dot_rows_with, prepare_acts, quantize, row_bytes,
};

const DOT: [DType; 18] = arbor_quant::DOT_WEIGHT_DTYPES;

mod common;
use common::Rng;

fn quantized(dtype: DType, x: &[f32]) -> Vec<u8> {
    let mut w = vec![0u8; row_bytes(dtype, x.len()).unwrap()];
    quantize(dtype, x, &mut w).unwrap();
    w
}

fn dequantized(dtype: DType, w: &[u8]) -> Vec<f32> {
    let n = w.len() / dtype.block_bytes() * dtype.block_size();
    let mut y = vec![0.0; n];
    dequantize(dtype, w, &mut y).unwrap();
    y
}

/// The activations as the kernels see them, dequantized to f32.
fn acts_f32(a: &PreparedActs) -> Vec<f32> {
    let d = a.dtype().unwrap();
    let bytes = a.to_ggml_bytes();
    if d == DType::F8E4M3 {
        // E4M3-rounded inputs are kept as the f32 values they stand for.
        return dequantized(DType::F32, &bytes);
    }
    dequantized(d, &bytes)
}

#[test]
fn roundtrip_error_bounds() {
    let mut rng = Rng(7);
    let k = 1024;
    let x = rng.normals(4 * k);
    let bounds = [
        (DType::F32, 0.0),
        (DType::F16, 1e-3),
        (DType::BF16, 5e-3),
        (DType::Q4_0, 0.12),
        (DType::Q4_1, 0.12),
        (DType::Q5_0, 0.06),
        (DType::Q5_1, 0.06),
        (DType::Q8_0, 0.01),
        (DType::Q8_1, 0.01),
        (DType::Q2_K, 0.40),
        (DType::Q3_K, 0.22),
        (DType::Q4_K, 0.12),
        (DType::Q5_K, 0.06),
        (DType::Q6_K, 0.03),
        (DType::Q8_K, 0.01),
    ];
    for (dtype, bound) in bounds {
        let y = dequantized(dtype, &quantized(dtype, &x));
        let err: f64 = x
            .iter()
            .zip(&y)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let norm: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
        let rel = (err / norm).sqrt();
        eprintln!("{dtype}: relative rms error {rel:.5}");
        assert!(rel <= bound, "{dtype}: relative rms error {rel} > {bound}");
    }
}

#[test]
fn zero_and_constant_blocks() {
    for dtype in DType::ALL {
        if !arbor_quant::is_supported(dtype) {
            continue;
        }
        let k = 512;
        for x in [vec![0.0f32; k], vec![0.25f32; k], vec![-3.0f32; k]] {
            let y = dequantized(dtype, &quantized(dtype, &x));
            for (a, b) in x.iter().zip(&y) {
                assert!(
                    (a - b).abs() <= 0.02 * a.abs() + 1e-6,
                    "{dtype}: {a} -> {b}"
                );
            }
        }
    }
}

/// Random weight bytes for `dtype`: arbitrary quants, finite moderate scales.
fn random_weights(rng: &mut Rng, dtype: DType, n_rows: usize, k: usize) -> Vec<u8> {
    if dtype.is_float() {
        return quantized(dtype, &rng.normals(n_rows * k));
    }
    let bb = dtype.block_bytes();
    let mut w: Vec<u8> = (0..n_rows * row_bytes(dtype, k).unwrap())
        .map(|_| rng.next() as u8)
        .collect();
    match dtype {
        DType::F8E4M3 => {
            // Any finite code (0x7f and 0xff are NaN).
            w.iter_mut().for_each(|b| *b &= 0xfe);
            return w;
        }
        DType::F8E5M2 => {
            // Any finite code (exponent 11111 is infinity or NaN).
            w.iter_mut().for_each(|b| *b &= 0xbf);
            return w;
        }
        DType::F8_S32 | DType::F8A8_S32 => {
            for blk in w.chunks_exact_mut(bb) {
                blk[..32].iter_mut().for_each(|b| *b &= 0xfe);
                let s = (rng.unit() + 0.1) * 0.01;
                blk[32..36].copy_from_slice(&s.to_le_bytes());
            }
            return w;
        }
        DType::F4_S16 => {
            for blk in w.chunks_exact_mut(bb) {
                let s = (rng.unit() + 0.1) * 0.02;
                blk[8..12].copy_from_slice(&s.to_le_bytes());
            }
            return w;
        }
        DType::U4_S32 => {
            for blk in w.chunks_exact_mut(bb) {
                let s = (rng.unit() + 0.1) * 0.02;
                blk[16..18].copy_from_slice(&half::f16::from_f32(s).to_bits().to_le_bytes());
                blk[18] &= 0x0f;
                blk[19] = 0;
            }
            return w;
        }
        DType::U8_S32 => {
            for blk in w.chunks_exact_mut(bb) {
                let s = (rng.unit() + 0.1) * 0.002;
                blk[32..34].copy_from_slice(&half::f16::from_f32(s).to_bits().to_le_bytes());
                // Zero points 0..=256 (GPTQ's original format reaches 256).
                let z = (u16::from(blk[34]) + u16::from(blk[35] & 1)).min(256);
                blk[34..36].copy_from_slice(&z.to_le_bytes());
            }
            return w;
        }
        _ => {}
    }
    let offs: &[usize] = match dtype {
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        _ => &[0],
    };
    for blk in w.chunks_exact_mut(bb) {
        for &o in offs {
            let v = (rng.unit() - 0.3) * 0.05;
            blk[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
        }
    }
    w
}

/// Σ|w||y| in f64 per (activation row, weight row): the scale of rounding errors.
fn abs_dots(wf: &[f32], af: &[f32], n_rows: usize, m: usize, k: usize) -> Vec<f64> {
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

type DotFn = fn(
    SimdLevel,
    DType,
    &[u8],
    usize,
    usize,
    &PreparedActs,
    &mut [f32],
    usize,
) -> Result<(), QuantError>;

fn dot_case(rng: &mut Rng, dtype: DType, n_rows: usize, k: usize, m: usize) {
    let w = random_weights(rng, dtype, n_rows, k);
    let x: Vec<f32> = rng.normals(m * k);
    let acts = prepare_acts(dtype, &x, m, k).unwrap();
    let wf = dequantized(dtype, &w);
    // What the kernels multiply: for bf16 weights the bf16-rounded
    // activations at the AVX-512 BF16 level, the f32 ones below it.
    let af = acts_f32(&acts);
    let bf16_level = |l: SimdLevel| dtype == DType::BF16 && l >= SimdLevel::Amx;
    let af_below = if dtype == DType::BF16 {
        assert_eq!(acts.dtype(), Some(DType::BF16));
        x.clone()
    } else {
        af.clone()
    };
    let exact = |a: &[f32], i: usize, j: usize| -> f64 {
        (0..k)
            .map(|e| wf[j * k + e] as f64 * a[i * k + e] as f64)
            .sum()
    };
    let absd = abs_dots(&wf, &af_below, n_rows, m, k);
    // Leave a gap between rows to check the stride.
    let stride = n_rows + 3;
    let mut base = vec![f32::NAN; (m - 1) * stride + n_rows];
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
    // The scalar path against an f64 dot of the dequantized values.
    let rel_tol = match dtype {
        // ggml rounds Q8_1's s = d*sum(q) to f16.
        DType::Q4_1 | DType::Q5_1 => 2e-3,
        _ => 1e-5,
    };
    for i in 0..m {
        for j in 0..n_rows {
            let exact = exact(&af_below, i, j);
            let got = base[i * stride + j] as f64;
            let tol = rel_tol * absd[i * n_rows + j] + 1e-6;
            assert!(
                (got - exact).abs() <= tol,
                "{dtype} scalar k={k} m={m} i={i} r={j}: {got} vs exact {exact} (tol {tol})"
            );
        }
    }
    // The default dispatch (the tiled GEMM or its exact equivalent) and the row
    // kernels forced at every m.
    let paths = [dot_rows_with as DotFn, dot_rows_gemv_with as DotFn];
    for (level, dot) in SimdLevel::available()
        .into_iter()
        .flat_map(|l| paths.iter().map(move |p| (l, *p)))
    {
        let mut out = vec![f32::NAN; (m - 1) * stride + n_rows];
        dot(level, dtype, &w, n_rows, k, &acts, &mut out, stride).unwrap();
        for i in 0..m {
            for j in 0..n_rows {
                let (a, b) = (out[i * stride + j], base[i * stride + j]);
                if bf16_level(level) {
                    // `vdpbf16ps`: exact products of the rounded values.
                    let want = exact(&af, i, j);
                    let tol = 1e-5 * absd[i * n_rows + j] + 1e-6;
                    assert!(
                        (a as f64 - want).abs() <= tol,
                        "{dtype} {level:?} k={k} m={m} i={i} r={j}: {a} vs exact {want} (tol {tol})"
                    );
                    continue;
                }
                let tol = 2e-6 * absd[i * n_rows + j] as f32 + 1e-6;
                assert!(
                    (a - b).abs() <= tol,
                    "{dtype} {level:?} k={k} m={m} i={i} r={j}: {a} vs scalar {b} (tol {tol})"
                );
            }
            for j in n_rows..stride {
                if i + 1 < m {
                    assert!(
                        out[i * stride + j].is_nan(),
                        "{dtype} {level:?} wrote into the stride gap"
                    );
                }
            }
        }
    }
}

#[test]
fn dot_rows_all_levels_agree() {
    let mut rng = Rng(42);
    for dtype in DOT {
        let bs = dtype.block_size().max(32);
        let ks: Vec<usize> = if dtype.block_size() == 1 {
            vec![1, 7, 16, 33, 64, 100, 576]
        } else {
            // 32-element formats: tails of 1..3 blocks (per-block path), 7 and
            // 12 blocks (padded group), 16 and 18 (full groups + tail).
            if bs == 32 {
                vec![32, 64, 96, 224, 384, 512, 576]
            } else {
                vec![256, 512, 768, 1536]
            }
        };
        for k in ks {
            for m in 1..=9 {
                dot_case(&mut rng, dtype, 7, k, m);
            }
            dot_case(&mut rng, dtype, 1, k, 1);
            dot_case(&mut rng, dtype, 33, k, 2);
        }
    }
}

#[test]
fn quantized_dot_close_to_float_dot() {
    // Sanity of activation quantization: the quantized dot is close to the
    // f32 dot of the dequantized weights with the original activations.
    let mut rng = Rng(3);
    let k = 1024;
    for dtype in DOT {
        let w = quantized(dtype, &rng.normals(k));
        let wf = dequantized(dtype, &w);
        let x = rng.normals(k);
        let acts = prepare_acts(dtype, &x, 1, k).unwrap();
        let mut out = [0.0f32];
        dot_rows(dtype, &w, 1, k, &acts, &mut out, 1).unwrap();
        let exact: f64 = wf.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
        let absd: f64 = wf
            .iter()
            .zip(&x)
            .map(|(a, b)| (*a as f64 * *b as f64).abs())
            .sum();
        assert!(
            (out[0] as f64 - exact).abs() <= 0.02 * absd,
            "{dtype}: {} vs {exact}",
            out[0]
        );
    }
}

#[test]
fn dequantize_levels_agree() {
    let mut rng = Rng(11);
    for dtype in DType::ALL {
        if !arbor_quant::is_supported(dtype) {
            continue;
        }
        let k = 768;
        let w = random_weights(&mut rng, dtype, 3, k);
        let base = dequantized(dtype, &w);
        for level in SimdLevel::available() {
            let mut y = vec![0.0f32; base.len()];
            dequantize_with(level, dtype, &w, &mut y).unwrap();
            for (a, b) in y.iter().zip(&base) {
                assert!(a.to_bits() == b.to_bits(), "{dtype} {level:?}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn bad_input_is_an_error() {
    let k = 64;
    let x = vec![0.5f32; 2 * k];
    let acts = prepare_acts(DType::Q4_1, &x, 2, k).unwrap();
    let w = vec![0u8; 3 * row_bytes(DType::Q4_1, k).unwrap()];
    let mut out = vec![0.0f32; 6];
    // Correct call works.
    dot_rows(DType::Q4_1, &w, 3, k, &acts, &mut out, 3).unwrap();
    // Wrong weight length.
    assert!(matches!(
        dot_rows(DType::Q4_1, &w[1..], 3, k, &acts, &mut out, 3),
        Err(QuantError::BadLength { .. })
    ));
    // Output too short.
    assert!(dot_rows(DType::Q4_1, &w, 3, k, &acts, &mut out[..5], 3).is_err());
    // Stride too small.
    assert!(matches!(
        dot_rows(DType::Q4_1, &w, 3, k, &acts, &mut out, 2),
        Err(QuantError::BadStride { .. })
    ));
    // k mismatch and not a block multiple.
    assert!(dot_rows(DType::Q4_1, &w, 3, 32, &acts, &mut out, 3).is_err());
    assert!(prepare_acts(DType::Q4_1, &x[..2 * 33], 2, 33).is_err());
    assert!(prepare_acts(DType::Q4_K, &x, 2, k).is_err());
    // Activations prepared for another vec_dot type.
    assert!(matches!(
        dot_rows(DType::Q4_0, &w[..3 * 18 * 2], 3, k, &acts, &mut out, 3),
        Err(QuantError::ActsMismatch(_))
    ));
    assert!(dot_rows(DType::Q4_1, &w, 3, k, &PreparedActs::new(), &mut out, 3).is_err());
    // Wrong activation length.
    assert!(prepare_acts(DType::F32, &x, 3, k).is_err());
    // Huge sizes overflow cleanly.
    assert!(dot_rows(DType::Q4_1, &w, usize::MAX / 2, k, &acts, &mut out, 3).is_err());
    assert!(dot_rows(DType::Q4_1, &w, 3, k, &acts, &mut out, usize::MAX).is_err());
    // Unsupported dtypes.
    assert!(matches!(
        prepare_acts(DType::I32, &x, 2, k),
        Err(QuantError::Unsupported { .. })
    ));
    assert!(act_dtype_for(DType::Q8_K).is_err());
    let mut y = vec![0.0f32; 32];
    assert!(dequantize(DType::U8, &[0u8; 32], &mut y).is_err());
    // Dequantize: partial block and wrong destination length.
    assert!(dequantize(DType::Q4_0, &[0u8; 17], &mut y).is_err());
    assert!(dequantize(DType::Q4_0, &[0u8; 18], &mut y[..31]).is_err());
    assert!(dequantize(DType::Q6_K, &[0u8; 210], &mut y).is_err());
    // Quantize: not a block multiple and wrong destination length.
    assert!(quantize(DType::Q8_0, &[0.0; 31], &mut [0u8; 34]).is_err());
    assert!(quantize(DType::Q8_0, &[0.0; 32], &mut [0u8; 33]).is_err());
    assert!(row_bytes(DType::Q2_K, 255).is_err());
    // A level above the detected one.
    if arbor_quant::detected_level() < SimdLevel::Avx512 {
        assert!(matches!(
            dot_rows_with(SimdLevel::Avx512, DType::Q4_1, &w, 3, k, &acts, &mut out, 3),
            Err(QuantError::LevelUnavailable(_))
        ));
    }
    // Empty inputs are fine.
    let empty = prepare_acts(DType::Q4_1, &[], 0, k).unwrap();
    dot_rows(DType::Q4_1, &w, 3, k, &empty, &mut [], 0).unwrap();
    dot_rows(DType::Q4_1, &[], 0, k, &acts, &mut [], 0).unwrap();
}

#[test]
fn acts_reuse_and_layout() {
    let mut rng = Rng(5);
    let k = 256;
    let x = rng.normals(3 * k);
    let mut a = PreparedActs::new();
    for dtype in [DType::Q4_0, DType::Q4_1, DType::Q4_K, DType::F16] {
        a.prepare_into(dtype, &x, 3, k).unwrap();
        let want = act_dtype_for(dtype).unwrap();
        assert_eq!(a.dtype(), Some(want));
        assert_eq!((a.m(), a.k()), (3, k));
        let bytes = a.to_ggml_bytes();
        assert_eq!(bytes.len(), row_bytes(want, 3 * k).unwrap());
        let y = acts_f32(&a);
        for (p, q) in x.iter().zip(&y) {
            assert!((p - q).abs() <= 0.01 * 4.5, "{dtype}: {p} vs {q}");
        }
    }
}

#[test]
fn prepare_levels_agree() {
    let mut rng = Rng(9);
    let k = 512;
    let mut x = rng.normals(3 * k);
    // Ties at .5 after scaling (amax 127 makes id 1), zeros, huge and tiny values.
    for (j, v) in x[..64].iter_mut().enumerate() {
        *v = j as f32 - 31.5;
    }
    x[31] = 127.0;
    x[64..96].iter_mut().for_each(|v| *v = 0.0);
    x[100] = 3e38;
    x[140] = 1e-38;
    for dtype in [DType::Q4_0, DType::Q4_1, DType::Q4_K, DType::F32] {
        let mut base = PreparedActs::new();
        base.prepare_into_with(SimdLevel::Scalar, dtype, &x, 3, k)
            .unwrap();
        for level in SimdLevel::available() {
            let mut a = PreparedActs::new();
            a.prepare_into_with(level, dtype, &x, 3, k).unwrap();
            assert_eq!(a.to_ggml_bytes(), base.to_ggml_bytes(), "{dtype} {level:?}");
        }
    }
    // Non-finite input never panics.
    x[5] = f32::NAN;
    x[300] = f32::INFINITY;
    for dtype in [DType::Q4_0, DType::Q4_1, DType::Q4_K] {
        for level in SimdLevel::available() {
            let mut a = PreparedActs::new();
            a.prepare_into_with(level, dtype, &x, 3, k).unwrap();
        }
    }
}

#[test]
fn quantize_extreme_values_never_panics() {
    let specials = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        1e-40,
        -0.0,
        65504.0,
        1e30,
    ];
    let mut rng = Rng(13);
    for dtype in DType::ALL {
        if !arbor_quant::is_supported(dtype) {
            continue;
        }
        for s in specials {
            let mut x = rng.normals(512);
            for v in x.iter_mut().step_by(37) {
                *v = s;
            }
            let w = quantized(dtype, &x);
            let _ = dequantized(dtype, &w);
            let big: Vec<f32> = vec![s; 512];
            let _ = dequantized(dtype, &quantized(dtype, &big));
        }
    }
}

/// A split preparation gives the same bits as `prepare_into`, whether its
/// parts run on two threads with any piece count, partly (the rest runs
/// when it is dropped) or not at all; a dot with it matches too.
#[test]
fn split_preparation_matches_the_serial_one() {
    let mut rng = Rng(21);
    for (dtype, m, k) in [
        (DType::Q4_1, 16, 576),
        (DType::Q4_0, 3, 1536),
        (DType::Q8_0, 1, 32),
        (DType::Q4_K, 5, 512),
        (DType::F32, 2, 64),
    ] {
        let x = rng.normals(m * k);
        let n = 33;
        let w = random_weights(&mut rng, dtype, n, k);
        let base = prepare_acts(dtype, &x, m, k).unwrap();
        let mut want = vec![0.0f32; m * n];
        dot_rows(dtype, &w, n, k, &base, &mut want, n).unwrap();
        for pieces in [0usize, 1, 2, 3, 8, 40] {
            let mut a = PreparedActs::new();
            let prep = a.prepare_split(dtype, &x, m, k).unwrap();
            match pieces {
                // None run: dropping quantizes everything.
                0 => {}
                // Only the first of three pieces runs.
                3 => prep.run(0, 3),
                _ => std::thread::scope(|s| {
                    let prep = &prep;
                    let half = pieces / 2;
                    s.spawn(move || (0..half).for_each(|t| prep.run(t, pieces)));
                    (half..pieces).for_each(|t| prep.run(t, pieces));
                }),
            }
            drop(prep);
            assert_eq!(
                a.to_ggml_bytes(),
                base.to_ggml_bytes(),
                "{dtype} pieces={pieces}"
            );
            let mut got = vec![0.0f32; m * n];
            dot_rows(dtype, &w, n, k, &a, &mut got, n).unwrap();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{dtype} pieces={pieces}");
        }
    }
}

/// The declared list of weight dtypes is exactly what `dot_rows` accepts.
#[test]
fn dot_weight_dtypes_are_exactly_the_supported_ones() {
    let supported: Vec<DType> = DType::ALL
        .into_iter()
        .filter(|&d| arbor_quant::is_dot_supported(d))
        .collect();
    let mut declared = DOT.to_vec();
    declared.sort_by_key(|d| DType::ALL.iter().position(|a| a == d));
    assert_eq!(declared, supported);
}
