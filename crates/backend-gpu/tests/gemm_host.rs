//! The tensor-core GEMM of the scaled-block weights (`kernels/gemm.cu`), run
//! on the host emulator of the CUDA execution model (`kernels/host/simt.h`:
//! every thread a fiber, shared memory, barriers, shuffles, and
//! `mma.m16n8k16` computed from the PTX fragment layout), against an f64
//! product of the CPU's dequantization (`arbor_quant::dequantize`):
//! - every format (FP8 E4M3, 4-bit and 8-bit integers with zero points,
//!   NVFP4's E2M1), with shapes that leave partial tiles in rows, columns and
//!   inputs, within 3e-5 of the sum of |x w| (the bf16 split keeps about 16
//!   bits of each input);
//! - both tile shapes give the same bits, and a row's outputs are the same
//!   bits alone as in a batch (batch invariance);
//! - under two thread orders (a shared-memory race would change them);
//! - W8A8 FP8 (`quant_act_e4m3`, then `mma.m16n8k32` of E4M3 codes), with
//!   a scale per 32 inputs and with a static one: the input's codes and
//!   scales, and `round_act_e4m3`'s values, equal the CPU's
//!   (`arbor_quant::scaled`) bit for bit, the outputs
//!   the f64 product of the codes times both scales within 1e-5, the same
//!   checks of tiles and rows, and the error against the f32 input printed.
//!
//! The device suite runs the same kernels on a GPU; this checks their
//! indexing where none is. Skips without a C++ compiler (`host::compiler`).

mod host;

use anyhow::{Result, ensure};
use arbor_quant::DType;
use arbor_quant::scaled::{e4m3_to_f32, quantize_input_e4m3, round_input_e4m3};
use std::process::Command;

const MAIN: &str = r#"
#include <vector>
typedef void (*Kernel)(const float*, const unsigned char*, float*, int, int, int);
static const Kernel KERNELS[4][2] = {
    {gemm_f8_s32_m16, gemm_f8_s32_m64}, {gemm_u4_s32_m16, gemm_u4_s32_m64},
    {gemm_u8_s32_m16, gemm_u8_s32_m64}, {gemm_f4_s16_m16, gemm_f4_s16_m64}};
typedef void (*W8a8)(const unsigned char*, const float*, const unsigned char*, float*, int, int,
                     int);
static const W8a8 W8A8[2] = {gemm_f8_s32_w8a8_m16, gemm_f8_s32_w8a8_m64};
static const int ELEMS[4] = {32, 32, 32, 16}, BYTES[4] = {36, 20, 36, 12};

// argv[1]: records of 7 int32 (kind 0 = the bf16-split GEMM, 1 = W8A8 FP8;
// dtype 0..3, m, n, k, tile 0 = m16 / 1 = m64, seed) and 2 f32 (the static
// input scale's reciprocal and the scale, zeros for a scale per 32), then x
// (m k f32) and the weights; argv[2]: each record's m n f32 outputs, and for
// W8A8 the input's m k E4M3 codes, m k / 32 f32 scales and m k rounded
// values (round_act_e4m3).
int main(int argc, char** argv) {
    if (argc != 3) return 2;
    FILE* in = fopen(argv[1], "rb");
    FILE* out = fopen(argv[2], "wb");
    if (!in || !out) return 2;
    int h[7];
    float sc[2];
    while (fread(h, 4, 7, in) == 7 && fread(sc, 4, 2, in) == 2) {
        const int kind = h[0], dt = h[1], m = h[2], n = h[3], k = h[4], big = h[5];
        const uint64_t seed = (uint64_t)h[6];
        const float inv = sc[0], scale = sc[1];
        std::vector<float> x((size_t)m * k), y((size_t)m * n, NAN), s((size_t)m * k / 32, NAN);
        std::vector<float> r((size_t)m * k, NAN);
        std::vector<unsigned char> w((size_t)n * (k / ELEMS[dt]) * BYTES[dt]), q((size_t)m * k);
        if (fread(x.data(), 4, x.size(), in) != x.size()) return 2;
        if (fread(w.data(), 1, w.size(), in) != w.size()) return 2;
        const unsigned bm = big ? 64 : 16, bn = big ? 64 : 32;
        const dim3 grid{(n + bn - 1) / bn, (m + bm - 1) / bm, 1};
        const float* xp = x.data();
        const unsigned char* wp = w.data();
        float *yp = y.data(), *sp = s.data(), *rp = r.data();
        unsigned char* qp = q.data();
        if (kind == 0) {
            const Kernel kern = KERNELS[dt][big];
            simt::launch(grid, dim3{128, 1, 1}, seed, [=] { kern(xp, wp, yp, m, n, k); });
        } else {
            const unsigned warps = (unsigned)((size_t)m * k / 32);
            simt::launch(dim3{(warps + 7) / 8, 1, 1}, dim3{256, 1, 1}, seed,
                         [=] { quant_act_e4m3(xp, qp, sp, m, k, inv, scale); });
            simt::launch(dim3{(warps + 7) / 8, 1, 1}, dim3{256, 1, 1}, seed,
                         [=] { round_act_e4m3(xp, rp, m, k, inv, scale); });
            const W8a8 kern = W8A8[big];
            simt::launch(grid, dim3{128, 1, 1}, seed, [=] { kern(qp, sp, wp, yp, m, n, k); });
        }
        fwrite(y.data(), 4, y.size(), out);
        if (kind == 1) {
            fwrite(q.data(), 1, q.size(), out);
            fwrite(s.data(), 4, s.size(), out);
            fwrite(r.data(), 4, r.size(), out);
        }
    }
    fclose(out);
    return 0;
}
"#;

const FORMATS: [DType; 4] = [DType::F8_S32, DType::U4_S32, DType::U8_S32, DType::F4_S16];

struct Case {
    dtype: DType,
    m: usize,
    n: usize,
    k: usize,
    x: Vec<f32>,
    w: Vec<u8>,
}

impl Case {
    fn new(dtype: DType, m: usize, n: usize, k: usize, seed: u64) -> Result<Self> {
        let mut rng = host::Lcg(seed);
        // Inputs over several binades, weights with a per-row magnitude.
        let x: Vec<f32> = (0..m * k)
            .map(|i| rng.next() * [1.0, 0.01, 30.0][i % 3])
            .collect();
        let wf: Vec<f32> = (0..n * k)
            .map(|i| rng.next() * (1 + i / k % 5) as f32 * 0.25)
            .collect();
        let mut w = vec![0u8; arbor_quant::row_bytes(dtype, k)? * n];
        arbor_quant::quantize(dtype, &wf, &mut w)?;
        if dtype == DType::U8_S32 {
            // Zero points of 256 (8-bit GPTQ's largest) in every other block.
            for b in w.chunks_exact_mut(36).step_by(2) {
                b[34..36].copy_from_slice(&256u16.to_le_bytes());
            }
        }
        Ok(Self {
            dtype,
            m,
            n,
            k,
            x,
            w,
        })
    }

    /// Rows `rows` of this case as their own case.
    fn rows(&self, rows: std::ops::Range<usize>) -> Self {
        Self {
            m: rows.len(),
            x: self.x[rows.start * self.k..rows.end * self.k].to_vec(),
            w: self.w.clone(),
            ..*self
        }
    }

    fn record(&self, job: &Job, out: &mut Vec<u8>) {
        let dt = FORMATS.iter().position(|&d| d == self.dtype).unwrap_or(0) as i32;
        let (m, n, k) = (self.m as i32, self.n as i32, self.k as i32);
        let head = [job.w8a8 as i32, dt, m, n, k, job.big as i32, job.seed];
        for v in head {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let (inv, scale) = job.input_scale.map_or((0.0, 0.0), |s| (1.0 / s, s));
        for v in [inv, scale] {
            out.extend_from_slice(&f32::to_le_bytes(v));
        }
        for v in &self.x {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.w);
    }

    /// The f64 product of x with the CPU's dequantized weights, and the
    /// sums of |x w| (the error scale).
    fn reference(&self) -> Result<(Vec<f64>, Vec<f64>)> {
        let mut wd = vec![0f32; self.n * self.k];
        arbor_quant::dequantize(self.dtype, &self.w, &mut wd)?;
        let (mut y, mut mag) = (vec![0f64; self.m * self.n], vec![0f64; self.m * self.n]);
        for r in 0..self.m {
            for c in 0..self.n {
                for i in 0..self.k {
                    let p = self.x[r * self.k + i] as f64 * wd[c * self.k + i] as f64;
                    y[r * self.n + c] += p;
                    mag[r * self.n + c] += p.abs();
                }
            }
        }
        Ok((y, mag))
    }
}

/// One run of the emulated kernels.
struct Job<'a> {
    case: &'a Case,
    /// W8A8 FP8 (the input quantized to E4M3) instead of the bf16 split.
    w8a8: bool,
    /// The 64 x 64 tiles instead of 16 x 32.
    big: bool,
    /// Permutes the order threads take turns in.
    seed: i32,
    /// W8A8's static input scale (`None`: a scale per 32 inputs).
    input_scale: Option<f32>,
}

/// A job's outputs; for W8A8 also the input's E4M3 codes and scales, and
/// the values they stand for (`round_act_e4m3`).
struct Outputs {
    y: Vec<f32>,
    q: Vec<u8>,
    s: Vec<f32>,
    r: Vec<f32>,
}

fn job(case: &Case, w8a8: bool, big: bool, seed: i32) -> Job<'_> {
    Job {
        case,
        w8a8,
        big,
        seed,
        input_scale: None,
    }
}

/// Runs each job through the emulated kernels.
fn run(bin: &std::path::Path, jobs: &[Job]) -> Result<Vec<Outputs>> {
    let mut bytes = Vec::new();
    for j in jobs {
        j.case.record(j, &mut bytes);
    }
    let raw = host::run_records(bin, &bytes)?;
    let mut at = 0;
    let mut take = |len: usize| -> Result<&[u8]> {
        let s = raw
            .get(at..at + len)
            .ok_or_else(|| anyhow::anyhow!("short output"))?;
        at += len;
        Ok(s)
    };
    let mut outs = Vec::new();
    for j in jobs {
        let (m, n, k) = (j.case.m, j.case.n, j.case.k);
        let y = host::floats(take(4 * m * n)?);
        let (q, s, r) = if j.w8a8 {
            let q = take(m * k)?.to_vec();
            let s = host::floats(take(4 * m * k / 32)?);
            (q, s, host::floats(take(4 * m * k)?))
        } else {
            (Vec::new(), Vec::new(), Vec::new())
        };
        outs.push(Outputs { y, q, s, r });
    }
    ensure!(at == raw.len(), "extra output");
    Ok(outs)
}

/// The emulator, the GEMM kernels and [`MAIN`] as one host executable, or
/// `None` without a C++ compiler.
fn build_kernels() -> Result<Option<host::Emulated>> {
    let kernels = [
        include_str!("../kernels/common.cuh"),
        include_str!("../kernels/fp8.cuh"),
        include_str!("../kernels/mma.cuh"),
        include_str!("../kernels/dequant.cu"),
        include_str!("../kernels/gemm.cu"),
    ];
    host::build_on_emulator("gemm_host", &kernels, MAIN)
}

#[test]
fn scaled_block_gemm_on_the_host_emulator_matches_the_cpu_dequantization() -> Result<()> {
    let Some(emulated) = build_kernels()? else {
        return Ok(());
    };
    let bin = &emulated.bin;
    let mut checked = 0;
    for (i, dtype) in FORMATS.into_iter().enumerate() {
        // Partial tiles in every direction; k past one chunk of 64.
        let case = Case::new(dtype, 21, 72, 160, 7 + i as u64)?;
        let (want, mag) = case.reference()?;
        let alone = case.rows(3..4);
        let tail = case.rows(17..21);
        let outs = run(
            bin,
            &[
                job(&case, false, false, 0),
                job(&case, false, true, 0),
                job(&case, false, true, 5),
                job(&alone, false, false, 1),
                job(&tail, false, true, 2),
            ],
        )?;
        let outs: Vec<Vec<f32>> = outs.into_iter().map(|o| o.y).collect();
        let got = &outs[0];
        for (j, (&g, (&w, &s))) in got.iter().zip(want.iter().zip(&mag)).enumerate() {
            let err = (g as f64 - w).abs();
            ensure!(
                err <= 3e-5 * s + 1e-30,
                "{dtype} out[{}][{}] = {g}, f64 reference {w} (sum |xw| {s})",
                j / case.n,
                j % case.n
            );
        }
        ensure!(
            host::same_bits(got, &outs[1]),
            "{dtype}: the 16x32 and 64x64 tiles differ"
        );
        ensure!(
            host::same_bits(&outs[1], &outs[2]),
            "{dtype}: another thread order changed the output"
        );
        ensure!(
            host::same_bits(&got[3 * case.n..4 * case.n], &outs[3]),
            "{dtype}: row 3 alone differs from row 3 in the batch"
        );
        ensure!(
            host::same_bits(&got[17 * case.n..], &outs[4]),
            "{dtype}: rows 17..21 alone differ from the batch"
        );
        checked += got.len();
    }
    println!("{checked} outputs of 4 formats checked on the host emulator");
    Ok(())
}

#[test]
fn w8a8_fp8_gemm_on_the_host_emulator_matches_the_quantized_product() -> Result<()> {
    let Some(emulated) = build_kernels()? else {
        return Ok(());
    };
    let bin = &emulated.bin;
    let mut case = Case::new(DType::F8_S32, 21, 72, 160, 3)?;
    // An all-zero input block (scale 0) and one of a single large value.
    case.x[32..64].fill(0.0);
    case.x[5 * 160 + 64] = 3.0e4;
    // A scale per 32 inputs, and a static one that saturates |x| > 8.96.
    for input_scale in [None, Some(0.02f32)] {
        let (alone, tail) = (case.rows(3..4), case.rows(17..21));
        let mut jobs = [
            job(&case, true, false, 0),
            job(&case, true, true, 4),
            job(&alone, true, false, 1),
            job(&tail, true, true, 2),
        ];
        for j in &mut jobs {
            j.input_scale = input_scale;
        }
        let outs = run(bin, &jobs)?;
        check_w8a8(&case, input_scale, &outs)?;
    }
    Ok(())
}

/// The W8A8 outputs of `case` (the whole case with both tiles, then rows 3
/// and 17..21 alone) against the CPU's input quantization and the f64
/// product of its codes.
fn check_w8a8(case: &Case, input_scale: Option<f32>, outs: &[Outputs]) -> Result<()> {
    let (m, n, k) = (case.m, case.n, case.k);
    let (q, s) = quantize_input_e4m3(&case.x, input_scale);
    ensure!(outs[0].q == q, "E4M3 codes differ from the CPU's");
    ensure!(
        host::same_bits(&outs[0].s, &s),
        "input scales differ from the CPU's"
    );
    let mut rounded = vec![0f32; m * k];
    round_input_e4m3(&case.x, input_scale, &mut rounded);
    ensure!(
        host::same_bits(&outs[0].r, &rounded),
        "round_act_e4m3 differs from the CPU's rounding"
    );
    // The product of the codes, scaled per block, in f64.
    let (blocks, got) = (k / 32, &outs[0].y);
    let (exact, exact_mag) = case.reference()?;
    let mut worst = 0f64;
    for r in 0..m {
        for c in 0..n {
            let (mut want, mut mag) = (0f64, 0f64);
            for b in 0..blocks {
                let wb = &case.w[(c * blocks + b) * 36..][..36];
                let sw = f32::from_le_bytes([wb[32], wb[33], wb[34], wb[35]]) as f64;
                let sx = s[r * blocks + b] as f64;
                for i in 0..32 {
                    let p = e4m3_to_f32(q[r * k + b * 32 + i]) as f64
                        * e4m3_to_f32(wb[i]) as f64
                        * sx
                        * sw;
                    want += p;
                    mag += p.abs();
                }
            }
            let g = got[r * n + c] as f64;
            ensure!(
                (g - want).abs() <= 1e-5 * mag + 1e-30,
                "out[{r}][{c}] = {g}, quantized reference {want} (sum |xw| {mag})"
            );
            worst = worst.max((g - exact[r * n + c]).abs() / exact_mag[r * n + c]);
        }
    }
    ensure!(
        host::same_bits(got, &outs[1].y),
        "the 16x32 and 64x64 tiles differ"
    );
    ensure!(
        host::same_bits(&got[3 * n..4 * n], &outs[2].y),
        "row 3 alone differs"
    );
    ensure!(
        host::same_bits(&got[17 * n..], &outs[3].y),
        "rows 17..21 alone differ"
    );
    println!(
        "W8A8 ({input_scale:?}): {} outputs equal the E4M3 product; against the f32 input, max error {:.2}% of sum |xw|",
        got.len(),
        100.0 * worst
    );
    Ok(())
}

#[test]
fn the_emulator_refuses_a_barrier_a_returned_thread_cannot_reach() -> Result<()> {
    let main = r#"
__global__ void early_return(int* out) {
    if (threadIdx.x == 5) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}
int main() {
    static int out[128];
    simt::launch(dim3{1, 1, 1}, dim3{128, 1, 1}, 0, [] { early_return(out); });
    return 0;
}
"#;
    let Some(emulated) = host::build_on_emulator("early_return", &[], main)? else {
        return Ok(());
    };
    let out = Command::new(&emulated.bin).output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "the emulator ran a broken barrier");
    ensure!(err.contains("returned"), "unexpected message: {err}");
    Ok(())
}
