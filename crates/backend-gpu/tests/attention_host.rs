//! The paged attention kernels (`kernels/attention.cu`) on the host emulator
//! of the CUDA execution model (`kernels/host/simt.h`), against an f64
//! attention written here from the layout the launcher uploads (`seq_info`
//! rows of q_start, q_len, kv_len, page_start; a page table; caches of
//! [slot][kv_head][head_dim]):
//! - the f32-math prefill with f32 and bf16 caches (tiles of 64, 32 and 16
//!   rows, as `attention::prefill_kernel` picks them for the shared memory of
//!   an H100, an A100-class GPU and AMD's LDS) and the tensor-core prefill
//!   (`prefill_mma_bf16_d64/_d128`, `mma.m16n8k16` with Q and P split into
//!   bf16 parts), over cached prefixes, partial tiles, grouped-query heads,
//!   pages in shuffled order, with and without a sliding window; latent
//!   attention's 576-wide heads in 16-row tiles;
//! - flash-decoding (`decode_split_*` over 1 and 3 splits, then
//!   `decode_merge`) of f32 and bf16 caches, 576-wide heads too, and a decode row the same bits
//!   with any sufficient grid and beside other sequences (batch invariance).
//!
//! Within 1e-5 of the largest output (the f32 kernels) and 3e-5 (the bf16
//! split of the tensor-core kernel), and the same bits under two thread
//! orders. The device suite runs them on a GPU; this checks them in CI
//! where none is. Skips without a C++ compiler (`host::compiler`).

mod host;

use anyhow::{Result, bail, ensure};
use arbor_backend_gpu::attention::{decode_kernel, prefill_kernel, prefill_mma_kernel};
use arbor_backend_gpu::kernels::K;
use arbor_engine_core::DType;

const MAIN: &str = r#"
#include <string>
#include <vector>

// One launch described by the test: a kernel name, sizes and the batch.
struct Job {
    std::string name;
    int seqs, rows, heads, kv_heads, hd, ps, window, grid_x, threads, splits, kv_bytes;
    size_t smem;
    float scale;
    uint64_t seed;
    std::vector<float> q;
    std::vector<unsigned char> kc, vc;
    std::vector<int> seq_info;
    std::vector<u32> pages;
};

template <typename T> static bool read_vec(FILE* in, std::vector<T>& v, size_t n) {
    v.resize(n);
    return fread(v.data(), sizeof(T), n, in) == n;
}

#define PREFILL_CASE(NAME, KV)                                                              \
    if (j.name == #NAME) {                                                                  \
        simt::launch(dim3{(unsigned)j.grid_x, (unsigned)j.heads, (unsigned)j.seqs},         \
                     dim3{(unsigned)j.threads, 1, 1}, j.seed, [=] {                          \
                         NAME(q, (const KV*)kc, (const KV*)vc, si, pt, nullptr, out, j.heads, \
                              j.kv_heads, j.hd, j.ps, j.scale, j.window, 1.0f, 1.0f);         \
                     }, j.smem);                                                            \
        return true;                                                                        \
    }
#define DECODE_CASE(NAME, KV)                                                               \
    if (j.name == #NAME) {                                                                  \
        std::vector<float> po((size_t)j.seqs * j.heads * j.splits * j.hd),                  \
            pm((size_t)j.seqs * j.heads * j.splits * 2);                                    \
        float *pop = po.data(), *pmp = pm.data();                                           \
        simt::launch(dim3{(unsigned)j.seqs, (unsigned)j.kv_heads, (unsigned)j.splits},       \
                     dim3{128, 1, 1}, j.seed, [=] {                                          \
                         NAME(q, (const KV*)kc, (const KV*)vc, si, pt, pop, pmp, j.heads,     \
                              j.kv_heads, j.hd, j.ps, j.splits, j.scale, j.window, 1.0f, 1.0f); \
                     });                                                                    \
        simt::launch(dim3{(unsigned)j.seqs, (unsigned)j.heads, 1}, dim3{128, 1, 1}, j.seed,  \
                     [=] { decode_merge(pop, pmp, si, out, j.heads, j.hd, j.splits); });     \
        return true;                                                                        \
    }

static bool run(const Job& j, float* out) {
    const float* q = j.q.data();
    const unsigned char *kc = j.kc.data(), *vc = j.vc.data();
    const int* si = j.seq_info.data();
    const u32* pt = j.pages.data();
    PREFILL_CASE(prefill_f32_d128, float)
    PREFILL_CASE(prefill_bf16_d128, bf16_t)
    PREFILL_CASE(prefill_f32_d256, float)
    PREFILL_CASE(prefill_bf16_d256, bf16_t)
    PREFILL_CASE(prefill_f32_d256_small, float)
    PREFILL_CASE(prefill_bf16_d256_small, bf16_t)
    PREFILL_CASE(prefill_mma_bf16_d64, bf16_t)
    PREFILL_CASE(prefill_mma_bf16_d128, bf16_t)
    DECODE_CASE(decode_split_f32_d128, float)
    DECODE_CASE(decode_split_bf16_d128, bf16_t)
    PREFILL_CASE(prefill_f32_d576, float)
    PREFILL_CASE(prefill_bf16_d576, bf16_t)
    DECODE_CASE(decode_split_f32_d576, float)
    DECODE_CASE(decode_split_bf16_d576, bf16_t)
    return false;
}

// argv[1]: records of a 32-byte kernel name, 12 int32 (seqs, rows, heads,
// kv_heads, head_dim, page_size, window, grid x, threads, splits, KV element
// bytes, slots), the shared memory bytes (u64), scale (f32), seed (u64), the
// page count (int32), then q, K cache, V cache, seq_info, page table.
// argv[2]: each record's rows x heads x head_dim outputs.
int main(int argc, char** argv) {
    if (argc != 3) return 2;
    FILE* in = fopen(argv[1], "rb");
    FILE* out = fopen(argv[2], "wb");
    if (!in || !out) return 2;
    char name[32];
    while (fread(name, 1, 32, in) == 32) {
        Job j;
        j.name = std::string(name, strnlen(name, 32));
        int h[12], npages;
        if (fread(h, 4, 12, in) != 12 || fread(&j.smem, 8, 1, in) != 1 ||
            fread(&j.scale, 4, 1, in) != 1 || fread(&j.seed, 8, 1, in) != 1 ||
            fread(&npages, 4, 1, in) != 1)
            return 2;
        j.seqs = h[0], j.rows = h[1], j.heads = h[2], j.kv_heads = h[3], j.hd = h[4];
        j.ps = h[5], j.window = h[6], j.grid_x = h[7], j.threads = h[8], j.splits = h[9];
        j.kv_bytes = h[10];
        const size_t cache = (size_t)h[11] * j.kv_heads * j.hd * j.kv_bytes;
        if (!read_vec(in, j.q, (size_t)j.rows * j.heads * j.hd) || !read_vec(in, j.kc, cache) ||
            !read_vec(in, j.vc, cache) || !read_vec(in, j.seq_info, (size_t)j.seqs * 4) ||
            !read_vec(in, j.pages, (size_t)npages))
            return 2;
        std::vector<float> o((size_t)j.rows * j.heads * j.hd, NAN);
        if (!run(j, o.data())) {
            fprintf(stderr, "unknown kernel %s\n", j.name.c_str());
            return 2;
        }
        fwrite(o.data(), 4, o.size(), out);
    }
    fclose(out);
    return 0;
}
"#;

fn bf16_round(v: f32) -> f32 {
    let u = v.to_bits();
    f32::from_bits((u + 0x7fff + ((u >> 16) & 1)) & 0xffff_0000)
}

/// A batch of sequences over a paged cache, and its f64 attention.
struct Batch {
    kv: DType,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    ps: usize,
    window: usize,
    scale: f32,
    /// (q_len, kv_len) per sequence; queries are each sequence's last q_len positions.
    seqs: Vec<(usize, usize)>,
    q: Vec<f32>,
    /// Cache values per slot (bf16-exact for a bf16 cache).
    k: Vec<f32>,
    v: Vec<f32>,
    /// Page table, and each sequence's first entry in it.
    pages: Vec<u32>,
    page_start: Vec<usize>,
}

impl Batch {
    fn new(kv: DType, hd: usize, window: usize, seqs: &[(usize, usize)], seed: u64) -> Self {
        let (heads, kv_heads, ps) = (4, 2, 16);
        let mut rng = host::Lcg(seed);
        let rows: usize = seqs.iter().map(|s| s.0).sum();
        let npages: usize = seqs.iter().map(|s| s.1.div_ceil(ps)).sum();
        let slots = (npages + 1) * ps;
        let round = |x: f32| if kv == DType::BF16 { bf16_round(x) } else { x };
        let q = (0..rows * heads * hd).map(|_| rng.next()).collect();
        let k = (0..slots * kv_heads * hd)
            .map(|_| round(rng.next()))
            .collect();
        let v = (0..slots * kv_heads * hd)
            .map(|_| round(rng.next()))
            .collect();
        // Pages in a shuffled order (page npages stays unused).
        let mut pages: Vec<u32> = (0..npages as u32).collect();
        for i in (1..pages.len()).rev() {
            let j = ((rng.next() + 1.0) * 0.5 * (i + 1) as f32) as usize;
            pages.swap(i, j.min(i));
        }
        let mut page_start = Vec::new();
        let mut at = 0;
        for s in seqs {
            page_start.push(at);
            at += s.1.div_ceil(ps);
        }
        Self {
            kv,
            heads,
            kv_heads,
            hd,
            ps,
            window,
            scale: 1.0 / (hd as f32).sqrt(),
            seqs: seqs.to_vec(),
            q,
            k,
            v,
            pages,
            page_start,
        }
    }

    fn rows(&self) -> usize {
        self.seqs.iter().map(|s| s.0).sum()
    }

    fn slot(&self, s: usize, pos: usize) -> usize {
        self.pages[self.page_start[s] + pos / self.ps] as usize * self.ps + pos % self.ps
    }

    fn seq_info(&self) -> Vec<i32> {
        let mut row = 0;
        let mut out = Vec::new();
        for (s, &(q_len, kv_len)) in self.seqs.iter().enumerate() {
            out.extend([row, q_len, kv_len, self.page_start[s]].map(|x| x as i32));
            row += q_len;
        }
        out
    }

    /// Softmax attention in f64: query position p sees keys j <= p (and
    /// j > p - window with a window).
    fn reference(&self) -> Vec<f64> {
        let (h_all, hd, kvh) = (self.heads, self.hd, self.kv_heads);
        let mut out = vec![0f64; self.rows() * h_all * hd];
        let mut row = 0;
        for (s, &(q_len, kv_len)) in self.seqs.iter().enumerate() {
            for i in 0..q_len {
                let p = kv_len - q_len + i;
                let lo = if self.window > 0 {
                    (p + 1).saturating_sub(self.window)
                } else {
                    0
                };
                for h in 0..h_all {
                    let g = h / (h_all / kvh);
                    let qv = &self.q[((row + i) * h_all + h) * hd..][..hd];
                    let scores: Vec<f64> = (lo..=p)
                        .map(|j| {
                            let kr = &self.k[(self.slot(s, j) * kvh + g) * hd..][..hd];
                            let dot: f64 =
                                qv.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum();
                            dot * self.scale as f64
                        })
                        .collect();
                    let mx = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let w: Vec<f64> = scores.iter().map(|x| (x - mx).exp()).collect();
                    let sum: f64 = w.iter().sum();
                    let o = &mut out[((row + i) * h_all + h) * hd..][..hd];
                    for (wj, j) in w.iter().zip(lo..=p) {
                        let vr = &self.v[(self.slot(s, j) * kvh + g) * hd..][..hd];
                        for (od, vd) in o.iter_mut().zip(vr) {
                            *od += wj / sum * *vd as f64;
                        }
                    }
                }
            }
            row += q_len;
        }
        out
    }

    /// The record of one launch of `kernel` (see MAIN).
    fn record(&self, kernel: K, launch: [usize; 4], seed: u64, out: &mut Vec<u8>) {
        let [grid_x, threads, splits, smem] = launch;
        let mut name = [0u8; 32];
        name[..kernel.name().len()].copy_from_slice(kernel.name().as_bytes());
        out.extend_from_slice(&name);
        let kv_bytes = if self.kv == DType::BF16 { 2 } else { 4 };
        let slots = self.k.len() / (self.kv_heads * self.hd);
        let ints = [
            self.seqs.len(),
            self.rows(),
            self.heads,
            self.kv_heads,
            self.hd,
            self.ps,
            self.window,
            grid_x,
            threads,
            splits,
            kv_bytes,
            slots,
        ];
        for x in ints {
            out.extend_from_slice(&(x as i32).to_le_bytes());
        }
        out.extend_from_slice(&(smem as u64).to_le_bytes());
        out.extend_from_slice(&self.scale.to_le_bytes());
        out.extend_from_slice(&seed.to_le_bytes());
        out.extend_from_slice(&(self.pages.len() as i32).to_le_bytes());
        for x in &self.q {
            out.extend_from_slice(&x.to_le_bytes());
        }
        for cache in [&self.k, &self.v] {
            for x in cache {
                if kv_bytes == 2 {
                    out.extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes());
                } else {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
        for x in self.seq_info() {
            out.extend_from_slice(&x.to_le_bytes());
        }
        for x in &self.pages {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
}

/// Runs the records through the emulator: each record's outputs.
fn run(bin: &std::path::Path, records: &[u8], sizes: &[usize]) -> Result<Vec<Vec<f32>>> {
    let all = host::floats(&host::run_records(bin, records)?);
    ensure!(
        all.len() == sizes.iter().sum::<usize>(),
        "output of {} floats",
        all.len()
    );
    let mut rest = all.as_slice();
    Ok(sizes
        .iter()
        .map(|&n| {
            let (head, tail) = rest.split_at(n);
            rest = tail;
            head.to_vec()
        })
        .collect())
}

/// Checks one kernel on `batch` under two thread orders.
fn check(
    bin: &std::path::Path,
    batch: &Batch,
    kernel: K,
    launch: [usize; 4],
    tol: f64,
) -> Result<()> {
    let mut records = Vec::new();
    batch.record(kernel, launch, 0, &mut records);
    batch.record(kernel, launch, 9, &mut records);
    let n = batch.rows() * batch.heads * batch.hd;
    let outs = run(bin, &records, &[n, n])?;
    let want = batch.reference();
    let scale = want.iter().fold(0f64, |a, x| a.max(x.abs()));
    let err = outs[0]
        .iter()
        .zip(&want)
        .fold(0f64, |a, (g, w)| a.max((*g as f64 - w).abs()));
    let what = format!(
        "{} window {} seqs {:?}",
        kernel.name(),
        batch.window,
        batch.seqs
    );
    println!("{what}: max error {:.2e} of {scale:.3}", err);
    ensure!(err <= tol * scale, "{what}: error {err} > {tol} x {scale}");
    ensure!(
        host::same_bits(&outs[0], &outs[1]),
        "{what}: another thread order changed the output"
    );
    Ok(())
}

/// The emulator, the attention kernels and [`MAIN`] as one executable, or
/// `None` without a C++ compiler.
fn build() -> Result<Option<host::Emulated>> {
    let kernels = [
        include_str!("../kernels/common.cuh"),
        include_str!("../kernels/fp8.cuh"),
        include_str!("../kernels/mma.cuh"),
        include_str!("../kernels/attention.cu"),
    ];
    host::build_on_emulator("attention_host", &kernels, MAIN)
}

#[test]
fn prefill_kernels_on_the_host_emulator_match_f64_attention() -> Result<()> {
    let Some(emulated) = build()? else {
        return Ok(());
    };
    let bin = &emulated.bin;
    // A prefill over a cached prefix of 25, a fresh one past one 64-row
    // tile, and a short one.
    let seqs = [(20, 45), (70, 70), (5, 9)];
    for window in [0, 24] {
        // The tiles of 64, 32 and 16 rows (H100, A100-class and AMD LDS
        // limits), and 16 rows for latent attention's 576-wide heads in
        // NVIDIA's opt-in shared memory (AMD's 64 KiB is a named error).
        for (kv, hd, max_shared) in [
            (DType::F32, 128, 227 * 1024),
            (DType::BF16, 128, 227 * 1024),
            (DType::F32, 128, 99 * 1024),
            (DType::BF16, 128, 48 * 1024),
            (DType::F32, 576, 227 * 1024),
            (DType::BF16, 576, 227 * 1024),
        ] {
            let batch = Batch::new(kv, hd, window, &seqs, 3 + (hd + window) as u64);
            let (bq, kernel, smem) = prefill_kernel(kv, hd, false, max_shared)?;
            check(
                bin,
                &batch,
                kernel,
                [70usize.div_ceil(bq), 256, 0, smem],
                1e-5,
            )?;
        }
        let lds = prefill_kernel(DType::BF16, 576, false, 64 * 1024);
        assert!(
            lds.as_ref()
                .is_err_and(|e| e.to_string().contains("head_dim 576")),
            "{:?}",
            lds.map(|(bq, ..)| bq)
        );
        for hd in [64, 128] {
            let batch = Batch::new(DType::BF16, hd, window, &seqs, 5 + (hd + window) as u64);
            let Some((kernel, smem)) =
                prefill_mma_kernel(DType::BF16, hd, false, "sm_90", 99 * 1024)
            else {
                bail!("no tensor-core prefill for head_dim {hd}");
            };
            check(
                bin,
                &batch,
                kernel,
                [70usize.div_ceil(64), 128, 0, smem],
                3e-5,
            )?;
        }
    }
    Ok(())
}

#[test]
fn decode_kernels_on_the_host_emulator_match_f64_attention() -> Result<()> {
    let Some(emulated) = build()? else {
        return Ok(());
    };
    let bin = &emulated.bin;
    let seqs = [(1, 37), (1, 1), (1, 80)];
    for window in [0, 30] {
        for kv in [DType::F32, DType::BF16] {
            for splits in [1, 3] {
                let batch = Batch::new(kv, 128, window, &seqs, 11 + splits as u64);
                let kernel = decode_kernel(kv, 128);
                check(bin, &batch, kernel, [0, 128, splits, 0], 1e-5)?;
            }
            // Latent attention's 576-wide heads (element-wise V loads).
            let batch = Batch::new(kv, 576, window, &seqs, 13);
            check(bin, &batch, decode_kernel(kv, 576), [0, 128, 3, 0], 1e-5)?;
        }
    }
    Ok(())
}

/// A decode row is the same bits whatever the grid's split count (at least
/// what the batch needs) and whatever else is in the batch: a sequence of
/// 300 tokens (19 pages of 16 in splits of 4 pages: 5) alone with 5 and 16
/// splits, and beside two short sequences with 16.
#[test]
fn decode_rows_do_not_depend_on_the_grid_or_the_batch() -> Result<()> {
    let Some(emulated) = build()? else {
        return Ok(());
    };
    let bin = &emulated.bin;
    let kernel = decode_kernel(DType::F32, 128);
    let alone = Batch::new(DType::F32, 128, 0, &[(1, 300)], 21);
    let mut batched = Batch::new(DType::F32, 128, 0, &[(1, 37), (1, 300), (1, 5)], 22);
    // The long sequence's query and pages hold the same values as alone.
    let row = alone.heads * alone.hd;
    batched.q[row..2 * row].copy_from_slice(&alone.q);
    for pos in 0..300 {
        let (from, to) = (alone.slot(0, pos), batched.slot(1, pos));
        let w = alone.kv_heads * alone.hd;
        batched.k[to * w..(to + 1) * w].copy_from_slice(&alone.k[from * w..(from + 1) * w]);
        batched.v[to * w..(to + 1) * w].copy_from_slice(&alone.v[from * w..(from + 1) * w]);
    }
    let mut records = Vec::new();
    alone.record(kernel, [0, 128, 5, 0], 0, &mut records);
    alone.record(kernel, [0, 128, 16, 0], 0, &mut records);
    batched.record(kernel, [0, 128, 16, 0], 0, &mut records);
    let outs = run(bin, &records, &[row, row, 3 * row])?;
    ensure!(
        host::same_bits(&outs[0], &outs[1]),
        "5 and 16 splits differ"
    );
    ensure!(
        host::same_bits(&outs[0], &outs[2][row..2 * row]),
        "the row differs in a batch"
    );
    Ok(())
}
