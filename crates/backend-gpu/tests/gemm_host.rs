//! The tensor-core GEMM of the scaled-block weights (`kernels/gemm.cu`), run
//! on the host emulator of the CUDA execution model (`tests/host/simt.h`:
//! every thread a fiber, shared memory, barriers, shuffles, and
//! `mma.m16n8k16` computed from the PTX fragment layout), against an f64
//! product of the CPU's dequantization (`arbor_quant::dequantize`):
//! - every format (FP8 E4M3, 4-bit and 8-bit integers with zero points,
//!   NVFP4's E2M1), with shapes that leave partial tiles in rows, columns and
//!   inputs, within 3e-5 of the sum of |x w| (the bf16 split keeps about 16
//!   bits of each input);
//! - both tile shapes give the same bits, and a row's outputs are the same
//!   bits alone as in a batch (batch invariance);
//! - under two thread orders (a shared-memory race would change them).
//!
//! The device suite runs the same kernels on a GPU; this checks their
//! indexing where none is. Skips without a C++ compiler (`host::compiler`).

mod host;

use anyhow::{Result, bail, ensure};
use arbor_quant::DType;
use std::io::Write;
use std::process::Command;

const MAIN: &str = r#"
#include <vector>
typedef void (*Kernel)(const float*, const unsigned char*, float*, int, int, int);
static const Kernel KERNELS[4][2] = {
    {gemm_f8_s32_m16, gemm_f8_s32_m64}, {gemm_u4_s32_m16, gemm_u4_s32_m64},
    {gemm_u8_s32_m16, gemm_u8_s32_m64}, {gemm_f4_s16_m16, gemm_f4_s16_m64}};
static const int ELEMS[4] = {32, 32, 32, 16}, BYTES[4] = {36, 20, 36, 12};

// argv[1]: records of 6 int32 (dtype 0..3, m, n, k, tile 0 = m16 / 1 = m64,
// seed), then x (m k f32) and the weights; argv[2]: each record's m n f32.
int main(int argc, char** argv) {
    if (argc != 3) return 2;
    FILE* in = fopen(argv[1], "rb");
    FILE* out = fopen(argv[2], "wb");
    if (!in || !out) return 2;
    int h[6];
    while (fread(h, 4, 6, in) == 6) {
        const int dt = h[0], m = h[1], n = h[2], k = h[3], big = h[4];
        std::vector<float> x((size_t)m * k), y((size_t)m * n, NAN);
        std::vector<unsigned char> w((size_t)n * (k / ELEMS[dt]) * BYTES[dt]);
        if (fread(x.data(), 4, x.size(), in) != x.size()) return 2;
        if (fread(w.data(), 1, w.size(), in) != w.size()) return 2;
        const unsigned bm = big ? 64 : 16, bn = big ? 64 : 32;
        const Kernel kern = KERNELS[dt][big];
        const float* xp = x.data();
        const unsigned char* wp = w.data();
        float* yp = y.data();
        simt::launch(dim3{(n + bn - 1) / bn, (m + bm - 1) / bm, 1}, dim3{128, 1, 1},
                     (uint64_t)h[5], [=] { kern(xp, wp, yp, m, n, k); });
        fwrite(y.data(), 4, y.size(), out);
    }
    fclose(out);
    return 0;
}
"#;

const FORMATS: [DType; 4] = [DType::F8_S32, DType::U4_S32, DType::U8_S32, DType::F4_S16];

/// A seeded uniform generator in [-1, 1).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

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
        let mut rng = Lcg(seed);
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

    fn record(&self, big: bool, seed: i32, out: &mut Vec<u8>) {
        let dt = FORMATS.iter().position(|&d| d == self.dtype).unwrap_or(0) as i32;
        let head = [
            dt,
            self.m as i32,
            self.n as i32,
            self.k as i32,
            big as i32,
            seed,
        ];
        for v in head {
            out.extend_from_slice(&v.to_le_bytes());
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

/// Runs each (case, tile, seed) through the emulated kernel.
fn run(bin: &std::path::Path, jobs: &[(&Case, bool, i32)]) -> Result<Vec<Vec<f32>>> {
    let dir = tempfile::tempdir()?;
    let (inp, outp) = (dir.path().join("in.bin"), dir.path().join("out.bin"));
    let mut bytes = Vec::new();
    for (case, big, seed) in jobs {
        case.record(*big, *seed, &mut bytes);
    }
    std::fs::File::create(&inp)?.write_all(&bytes)?;
    let st = Command::new(bin).arg(&inp).arg(&outp).output()?;
    if !st.status.success() {
        bail!("emulated gemm: {}", String::from_utf8_lossy(&st.stderr));
    }
    let raw = std::fs::read(&outp)?;
    let mut floats = raw
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    jobs.iter()
        .map(|(c, _, _)| {
            let v: Vec<f32> = floats.by_ref().take(c.m * c.n).collect();
            ensure!(v.len() == c.m * c.n, "short output");
            Ok(v)
        })
        .collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn scaled_block_gemm_on_the_host_emulator_matches_the_cpu_dequantization() -> Result<()> {
    let Some(cxx) = host::compiler("kernels/gemm.cu")? else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let source = [
        include_str!("host/simt.h"),
        include_str!("../kernels/common.cuh"),
        include_str!("../kernels/mma.cuh"),
        include_str!("../kernels/dequant.cu"),
        include_str!("../kernels/gemm.cu"),
        MAIN,
    ]
    .join("\n");
    let bin = host::build(&cxx, dir.path(), "gemm_host", &source)?;
    let mut checked = 0;
    for (i, dtype) in FORMATS.into_iter().enumerate() {
        // Partial tiles in every direction; k past one chunk of 64.
        let case = Case::new(dtype, 21, 72, 160, 7 + i as u64)?;
        let (want, mag) = case.reference()?;
        let alone = case.rows(3..4);
        let tail = case.rows(17..21);
        let outs = run(
            &bin,
            &[
                (&case, false, 0),
                (&case, true, 0),
                (&case, true, 5),
                (&alone, false, 1),
                (&tail, true, 2),
            ],
        )?;
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
            same_bits(got, &outs[1]),
            "{dtype}: the 16x32 and 64x64 tiles differ"
        );
        ensure!(
            same_bits(&outs[1], &outs[2]),
            "{dtype}: another thread order changed the output"
        );
        ensure!(
            same_bits(&got[3 * case.n..4 * case.n], &outs[3]),
            "{dtype}: row 3 alone differs from row 3 in the batch"
        );
        ensure!(
            same_bits(&got[17 * case.n..], &outs[4]),
            "{dtype}: rows 17..21 alone differ from the batch"
        );
        checked += got.len();
    }
    println!("{checked} outputs of 4 formats checked on the host emulator");
    Ok(())
}

#[test]
fn the_emulator_refuses_a_barrier_a_returned_thread_cannot_reach() -> Result<()> {
    let Some(cxx) = host::compiler("tests/host/simt.h")? else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let source = format!(
        "{}\n{}",
        include_str!("host/simt.h"),
        r#"
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
"#
    );
    let bin = host::build(&cxx, dir.path(), "early_return", &source)?;
    let out = Command::new(&bin).output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "the emulator ran a broken barrier");
    ensure!(err.contains("returned"), "unexpected message: {err}");
    Ok(())
}
