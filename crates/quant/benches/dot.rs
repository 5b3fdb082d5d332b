//! GEMV throughput of `dot_rows` in GB/s of weight bytes, single thread, at
//! m = 1 and m = 8, on SmolLM2-135M shapes: 576 rows x k=1536 (ffn_down) and
//! 49152 rows x k=576 (the tied embedding / LM head; k=512 for the K formats,
//! whose rows must be multiples of 256); `u4_s32-g128` is `u4_s32` with the
//! scale and zero point of an AWQ/GPTQ group of 128 inputs (4 blocks).
//!
//! The `gemm` group compares the tiled GEMM with the row kernels at m = 1..512
//! on the default model's shapes, in multiply-accumulates per second; the
//! `scaled_matmul` group compares the scaled block formats' two
//! `QuantMatmul` paths (f32 FMA, AMX bf16) at m = 1..512 (AMX CPUs only).
//!
//! Time is the benchmark thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), not
//! wall-clock time, so figures stay comparable on a busy shared machine.
//!
//! Run: `cargo bench -p arbor-quant --bench dot` (add `-- q4_1` to filter;
//! `ARBOR_QUANT_SIMD=avx2|scalar` lowers the SIMD level).
#![allow(clippy::unwrap_used)]
#![allow(unsafe_code)]

use arbor_quant::{
    DType, PreparedActs, QuantMatmul, SimdLevel, detected_level, dot_rows, dot_rows_gemv_with,
    gemm_with, prepare_acts, row_bytes,
};
use criterion::measurement::{Measurement, ValueFormatter};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::time::Duration;

/// Criterion measurement: CPU time of the calling thread, in ns.
struct ThreadCpu;

#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}

unsafe extern "C" {
    fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
}

fn thread_cpu_ns() -> f64 {
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: clock_gettime writes one timespec (two longs on x86-64 Linux).
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime");
    t.sec as f64 * 1e9 + t.nsec as f64
}

impl Measurement for ThreadCpu {
    type Intermediate = f64;
    type Value = f64;
    fn start(&self) -> f64 {
        thread_cpu_ns()
    }
    fn end(&self, i: f64) -> f64 {
        thread_cpu_ns() - i
    }
    fn add(&self, a: &f64, b: &f64) -> f64 {
        a + b
    }
    fn zero(&self) -> f64 {
        0.0
    }
    fn to_f64(&self, v: &f64) -> f64 {
        *v
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        &CpuFormatter
    }
}

struct CpuFormatter;

impl ValueFormatter for CpuFormatter {
    fn scale_values(&self, typical: f64, values: &mut [f64]) -> &'static str {
        let (div, unit) = if typical < 1e3 {
            (1.0, "ns cpu")
        } else if typical < 1e6 {
            (1e3, "µs cpu")
        } else if typical < 1e9 {
            (1e6, "ms cpu")
        } else {
            (1e9, "s cpu")
        };
        values.iter_mut().for_each(|v| *v /= div);
        unit
    }
    fn scale_throughputs(&self, _typical: f64, t: &Throughput, values: &mut [f64]) -> &'static str {
        let (n, unit) = match t {
            Throughput::Bytes(b) | Throughput::BytesDecimal(b) => (*b as f64, "GB/s cpu"),
            Throughput::Elements(e) => (*e as f64, "Gelem/s cpu"),
            Throughput::Bits(b) => (*b as f64, "Gbit/s cpu"),
            _ => (1.0, "G/s cpu"),
        };
        values.iter_mut().for_each(|v| *v = n / *v);
        unit
    }
    fn scale_for_machines(&self, _values: &mut [f64]) -> &'static str {
        "ns"
    }
}

fn config() -> Criterion<ThreadCpu> {
    Criterion::default().with_measurement(ThreadCpu)
}

const FORMATS: [DType; 17] = [
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
    DType::F8_S32,
    DType::U4_S32,
    DType::U8_S32,
    DType::F4_S16,
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
    if dtype.is_float()
        || matches!(
            dtype,
            DType::F8_S32 | DType::U4_S32 | DType::U8_S32 | DType::F4_S16
        )
    {
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

/// `w` with each run of 4 `u4_s32` blocks given its first block's scale and
/// zero point: AWQ and GPTQ checkpoints with groups of 128 inputs.
fn grouped_u4(mut w: Vec<u8>) -> Vec<u8> {
    for run in w.chunks_mut(4 * 20) {
        let (first, rest) = run.split_at_mut(20);
        for block in rest.chunks_exact_mut(20) {
            block[16..19].copy_from_slice(&first[16..19]);
        }
    }
    w
}

fn bench(c: &mut Criterion<ThreadCpu>) {
    let mut g = c.benchmark_group("dot_rows");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let cases = FORMATS
        .iter()
        .map(|&d| (d, d.to_string()))
        .chain([(DType::U4_S32, "u4_s32-g128".to_string())]);
    for (dtype, name) in cases {
        let big_k = if dtype.block_size() == 256 { 512 } else { 576 };
        for (n_rows, k) in [(576usize, 1536usize), (49152, big_k)] {
            let mut w = weights(dtype, n_rows, k);
            if name.ends_with("-g128") {
                w = grouped_u4(w);
            }
            for m in [1usize, 8] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let acts = prepare_acts(dtype, &x, m, k).unwrap();
                let mut out = vec![0.0f32; m * n_rows];
                g.throughput(Throughput::Bytes(w.len() as u64));
                g.bench_function(format!("{name}/{n_rows}x{k}/m{m}"), |b| {
                    b.iter(|| dot_rows(dtype, &w, n_rows, k, &acts, &mut out, n_rows).unwrap())
                });
            }
        }
    }
    g.finish();
}

/// The tiled GEMM against the row kernels on the default model's shapes
/// (single thread), in GMAC/s: `m` activation rows times the weight matrix.
fn bench_gemm(c: &mut Criterion<ThreadCpu>) {
    let mut g = c.benchmark_group("gemm");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    let level = detected_level();
    if level == SimdLevel::Scalar {
        return;
    }
    // (name, n_rows, k): ffn_down, ffn_up/gate, the LM head.
    let shapes = [
        ("down", 576usize, 1536usize),
        ("up", 1536, 576),
        ("head", 49152, 576),
    ];
    for dtype in [DType::Q4_1, DType::Q8_0, DType::Q4_0] {
        for (name, n_rows, k) in shapes {
            if name == "head" && dtype != DType::Q8_0 {
                continue;
            }
            let w = weights(dtype, n_rows, k);
            for m in [1usize, 2, 4, 8, 16, 31, 32, 64, 512] {
                if name == "head" && m > 16 {
                    continue;
                }
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let acts = prepare_acts(dtype, &x, m, k).unwrap();
                let mut out = vec![0.0f32; m * n_rows];
                g.throughput(Throughput::Elements((m * n_rows * k) as u64));
                g.bench_function(format!("{dtype}/{name}/m{m}/tiled"), |b| {
                    b.iter(|| {
                        gemm_with(level, dtype, &w, n_rows, k, &acts, &mut out, n_rows).unwrap()
                    })
                });
                if m <= 16 {
                    g.bench_function(format!("{dtype}/{name}/m{m}/rows"), |b| {
                        b.iter(|| {
                            dot_rows_gemv_with(level, dtype, &w, n_rows, k, &acts, &mut out, n_rows)
                                .unwrap()
                        })
                    });
                }
            }
        }
    }
    g.finish();
}

/// The scaled block formats under each `QuantMatmul` (single thread), in
/// GMAC/s: `f32` (FMA with f32 activations) against `amx-bf16` (bf16
/// panels through AMX tiles), from one decode row to a prefill chunk.
fn bench_scaled_matmul(c: &mut Criterion<ThreadCpu>) {
    if detected_level() < SimdLevel::Amx {
        println!("scaled_matmul: skipped, this CPU has no AMX-BF16 (amx-bf16 would be f32)");
        return;
    }
    let mut g = c.benchmark_group("scaled_matmul");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    let formats = [
        (DType::F8_S32, "f8_s32"),
        (DType::U4_S32, "u4_s32-g128"),
        (DType::F4_S16, "f4_s16"),
    ];
    for (dtype, name) in formats {
        for (shape, n_rows, k) in [("down", 576usize, 1536usize), ("up", 1536, 576)] {
            let mut w = weights(dtype, n_rows, k);
            if name.ends_with("-g128") {
                w = grouped_u4(w);
            }
            for m in [1usize, 4, 8, 32, 128, 512] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let mut out = vec![0.0f32; m * n_rows];
                g.throughput(Throughput::Elements((m * n_rows * k) as u64));
                for matmul in QuantMatmul::ALL {
                    let mut acts = PreparedActs::new();
                    drop(
                        acts.prepare_split_as(dtype, matmul, None, &x, m, k)
                            .unwrap(),
                    );
                    let id = format!("{name}/{shape}/m{m}/{}", matmul.name());
                    g.bench_function(id, |b| {
                        b.iter(|| dot_rows(dtype, &w, n_rows, k, &acts, &mut out, n_rows).unwrap())
                    });
                }
            }
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench, bench_gemm, bench_scaled_matmul
}
criterion_main!(benches);
