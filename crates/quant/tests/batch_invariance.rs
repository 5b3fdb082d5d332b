//! Batch invariance of `dot_rows` at every SIMD level: an activation row's
//! outputs are bit-identical whatever the number of activation rows `m`,
//! whatever the other rows hold, wherever the row sits in the batch, and
//! however the weight rows are split between calls (as the CPU backend's
//! threads split them).
#![allow(clippy::unwrap_used)]

use arbor_quant::{DType, SimdLevel, dot_rows_with, prepare_acts, quantize, row_bytes};

const DOT: [DType; 17] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::F8_S32,
    DType::U4_S32,
    DType::U8_S32,
    DType::F4_S16,
];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn normal(&mut self) -> f32 {
        let u1 = ((self.next() >> 40) as f32 / (1u64 << 24) as f32).max(1e-7);
        let u2 = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }
    fn normals(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal()).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn weights(rng: &mut Rng, dtype: DType, n: usize, k: usize) -> Vec<u8> {
    let x = rng.normals(n * k);
    let mut w = vec![0u8; row_bytes(dtype, n * k).unwrap()];
    quantize(dtype, &x, &mut w).unwrap();
    w
}

/// `x · wᵀ` with `dot_rows_with` at `level`, the weight rows split at `cuts`.
#[allow(clippy::too_many_arguments)]
fn product(
    level: SimdLevel,
    dtype: DType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    cuts: &[usize],
) -> Vec<f32> {
    let acts = prepare_acts(dtype, x, m, k).unwrap();
    let rb = row_bytes(dtype, k).unwrap();
    let mut out = vec![f32::NAN; m * n];
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(n);
    for p in bounds.windows(2) {
        let (r0, r1) = (p[0], p[1]);
        if r0 == r1 {
            continue;
        }
        // Columns r0..r1 of every row: a strided view starting at r0.
        let mut part = vec![0.0f32; (m - 1) * n + (r1 - r0)];
        dot_rows_with(
            level,
            dtype,
            &w[r0 * rb..r1 * rb],
            r1 - r0,
            k,
            &acts,
            &mut part,
            n,
        )
        .unwrap();
        for i in 0..m {
            out[i * n + r0..i * n + r1].copy_from_slice(&part[i * n..i * n + r1 - r0]);
        }
    }
    out
}

#[test]
fn rows_are_bit_identical_for_every_batch_shape() {
    let mut rng = Rng(2024);
    for dtype in DOT {
        // A k with a partial last vector / chunk where the format allows,
        // and for the float formats also whole 32-element steps (AMX tiles).
        let ks: &[usize] = match dtype.block_size() {
            1 => &[1000, 576],
            32 => &[32 * 29],
            _ => &[256 * 3],
        };
        for &k in ks {
            rows_keep_their_bits(&mut rng, dtype, k);
        }
    }
}

/// One case of [`rows_are_bit_identical_for_every_batch_shape`].
fn rows_keep_their_bits(rng: &mut Rng, dtype: DType, k: usize) {
    let n = 77;
    let w = weights(rng, dtype, n, k);
    let probe = rng.normals(k);
    for level in SimdLevel::available() {
        let single = product(level, dtype, &w, n, k, &probe, 1, &[]);
        for m in [1usize, 2, 3, 4, 5, 7, 8, 9, 16, 31, 32, 33, 100] {
            let mut x = rng.normals(m * k);
            let at = rng.below(m);
            x[at * k..(at + 1) * k].copy_from_slice(&probe);
            let cuts = [rng.below(n / 2), n / 2 + rng.below(n / 2)];
            let got = product(level, dtype, &w, n, k, &x, m, &cuts);
            for r in 0..n {
                assert_eq!(
                    got[at * n + r].to_bits(),
                    single[r].to_bits(),
                    "{dtype} {level:?}: m={m}, row {at}, column {r}: {} vs m=1 {}",
                    got[at * n + r],
                    single[r]
                );
            }
        }
    }
}

/// Gives each run of `group` consecutive `u4_s32` blocks the bytes `params`
/// of its first block: 16..19 its scale and zero point, as a checkpoint's
/// groups of 64 or 128 inputs do (the kernels then reuse the first block's
/// value table); 16..18 the scale only, 18..19 the zero only (blocks whose
/// table must still be rebuilt).
fn share_u4_params(w: &mut [u8], group: usize, params: std::ops::Range<usize>) {
    for run in w.chunks_mut(20 * group) {
        let (first, rest) = run.split_at_mut(20);
        for block in rest.chunks_exact_mut(20) {
            block[params.clone()].copy_from_slice(&first[params.clone()]);
        }
    }
}

/// The scaled block formats dequantize in registers to exactly their
/// scalar dequantization, so their products equal the f32 kernel's on the
/// dequantized weights bit for bit, at every level and every `m` (a
/// checkpoint stored packed computes what its f32 dequantization would).
/// `u4_s32` also runs with parameters shared by 2 and 4 consecutive blocks,
/// and with only the scale or only the zero point shared.
#[test]
fn scaled_blocks_multiply_as_their_f32_dequantization() {
    let mut rng = Rng(7);
    for (dtype, group, params) in [
        (DType::F8_S32, 1, 0..0),
        (DType::U4_S32, 1, 0..0),
        (DType::U4_S32, 2, 16..19),
        (DType::U4_S32, 4, 16..19),
        (DType::U4_S32, 4, 16..18),
        (DType::U4_S32, 4, 18..19),
        (DType::U8_S32, 1, 0..0),
        (DType::F4_S16, 1, 0..0),
    ] {
        let (n, k) = (45, 32 * 12);
        let mut w = weights(&mut rng, dtype, n, k);
        if group > 1 {
            share_u4_params(&mut w, group, params.clone());
        }
        let mut wf = vec![0.0f32; n * k];
        arbor_quant::dequantize(dtype, &w, &mut wf).unwrap();
        let wb: Vec<u8> = wf.iter().flat_map(|v| v.to_le_bytes()).collect();
        for level in SimdLevel::available() {
            for m in [1usize, 2, 5, 8, 13, 40] {
                let x = rng.normals(m * k);
                let packed = product(level, dtype, &w, n, k, &x, m, &[n / 3]);
                let float = product(level, DType::F32, &wb, n, k, &x, m, &[]);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&packed),
                    bits(&float),
                    "{dtype} (bytes {params:?} shared by {group} blocks) {level:?}: m={m}"
                );
            }
        }
    }
}
