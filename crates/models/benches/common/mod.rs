//! The throughput measurement the forward benches share: a model's runner
//! (f32 KV, 400 pages of 16 tokens), prefill of one 512-token prompt (best of
//! 3), and decode at batch 1 and 8 with 512 tokens of context each (16
//! steps).

use arbor_engine_core::runner::{ModelRunner, SeqStep};
use arbor_engine_core::{Backend, DType, Model};
use std::sync::Arc;
use std::time::Instant;

/// Prefill tok/s of a 512-token prompt and decode tok/s at batch 1 and 8.
pub struct Throughput {
    pub prefill: f64,
    pub decode_bs1: f64,
    pub decode_bs8: f64,
}

/// Measures `model` on `backend` with a 512-token prompt of ids below `vocab`.
pub fn measure(model: impl Model + 'static, backend: Arc<dyn Backend>, vocab: u32) -> Throughput {
    let runner =
        ModelRunner::new(Arc::new(model), backend, None, 16, 400, DType::F32).expect("runner");
    let pages: Vec<u32> = (0..400).collect();
    let prompt: Vec<u32> = (0..512u32).map(|i| (i * 7919) % vocab).collect();
    let mut prefill = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        runner
            .step(&[SeqStep {
                tokens: &prompt,
                prefix_len: 0,
                pages: &pages[..32],
                want_logits: true,
                state_slot: None,
            }])
            .expect("prefill");
        prefill = prefill.min(t.elapsed().as_secs_f64());
    }
    // Decode at batch b: each sequence has 512 tokens of context.
    let decode = |b: usize| -> f64 {
        for s in 0..b {
            runner
                .step(&[SeqStep {
                    tokens: &prompt,
                    prefix_len: 0,
                    pages: &pages[s * 40..s * 40 + 32],
                    want_logits: false,
                    state_slot: None,
                }])
                .expect("fill");
        }
        let steps = 16;
        let toks = [[5u32]; 8];
        let t = Instant::now();
        for i in 0..steps {
            let seqs: Vec<SeqStep<'_>> = (0..b)
                .map(|s| SeqStep {
                    tokens: &toks[s],
                    prefix_len: 512 + i,
                    pages: &pages[s * 40..s * 40 + 40],
                    want_logits: true,
                    state_slot: None,
                })
                .collect();
            runner.step(&seqs).expect("decode");
        }
        (steps * b) as f64 / t.elapsed().as_secs_f64()
    };
    Throughput {
        prefill: 512.0 / prefill,
        decode_bs1: decode(1),
        decode_bs8: decode(8),
    }
}
