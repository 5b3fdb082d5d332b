//! Times the linear kernels at the default model's shapes (decode and
//! prefill) on the wgpu backend: `cargo run -p arbor-backend-wgpu --example kernels`.

use anyhow::Result;
use arbor_backend_wgpu::WgpuBackend;
use arbor_engine_core::{Backend, BackendOptions, DType, HostTensor};
use std::time::Instant;

/// CPU seconds this process has used (user + system), from /proc/self/stat.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of stat (utime, stime) are at 11 and 12 after the command name.
    let tick = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

fn main() -> Result<()> {
    let b = WgpuBackend::new(&BackendOptions::default())?;
    println!("device: {}", b.info().name);
    let iters = 10;
    for (dt, m, n, k) in [
        (DType::Q4_1, 1, 576, 576),
        (DType::Q4_1, 1, 1536, 576),
        (DType::Q4_1, 1, 576, 1536),
        (DType::Q8_0, 1, 49152, 576),
        (DType::Q4_1, 8, 1536, 576),
        (DType::Q4_1, 128, 1536, 576),
        (DType::F32, 1, 1536, 576),
        (DType::F32, 128, 1536, 576),
    ] {
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 97.0)
            .collect();
        let mut data = vec![0u8; dt.bytes_for(n * k)?];
        if dt.is_quantized() {
            arbor_quant::quantize(dt, &w, &mut data)?;
        } else {
            data = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        }
        let wt = b.upload(&HostTensor {
            dtype: dt,
            shape: vec![n, k],
            data: data.into(),
        })?;
        let xt = b.upload(&HostTensor::from_f32(&[m, k], &x))?;
        let o = b.alloc(DType::F32, &[m, n])?;
        b.linear(&xt, &wt, None, &o)?;
        b.synchronize()?;
        let t = Instant::now();
        let c0 = cpu_seconds();
        for _ in 0..iters {
            b.linear(&xt, &wt, None, &o)?;
        }
        b.synchronize()?;
        let dt_s = t.elapsed().as_secs_f64() / iters as f64;
        let cpu_ms = (cpu_seconds() - c0) * 1e3 / iters as f64;
        println!(
            "{dt} m={m} n={n} k={k}: {:.2} ms ({cpu_ms:.2} ms of CPU), {:.2} GFLOP/s, {:.2} GB/s of weights",
            dt_s * 1e3,
            2.0 * (m * n * k) as f64 / dt_s / 1e9,
            wt.byte_len()? as f64 / dt_s / 1e9
        );
    }
    // Decode attention at the default model's shape over 160 cached tokens.
    {
        use arbor_engine_core::{AttentionParams, BatchLayout, KvCache, KvSpec};
        use std::sync::Arc;
        let spec = KvSpec {
            num_layers: 1,
            num_kv_heads: 3,
            head_dim: 64,
            page_size: 16,
            num_pages: 96,
            dtype: DType::F16,
            values_in_keys: false,
        };
        let kv = KvCache::allocate(&b, spec)?;
        let attn = b.create_attention("wgpu-paged")?;
        for batch in [1usize, 8] {
            let mut layout = BatchLayout::new(16);
            for s in 0..batch {
                let pages: Vec<u32> = (s as u32 * 11..s as u32 * 11 + 11).collect();
                layout.push_seq(160, 1, &pages)?;
            }
            let ab = attn.prepare(Arc::new(layout))?;
            let q = b.alloc(DType::F32, &[batch, 9 * 64])?;
            let k = b.alloc(DType::F32, &[batch, 3 * 64])?;
            let v = b.alloc(DType::F32, &[batch, 3 * 64])?;
            let o = b.alloc(DType::F32, &[batch, 9 * 64])?;
            let p = AttentionParams {
                num_heads: 9,
                num_kv_heads: 3,
                head_dim: 64,
                scale: 0.125,
                sliding_window: None,
                kv_scales: arbor_engine_core::KvScales::ONE,
            };
            attn.forward(&ab, kv.layer(0)?, &q, &k, &v, &o, &p)?;
            b.synchronize()?;
            let t = Instant::now();
            for _ in 0..iters {
                attn.forward(&ab, kv.layer(0)?, &q, &k, &v, &o, &p)?;
            }
            b.synchronize()?;
            println!(
                "attention decode batch {batch}, 161 keys: {:.2} ms",
                t.elapsed().as_secs_f64() * 1e3 / iters as f64
            );
        }
    }
    // Per-dispatch cost: many tiny adds.
    let a = b.alloc(DType::F32, &[576])?;
    let c = b.alloc(DType::F32, &[576])?;
    b.synchronize()?;
    let t = Instant::now();
    for _ in 0..1000 {
        b.add_assign(&a, &c)?;
    }
    let rec = t.elapsed();
    b.synchronize()?;
    println!(
        "1000 tiny dispatches: {:.2?} to record, {:.2?} in all",
        rec,
        t.elapsed()
    );
    Ok(())
}
