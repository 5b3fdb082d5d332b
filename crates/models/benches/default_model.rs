//! Prefill and batch-1 decode speed on the default model (SmolLM2-135M-Instruct
//! Q4_1 GGUF), printed as one JSON line; tools/llamacpp/bench_compare.py runs
//! it alternately with llama.cpp on the same file and prints the ratios.
//!
//! Besides wall-clock tok/s it reports CPU time per token (all threads of the
//! process, from `/proc/self/task/*/schedstat`; with one thread that is the
//! calling thread's own time, the figure to compare on a busy machine) and
//! batch-8 decode (8 sequences of 64 prompt tokens, 32 steps).
//! ARBOR_BENCH_ONLY=prefill,decode,bs8 picks sections (for profiling);
//! `bs16` (only when named) is the decode of serving 16 requests of 256+
//! tokens: 16 sequences of 320 prompt tokens, then 32 steps, with the
//! attention reading about 16 x 340 tokens of f16 KV per layer.
//! ARBOR_BENCH_REPS the runs per figure (best of, default 3).
//!
//! Run: `cargo bench -p arbor-models --bench default_model`
//! (ARBOR_BENCH_THREADS, default 2; ARBOR_DEFAULT_GGUF overrides the file).

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::runner::{ModelRunner, SeqStep};
use arbor_engine_core::{Backend, DType, LoadOptions, Registry};
use std::sync::Arc;
use std::time::Instant;

fn main() {
    let Some(path) = arbor_gguf::default_model_path().filter(|p| p.exists()) else {
        println!("skipping: the default model is absent (run `arbor fetch-default`)");
        return;
    };
    let threads: usize = std::env::var("ARBOR_BENCH_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let registry = Registry::builtin().expect("registry");
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(threads).expect("cpu"));
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("auto").expect("auto")(&Default::default())
            .expect("quant"),
        progress: None,
    };
    let m = arbor_models::load_model(&path, &registry, &opts).expect("model");
    let bytes = m.model.spec().weight_bytes;
    let runner = ModelRunner::new(m.model.clone(), backend.clone(), None, 16, 64, DType::F16)
        .expect("runner");
    let pages: Vec<u32> = (0..64).collect();
    let prompt: Vec<u32> = (0..512u32).map(|i| 200 + (i * 7919) % 40000).collect();
    let only = std::env::var("ARBOR_BENCH_ONLY").unwrap_or_default();
    let reps: usize = std::env::var("ARBOR_BENCH_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let wanted = |name: &str| only.is_empty() || only.split(',').any(|o| o == name);
    // Best (wall, cpu) seconds of `reps` runs of `timed` (after `setup`).
    let best = |setup: &dyn Fn(), timed: &dyn Fn()| {
        let (mut wall, mut cpu) = (f64::MAX, f64::MAX);
        for _ in 0..reps {
            setup();
            let c = cpu_seconds();
            let t = Instant::now();
            timed();
            wall = wall.min(t.elapsed().as_secs_f64());
            cpu = cpu.min(cpu_seconds() - c);
        }
        (wall, cpu)
    };
    let mut fields = vec![format!("\"threads\": {threads}")];
    let mut report = |name: &str, tokens: f64, (wall, cpu): (f64, f64)| {
        fields.push(format!("\"{name}_tok_s\": {:.1}", tokens / wall));
        fields.push(format!(
            "\"{}_cpu_ms_per_tok\": {:.3}",
            name.trim_end_matches("_decode"),
            1e3 * cpu / tokens
        ));
    };
    if wanted("prefill") {
        let r = best(&|| {}, &|| {
            runner
                .step(&[SeqStep {
                    tokens: &prompt,
                    prefix_len: 0,
                    pages: &pages[..32],
                    want_logits: true,
                    state_slot: None,
                }])
                .expect("prefill");
        });
        report("prefill", 512.0, r);
    }
    if wanted("decode") {
        // Decode 128 tokens after a 16-token prompt.
        let steps = 128;
        let prompt16 = || {
            runner
                .step(&[SeqStep {
                    tokens: &prompt[..16],
                    prefix_len: 0,
                    pages: &pages[..16],
                    want_logits: true,
                    state_slot: None,
                }])
                .expect("prompt");
        };
        let r = best(&prompt16, &|| {
            for i in 0..steps {
                runner
                    .step(&[SeqStep {
                        tokens: &prompt[16 + i..17 + i],
                        prefix_len: 16 + i,
                        pages: &pages[..16],
                        want_logits: true,
                        state_slot: None,
                    }])
                    .expect("decode");
            }
        });
        report("decode", steps as f64, r);
    }
    if wanted("bs8") {
        // 8 sequences of 64 prompt tokens (8 pages each), then 32 steps.
        let b = Batch {
            runner: &runner,
            tokens: &prompt,
            pages: &pages,
            bsz: 8,
            plen: 64,
            steps: 32,
            per: 8,
        };
        let r = best(&|| b.prefill(|s| s * 31), &|| b.decode(|s, i| s * 17 + i));
        report("bs8_decode", (b.bsz * b.steps) as f64, r);
    }
    if only.split(',').any(|o| o == "bs16") {
        // 16 sequences of 320 prompt tokens (24 pages each), then 32 steps.
        let (bsz, plen, steps, per) = (16usize, 320usize, 32usize, 24usize);
        let long = ModelRunner::new(m.model.clone(), backend, None, 16, bsz * per, DType::F16)
            .expect("runner");
        let pages: Vec<u32> = (0..(bsz * per) as u32).collect();
        let tokens: Vec<u32> = (0..(plen + steps + 16 * bsz) as u32)
            .map(|i| 200 + (i * 7919) % 40000)
            .collect();
        let b = Batch {
            runner: &long,
            tokens: &tokens,
            pages: &pages,
            bsz,
            plen,
            steps,
            per,
        };
        let r = best(&|| b.prefill(|s| s * 16), &|| {
            b.decode(|s, i| s * 16 + plen + i)
        });
        report("bs16_decode", (bsz * steps) as f64, r);
    }
    println!(
        "{{\"engine\": \"arbor\", {}, \"weight_bytes\": {bytes}}}",
        fields.join(", ")
    );
}

/// A batched decode: `bsz` sequences, sequence `s` in pages
/// `s*per..(s+1)*per`, prefilled with `plen` tokens and then decoding
/// `steps` tokens, one per step.
struct Batch<'a> {
    runner: &'a ModelRunner,
    tokens: &'a [u32],
    pages: &'a [u32],
    bsz: usize,
    plen: usize,
    steps: usize,
    per: usize,
}

impl Batch<'_> {
    fn seq_pages(&self, s: usize) -> &[u32] {
        &self.pages[s * self.per..(s + 1) * self.per]
    }

    /// One step of every prompt (sequence `s`'s starts at `tokens[prompt_at(s)]`).
    fn prefill(&self, prompt_at: impl Fn(usize) -> usize) {
        let seqs: Vec<SeqStep<'_>> = (0..self.bsz)
            .map(|s| SeqStep {
                tokens: &self.tokens[prompt_at(s)..prompt_at(s) + self.plen],
                prefix_len: 0,
                pages: self.seq_pages(s),
                want_logits: true,
                state_slot: None,
            })
            .collect();
        self.runner.step(&seqs).expect("batch prompts");
    }

    /// `steps` decode steps (sequence `s` takes `tokens[step_at(s, i)]` at step `i`).
    fn decode(&self, step_at: impl Fn(usize, usize) -> usize) {
        for i in 0..self.steps {
            let seqs: Vec<SeqStep<'_>> = (0..self.bsz)
                .map(|s| SeqStep {
                    tokens: &self.tokens[step_at(s, i)..step_at(s, i) + 1],
                    prefix_len: self.plen + i,
                    pages: self.seq_pages(s),
                    want_logits: true,
                    state_slot: None,
                })
                .collect();
            self.runner.step(&seqs).expect("batch decode");
        }
    }
}

/// CPU time of every thread of this process so far, in seconds (the first
/// field of each `/proc/self/task/*/schedstat`, in ns); NaN where unavailable.
fn cpu_seconds() -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return f64::NAN;
    };
    let mut ns = 0u64;
    for e in dir.flatten() {
        let Ok(s) = std::fs::read_to_string(e.path().join("schedstat")) else {
            continue;
        };
        ns += s
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    ns as f64 * 1e-9
}
