//! Layout checks against gguf-py (an independent numpy port of ggml), using
//! fixtures written by `tests/data/make_fixtures.py`: dequantization of every
//! block format, the reference quantizers of the 32-element formats, and four
//! rows of real SmolLM2-135M tensors (Q4_1 and Q8_0).
#![allow(clippy::unwrap_used)]

use arbor_quant::{DType, dequantize, quantize};

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn check_dequant(dtype: DType, bin: &[u8], expect: &[u8]) {
    let expect = f32s(expect);
    let mut got = vec![0.0f32; expect.len()];
    dequantize(dtype, bin, &mut got).unwrap();
    for (i, (g, e)) in got.iter().zip(&expect).enumerate() {
        assert!(
            g.to_bits() == e.to_bits() || (g - e).abs() <= 1e-6 * e.abs().max(1e-3),
            "{dtype} element {i}: got {g}, gguf-py {e}"
        );
    }
}

macro_rules! fixture {
    ($name:literal) => {
        (
            &include_bytes!(concat!("data/", $name, ".bin"))[..],
            &include_bytes!(concat!("data/", $name, ".f32"))[..],
        )
    };
}

#[test]
fn dequantize_matches_gguf_py() {
    let cases = [
        (DType::Q4_0, fixture!("q4_0")),
        (DType::Q4_1, fixture!("q4_1")),
        (DType::Q5_0, fixture!("q5_0")),
        (DType::Q5_1, fixture!("q5_1")),
        (DType::Q8_0, fixture!("q8_0")),
        (DType::Q2_K, fixture!("q2_k")),
        (DType::Q3_K, fixture!("q3_k")),
        (DType::Q4_K, fixture!("q4_k")),
        (DType::Q5_K, fixture!("q5_k")),
        (DType::Q6_K, fixture!("q6_k")),
        (DType::Q4_1, fixture!("model_attn_q_q4_1")),
        (DType::Q8_0, fixture!("model_token_embd_q8_0")),
    ];
    for (dtype, (bin, f)) in cases {
        check_dequant(dtype, bin, f);
    }
}

#[test]
fn reference_quantizers_match_gguf_py() {
    let cases = [
        (
            DType::Q4_0,
            include_bytes!("data/q4_0.src"),
            fixture!("q4_0").0,
        ),
        (
            DType::Q4_1,
            include_bytes!("data/q4_1.src"),
            fixture!("q4_1").0,
        ),
        (
            DType::Q5_0,
            include_bytes!("data/q5_0.src"),
            fixture!("q5_0").0,
        ),
        (
            DType::Q5_1,
            include_bytes!("data/q5_1.src"),
            fixture!("q5_1").0,
        ),
        (
            DType::Q8_0,
            include_bytes!("data/q8_0.src"),
            fixture!("q8_0").0,
        ),
    ];
    for (dtype, src, expect) in cases {
        let x = f32s(src);
        let mut got = vec![0u8; expect.len()];
        quantize(dtype, &x, &mut got).unwrap();
        let bb = dtype.block_bytes();
        for (b, (g, e)) in got.chunks(bb).zip(expect.chunks(bb)).enumerate() {
            assert_eq!(g, e, "{dtype} block {b} differs from gguf-py");
        }
    }
}
