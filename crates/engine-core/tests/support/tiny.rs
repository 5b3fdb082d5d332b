//! Shared pieces of the engine tests on the tiny Llama fixture (included
//! with `#[path]`): the model loaded once per test binary on a 2-thread CPU
//! backend, seeded prompts, greedy parameters, the check that a flushed,
//! idle engine holds no KV page, and a processor that slows marked requests.
#![allow(dead_code)]

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::engine::Engine;
use arbor_engine_core::sampling::{LogitsContext, LogitsProcessor};
use arbor_engine_core::{Backend, LoadOptions, Registry, SamplingParams, SeqRng};
use arbor_models::{LoadedModel, load_model};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

pub fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama")
}

pub struct Shared {
    pub model: LoadedModel,
    pub backend: Arc<dyn Backend>,
    pub registry: Registry,
}

pub fn shared() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| {
        let registry = Registry::builtin().expect("registry");
        let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2).expect("cpu"));
        let opts = LoadOptions {
            backend: backend.clone(),
            quant: registry.quant_methods.get("f32").expect("f32")(&Default::default())
                .expect("quant"),
            progress: None,
        };
        let model = load_model(&fixture(), &registry, &opts).expect("tiny-llama loads");
        Shared {
            model,
            backend,
            registry,
        }
    })
}

/// Asserts that once idle and flushed, no KV page is in use.
pub fn assert_pool_empty(e: &Engine) {
    assert!(e.flush_cache().expect("flush"), "engine should be idle");
    // Stats are published after the flush message is handled; wait for it.
    for _ in 0..100 {
        let s = e.stats();
        if s.num_used_tokens == 0 && s.evictable_tokens == 0 && s.used_state_slots == 0 {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("KV pages or state slots still in use: {:?}", e.stats());
}

/// `n` prompts of 3..63 ids below 497, from `seed`.
pub fn prompts(n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = SeqRng::new(seed);
    (0..n)
        .map(|_| {
            let len = 3 + (rng.next_u64() % 60) as usize;
            (0..len).map(|_| (rng.next_u64() % 497) as u32).collect()
        })
        .collect()
}

pub fn greedy(max_new: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_new)
    }
}

/// An identity logits processor that sleeps 3 ms per row of the requests
/// asking for one of its token counts (and no other), so that a test
/// which must act on a request still decoding (abort it, update the
/// weights under it) finds it decoding however late a loaded machine runs
/// the test thread. (A stream merges the chunks its reader has not taken,
/// so a request that ran to its end first shows one finished chunk.)
pub struct SlowSteps(pub &'static [usize]);

impl LogitsProcessor for SlowSteps {
    fn name(&self) -> &str {
        "slow-steps"
    }
    fn process(&self, _: &mut [f32], _: &LogitsContext<'_>) -> arbor_engine_core::Result<()> {
        std::thread::sleep(std::time::Duration::from_millis(3));
        Ok(())
    }
    fn is_active(&self, params: &SamplingParams) -> bool {
        self.0.contains(&params.max_new_tokens)
    }
}
