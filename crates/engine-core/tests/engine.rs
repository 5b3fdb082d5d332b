//! The engine end to end on the tiny Llama fixture (a real model, checked
//! against transformers in the models crate): continuous batching, chunked
//! prefill, prefix reuse, retraction, aborts, n > 1, stop conditions and
//! policies. Every test ends with the KV pool entirely free after a flush.

#![allow(clippy::unwrap_used)]

use anyhow::Result;
use arbor_engine_core::engine::{
    Engine, EngineConfig, EngineParts, FinishKind, GenerateRequest, LoadBalance, Matched,
    OutputChunk, SchedulePolicy,
};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{DType, PrefixCacheOptions, SamplingParams};
use arbor_kv_radix as _;

#[path = "support/tiny.rs"]
mod tiny;
use std::sync::Arc;
use tiny::{SlowSteps, assert_pool_empty, greedy, prompts, shared};

fn engine(cfg: EngineConfig, num_pages: usize, page_size: usize) -> Result<Engine> {
    engine_with_eos(
        cfg,
        num_pages,
        page_size,
        shared().model.tokenizer.eos_token_ids.clone(),
    )
}

thread_local! {
    /// Overlap scheduling for the engines this test thread builds (`None`:
    /// the backend's default, off on the CPU).
    static OVERLAP: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Runs a test body with overlap scheduling forced on.
fn with_overlap(body: fn() -> Result<()>) -> Result<()> {
    OVERLAP.with(|o| o.set(Some(true)));
    let r = body();
    OVERLAP.with(|o| o.set(None));
    r
}

fn engine_with_eos(
    cfg: EngineConfig,
    num_pages: usize,
    page_size: usize,
    eos_token_ids: Vec<u32>,
) -> Result<Engine> {
    let cfg = EngineConfig {
        overlap_schedule: cfg.overlap_schedule.or(OVERLAP.with(|o| o.get())),
        ..cfg
    };
    let parts = parts(&cfg, num_pages, page_size, eos_token_ids)?;
    Ok(Engine::new(cfg, parts)?)
}

/// One scheduler's parts: its own KV cache of `num_pages` and prefix cache
/// over the shared tiny model.
fn parts(
    cfg: &EngineConfig,
    num_pages: usize,
    page_size: usize,
    eos_token_ids: Vec<u32>,
) -> Result<EngineParts> {
    let s = shared();
    let runner = ModelRunner::new(
        s.model.model.clone(),
        s.backend.clone(),
        None,
        page_size,
        num_pages,
        DType::F32,
    )?;
    let cache_name = if cfg.disable_radix_cache {
        "none"
    } else {
        "radix"
    };
    let policy = s.registry.eviction_policies.get("lru")?()?;
    let cache =
        s.registry.prefix_caches.get(cache_name)?(&PrefixCacheOptions { page_size, policy })?;
    let parts = EngineParts::local(
        runner,
        cache,
        s.registry.samplers.get("standard")?()?,
        vec![
            s.registry.logits_processors.get("penalties")?(&serde_json::Value::Null)?,
            Arc::new(SlowSteps(&[ABORTED_TOKENS, ABORTED_DP_TOKENS])),
        ],
        s.model.tokenizer.clone(),
        eos_token_ids,
    );
    Ok(parts)
}

/// Tokens of the requests the tests abort while they decode (slowed by
/// [`SlowSteps`], so that they still decode when the abort arrives).
const ABORTED_TOKENS: usize = 200;
/// The same for the data-parallel engine's.
const ABORTED_DP_TOKENS: usize = 120;

fn tokens_of(chunks: &[OutputChunk]) -> Vec<u32> {
    chunks.iter().flat_map(|c| c.token_ids.clone()).collect()
}

fn run_all(e: &Engine, ps: &[Vec<u32>], params: &SamplingParams) -> Result<Vec<Vec<u32>>> {
    let streams: Vec<_> = ps
        .iter()
        .map(|p| e.submit(GenerateRequest::new(p.clone(), params.clone())))
        .collect::<Result<_, _>>()?;
    Ok(streams
        .into_iter()
        .map(|s| {
            let chunks = s.collect_blocking();
            let f = chunks
                .last()
                .and_then(|c| c.finish.clone())
                .expect("finished");
            assert_ne!(f.kind, FinishKind::Abort, "{f:?}");
            tokens_of(&chunks)
        })
        .collect())
}

fn reference(ps: &[Vec<u32>], max_new: usize) -> Result<Vec<Vec<u32>>> {
    let e = engine(EngineConfig::default(), 256, 16)?;
    let mut out = Vec::new();
    for p in ps {
        out.extend(run_all(&e, std::slice::from_ref(p), &greedy(max_new))?);
    }
    assert_pool_empty(&e);
    Ok(out)
}

#[test]
fn alone_batched_cached_chunked_and_retracted_agree() -> Result<()> {
    let ps = prompts(32, 11);
    let want = reference(&ps, 24)?;

    // (b) all 32 at once: continuous batching.
    let e = engine(EngineConfig::default(), 256, 16)?;
    assert_eq!(run_all(&e, &ps, &greedy(24))?, want, "batched");
    // (c) again with the prefix cache warm: every prompt is a cache hit now.
    assert_eq!(run_all(&e, &ps, &greedy(24))?, want, "cached");
    assert!(e.stats().cached_tokens_total > 0);
    assert_pool_empty(&e);

    // (c) without the prefix cache.
    let cfg = EngineConfig {
        disable_radix_cache: true,
        ..Default::default()
    };
    let e = engine(cfg, 256, 16)?;
    assert_eq!(run_all(&e, &ps, &greedy(24))?, want, "no cache");
    assert_eq!(e.stats().cached_tokens_total, 0);
    assert_pool_empty(&e);

    // (d) chunked prefill with tiny chunks (page size 4), with and without the cache.
    for disable in [false, true] {
        let cfg = EngineConfig {
            chunked_prefill_size: 8,
            max_prefill_tokens: 16,
            disable_radix_cache: disable,
            ..Default::default()
        };
        let e = engine(cfg, 1024, 4)?;
        assert_eq!(
            run_all(&e, &ps, &greedy(24))?,
            want,
            "chunked, no cache: {disable}"
        );
        assert_pool_empty(&e);
    }

    // (e) a small pool and an optimistic budget: decoding must retract requests.
    let cfg = EngineConfig {
        schedule_conservativeness: 0.05,
        ..Default::default()
    };
    let e = engine(cfg, 12, 16)?;
    assert_eq!(
        run_all(&e, &ps[..12], &greedy(24))?,
        want[..12],
        "retracted"
    );
    assert!(e.stats().num_retracted_reqs_total > 0, "{:?}", e.stats());
    assert_pool_empty(&e);
    Ok(())
}

#[test]
fn every_policy_and_mixed_chunks_give_the_same_tokens() -> Result<()> {
    let mut ps = prompts(10, 5);
    // Shared prefixes so lpm and dfs-weight have something to order.
    let base = ps[0].clone();
    for p in ps.iter_mut().skip(5) {
        let mut q = base.clone();
        q.extend_from_slice(&p[..3]);
        *p = q;
    }
    let want = reference(&ps, 12)?;
    for policy in SchedulePolicy::NAMES {
        let cfg = EngineConfig {
            schedule_policy: policy.parse()?,
            max_running_requests: 3,
            enable_mixed_chunk: policy == "lof",
            chunked_prefill_size: 32,
            ..Default::default()
        };
        let e = engine(cfg, 256, 16)?;
        assert_eq!(run_all(&e, &ps, &greedy(12))?, want, "policy {policy}");
        assert_pool_empty(&e);
    }
    Ok(())
}

#[test]
fn abort_frees_pages_and_drop_aborts() -> Result<()> {
    let e = engine(EngineConfig::default(), 64, 16)?;
    let p = prompts(1, 3).remove(0);
    let mut s = e.submit(GenerateRequest {
        rid: Some("victim".into()),
        ..GenerateRequest::new(p.clone(), greedy(ABORTED_TOKENS))
    })?;
    // Wait until it is decoding.
    let first = s.blocking_next().expect("a chunk");
    assert!(first.finish.is_none());
    e.abort("victim");
    let rest: Vec<OutputChunk> = std::iter::from_fn(|| s.blocking_next()).collect();
    let f = rest.last().and_then(|c| c.finish.clone()).expect("finish");
    assert_eq!(f.kind, FinishKind::Abort);
    assert!(tokens_of(&rest).len() < ABORTED_TOKENS - 1);
    assert_pool_empty(&e);

    // Dropping the stream (a client disconnect) aborts too.
    let s = e.submit(GenerateRequest::new(p, greedy(ABORTED_TOKENS)))?;
    drop(s);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(e.stats().num_running_reqs, 0);
    assert!(e.stats().num_aborted_requests_total >= 2);
    assert_pool_empty(&e);
    Ok(())
}

/// Two data-parallel ranks (each its own scheduler, KV cache and prefix
/// cache): the same greedy tokens as one engine, requests spread by each
/// load-balance method, aborts reach the rank that holds the request, a
/// request must fit one rank's cache, and every rank's pages come back.
#[test]
fn data_parallel_ranks_agree_and_spread_the_load() -> Result<()> {
    let ps = prompts(8, 23);
    let want = reference(&ps, 12)?;
    let eos = || shared().model.tokenizer.eos_token_ids.clone();
    for balance in [
        LoadBalance::RoundRobin,
        LoadBalance::ShortestQueue,
        LoadBalance::MinimumTokens,
    ] {
        let cfg = EngineConfig::default();
        let ranks = vec![parts(&cfg, 12, 16, eos())?, parts(&cfg, 12, 16, eos())?];
        let e = Engine::data_parallel(cfg, ranks, balance)?;
        assert_eq!(e.dp_size(), 2);
        assert_eq!(e.capacity_tokens(), 2 * 12 * 16);
        assert_eq!(run_all(&e, &ps, &greedy(12))?, want, "{balance}");
        let per_rank: Vec<u64> = e
            .rank_stats()
            .iter()
            .map(|s| s.num_requests_total)
            .collect();
        assert_eq!(per_rank.iter().sum::<u64>(), 8, "{balance}: {per_rank:?}");
        // Submitted together, the 8 requests are spread evenly in turn and
        // by queue length; by tokens, to both ranks.
        if balance == LoadBalance::MinimumTokens {
            assert!(per_rank.iter().all(|&n| n > 0), "{per_rank:?}");
        } else {
            assert_eq!(per_rank, [4, 4], "{balance}");
        }
        assert_eq!(e.stats().num_requests_total, 8);
        assert_pool_empty(&e);
        for s in e.rank_stats() {
            assert_eq!((s.num_used_tokens, s.evictable_tokens), (0, 0));
        }

        // A request is aborted on whichever rank runs it (one on each, in turn).
        for (i, p) in ps.iter().take(2).enumerate() {
            let rid = format!("victim-{i}");
            let mut s = e.submit(GenerateRequest {
                rid: Some(rid.clone()),
                ..GenerateRequest::new(p.clone(), greedy(ABORTED_DP_TOKENS))
            })?;
            let c = s.blocking_next().expect("a chunk");
            assert!(c.finish.is_none(), "{c:?}");
            e.abort(&rid);
            let f = s.collect_blocking().last().and_then(|c| c.finish.clone());
            assert_eq!(f.expect("finish").kind, FinishKind::Abort);
        }
        if balance == LoadBalance::RoundRobin {
            let aborted: Vec<u64> = e
                .rank_stats()
                .iter()
                .map(|s| s.num_aborted_requests_total)
                .collect();
            assert_eq!(aborted, [1, 1]);
        }
        // Within the context and the ranks' pages together, but more than
        // one rank holds.
        let err = e
            .submit(GenerateRequest::new(vec![5u32; 200], greedy(10)))
            .err()
            .expect("refused");
        assert!(
            err.to_string().contains("KV cache capacity of 192"),
            "{err}"
        );
        assert_pool_empty(&e);
    }
    Ok(())
}

/// SGLang's `data_parallel_rank`: a request pinned to a replica runs there
/// whatever the load balance, with the same greedy tokens; a rank the engine
/// does not have is refused before anything is queued.
#[test]
fn a_request_pinned_to_a_replica_runs_there() -> Result<()> {
    let ps = prompts(4, 19);
    let want = reference(&ps, 8)?;
    let eos = || shared().model.tokenizer.eos_token_ids.clone();
    let cfg = EngineConfig::default();
    let ranks = vec![parts(&cfg, 12, 16, eos())?, parts(&cfg, 12, 16, eos())?];
    let e = Engine::data_parallel(cfg, ranks, LoadBalance::RoundRobin)?;
    let streams = ps
        .iter()
        .map(|p| {
            e.submit(GenerateRequest {
                data_parallel_rank: Some(1),
                ..GenerateRequest::new(p.clone(), greedy(8))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let got: Vec<Vec<u32>> = streams
        .into_iter()
        .map(|s| tokens_of(&s.collect_blocking()))
        .collect();
    assert_eq!(got, want);
    let per_rank: Vec<u64> = e
        .rank_stats()
        .iter()
        .map(|s| s.num_requests_total)
        .collect();
    assert_eq!(per_rank, [0, 4]);
    let err = e
        .submit(GenerateRequest {
            data_parallel_rank: Some(2),
            ..GenerateRequest::new(ps[0].clone(), greedy(8))
        })
        .err()
        .expect("refused");
    assert!(
        err.to_string().contains(
            "data_parallel_rank 2 is out of range: this engine has 2 data-parallel ranks"
        ),
        "{err}"
    );
    assert_pool_empty(&e);

    // One replica: rank 0 is the engine itself, rank 1 does not exist.
    let one = engine(EngineConfig::default(), 12, 16)?;
    let s = one.submit(GenerateRequest {
        data_parallel_rank: Some(0),
        ..GenerateRequest::new(ps[0].clone(), greedy(8))
    })?;
    let tokens = tokens_of(&s.collect_blocking());
    assert_eq!(tokens, want[0]);
    let err = one
        .submit(GenerateRequest {
            data_parallel_rank: Some(1),
            ..GenerateRequest::new(ps[0].clone(), greedy(8))
        })
        .err()
        .expect("refused");
    assert!(
        err.to_string().contains("has 1 data-parallel rank"),
        "{err}"
    );
    assert_pool_empty(&one);
    Ok(())
}

#[test]
fn impossible_requests_are_refused() -> Result<()> {
    let e = engine(EngineConfig::default(), 4, 16)?;
    let long = vec![5u32; 300];
    let err = e
        .submit(GenerateRequest::new(long, greedy(4)))
        .err()
        .expect("refused");
    assert!(err.to_string().contains("context length"), "{err}");
    let err = e
        .submit(GenerateRequest::new(vec![5u32; 60], greedy(10)))
        .err()
        .expect("refused");
    assert!(err.to_string().contains("KV cache capacity"), "{err}");
    let err = e
        .submit(GenerateRequest::new(vec![], greedy(4)))
        .err()
        .expect("refused");
    assert!(err.to_string().contains("empty"), "{err}");
    let err = e
        .submit(GenerateRequest::new(vec![9999], greedy(4)))
        .err()
        .expect("refused");
    assert!(err.to_string().contains("vocabulary"), "{err}");
    assert_pool_empty(&e);
    Ok(())
}

#[test]
fn n_samples_share_the_prompt_and_seeds_repeat() -> Result<()> {
    let e = engine(EngineConfig::default(), 128, 4)?;
    let p = prompts(1, 9).remove(0);
    let params = SamplingParams {
        n: 4,
        temperature: 1.0,
        seed: Some(42),
        max_new_tokens: 16,
        ignore_eos: true,
        ..Default::default()
    };
    let run = || -> Result<Vec<Vec<u32>>> {
        let chunks = e
            .submit(GenerateRequest::new(p.clone(), params.clone()))?
            .collect_blocking();
        let mut per = vec![Vec::new(); 4];
        for c in &chunks {
            per[c.index as usize].extend_from_slice(&c.token_ids);
            if c.finish.is_some() {
                assert!(c.meta.cached_tokens >= p.len() / 4 * 4 - 4, "{:?}", c.meta);
            }
        }
        assert_eq!(chunks.iter().filter(|c| c.finish.is_some()).count(), 4);
        Ok(per)
    };
    let a = run()?;
    assert!(a.iter().all(|s| s.len() == 16));
    assert!(a.windows(2).any(|w| w[0] != w[1]), "samples should differ");
    assert_eq!(a, run()?, "same seed, same samples");
    assert_pool_empty(&e);
    Ok(())
}

/// Every EOS id of generation_config.json is loaded (tiny Llama lists 499
/// and 497), and generation stops at the first sampled token that is any of
/// the engine's EOS ids; `ignore_eos` runs past them.
#[test]
fn every_eos_id_stops_generation() -> Result<()> {
    let mut eos = shared().model.tokenizer.eos_token_ids.clone();
    eos.sort_unstable();
    assert_eq!(
        eos,
        vec![497, 499],
        "generation_config.json eos_token_id list"
    );
    let p = prompts(1, 33).remove(0);
    let plain = engine(EngineConfig::default(), 64, 16)?;
    let free = run_all(&plain, std::slice::from_ref(&p), &greedy(24))?.remove(0);
    assert_pool_empty(&plain);
    // Two EOS ids taken from the free continuation: the earlier one stops it.
    let (a, b) = (free[9], free[4]);
    let first = free
        .iter()
        .position(|t| *t == a || *t == b)
        .expect("present");
    let e = engine_with_eos(EngineConfig::default(), 64, 16, vec![a, b])?;
    let chunks = e
        .submit(GenerateRequest::new(p.clone(), SamplingParams::greedy(24)))?
        .collect_blocking();
    let f = chunks
        .last()
        .and_then(|c| c.finish.clone())
        .expect("finish");
    assert_eq!(f.kind, FinishKind::Stop);
    assert_eq!(f.matched, Some(Matched::Token(free[first])));
    assert_eq!(tokens_of(&chunks), free[..=first].to_vec());
    let past = run_all(&e, std::slice::from_ref(&p), &greedy(24))?.remove(0);
    assert_eq!(past, free, "ignore_eos");
    assert_pool_empty(&e);
    Ok(())
}

#[test]
fn stop_conditions() -> Result<()> {
    let e = engine(EngineConfig::default(), 64, 16)?;
    let tok = &shared().model.tokenizer;
    let p = prompts(1, 21).remove(0);
    let free = run_all(&e, std::slice::from_ref(&p), &greedy(20))?.remove(0);

    // A stop token id ends generation at its first occurrence.
    let stop_id = free[5];
    let first = free.iter().position(|&t| t == stop_id).expect("present");
    let params = SamplingParams {
        stop_token_ids: vec![stop_id],
        ..greedy(20)
    };
    let chunks = e
        .submit(GenerateRequest::new(p.clone(), params))?
        .collect_blocking();
    let f = chunks
        .last()
        .and_then(|c| c.finish.clone())
        .expect("finish");
    assert_eq!(f.matched, Some(Matched::Token(stop_id)));
    assert_eq!(tokens_of(&chunks), free[..=first].to_vec());

    // min_new_tokens suppresses the stop id until then.
    let params = SamplingParams {
        stop_token_ids: vec![stop_id],
        min_new_tokens: first + 1,
        ..greedy(20)
    };
    let chunks = e
        .submit(GenerateRequest::new(p.clone(), params))?
        .collect_blocking();
    assert!(tokens_of(&chunks)[..=first].iter().all(|&t| t != stop_id));

    // A stop string is matched on the text and trimmed; streamed text never shows it.
    let text = arbor_engine_core::TokenDecoder::decode(&**tok, &free, true)?;
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let params = SamplingParams {
        stop: vec![stop.clone()],
        ..greedy(20)
    };
    let chunks = e
        .submit(GenerateRequest::new(p.clone(), params))?
        .collect_blocking();
    let streamed: String = chunks.iter().map(|c| c.text.as_str()).collect();
    let f = chunks
        .last()
        .and_then(|c| c.finish.clone())
        .expect("finish");
    assert_eq!(f.matched, Some(Matched::Text(stop.clone())));
    assert_eq!(streamed, text[..text.find(&stop).expect("stop in text")]);
    let stopped_at = tokens_of(&chunks).len();

    // min_new_tokens holds stop strings back too (as SGLang's check_finished).
    let params = SamplingParams {
        stop: vec![stop.clone()],
        min_new_tokens: stopped_at + 2,
        ..greedy(20)
    };
    let chunks = e
        .submit(GenerateRequest::new(p.clone(), params))?
        .collect_blocking();
    let n = tokens_of(&chunks).len();
    assert!(n >= stopped_at + 2, "{n} tokens, min {}", stopped_at + 2);
    assert_eq!(tokens_of(&chunks), free[..n].to_vec());

    // no_stop_trim keeps the matched stop string in the text.
    let params = SamplingParams {
        stop: vec![stop.clone()],
        no_stop_trim: true,
        ..greedy(20)
    };
    let chunks = e
        .submit(GenerateRequest::new(p.clone(), params))?
        .collect_blocking();
    let streamed: String = chunks.iter().map(|c| c.text.as_str()).collect();
    assert!(streamed.ends_with(&stop), "{streamed:?} ends with {stop:?}");
    assert_eq!(
        streamed,
        text[..text.find(&stop).expect("stop") + stop.len()]
    );

    // stop_regex ends the request at the first token whose text matches a
    // pattern (SGLang's check); the text is kept whole and the finish names
    // the pattern.
    let pattern = format!(
        "{}[^\n]?",
        regex::escape(&stop.chars().take(2).collect::<String>())
    );
    let re = regex::Regex::new(&pattern)?;
    let k = (1..=free.len())
        .find(|&k| {
            arbor_engine_core::TokenDecoder::decode(&**tok, &free[..k], true)
                .is_ok_and(|t| re.is_match(&t))
        })
        .expect("the pattern matches the free text");
    let params = SamplingParams {
        stop_regex: vec![pattern.clone()],
        ..greedy(20)
    };
    let chunks = e
        .submit(GenerateRequest::new(p.clone(), params))?
        .collect_blocking();
    let streamed: String = chunks.iter().map(|c| c.text.as_str()).collect();
    let f = chunks
        .last()
        .and_then(|c| c.finish.clone())
        .expect("finish");
    assert_eq!(f.matched, Some(Matched::Regex(pattern.clone())));
    assert_eq!(tokens_of(&chunks), free[..k].to_vec());
    assert_eq!(
        streamed,
        arbor_engine_core::TokenDecoder::decode(&**tok, &free[..k], true)?
    );
    // A pattern that does not compile is refused, naming the parameter.
    let bad = SamplingParams {
        stop_regex: vec!["(".into()],
        ..greedy(20)
    };
    match e.submit(GenerateRequest::new(p.clone(), bad)) {
        Err(arbor_engine_core::CoreError::InvalidParam { param, .. }) => {
            assert_eq!(param, arbor_engine_core::Param::StopRegex)
        }
        other => panic!("expected a refused stop_regex, got {:?}", other.err()),
    }

    // max_new_tokens = 0 only fills the cache.
    let chunks = e
        .submit(GenerateRequest::new(p.clone(), greedy(0)))?
        .collect_blocking();
    assert_eq!(chunks.len(), 1);
    assert_eq!(
        chunks[0].finish.as_ref().map(|f| f.kind),
        Some(FinishKind::Length)
    );
    assert!(chunks[0].token_ids.is_empty());
    assert_pool_empty(&e);
    Ok(())
}

/// Text made by the reader (requests without stop strings: the scheduler
/// sends ids only) equals the tokenizer's decode of the ids, and the text
/// the scheduler makes for the same tokens (a stop string that never
/// matches); with n = 2 and chunks merged while a stream is not read.
#[test]
fn text_made_by_the_reader_equals_the_schedulers() -> Result<()> {
    let e = engine(EngineConfig::default(), 128, 16)?;
    let tok = &shared().model.tokenizer;
    let decode = |ids: &[u32]| arbor_engine_core::TokenDecoder::decode(&**tok, ids, true);
    let sampled = SamplingParams {
        temperature: 1.0,
        seed: Some(7),
        n: 2,
        ..greedy(24)
    };
    let never = SamplingParams {
        stop: vec!["\u{1}never".into()],
        ..sampled.clone()
    };
    let ps = prompts(6, 33);
    // All submitted before any is read: the later streams' chunks merge.
    let streams: Vec<_> = ps
        .iter()
        .flat_map(|p| [sampled.clone(), never.clone()].map(|q| (p.clone(), q)))
        .map(|(p, q)| e.submit(GenerateRequest::new(p, q)))
        .collect::<Result<_, _>>()?;
    let mut texts = Vec::new();
    for s in streams {
        let chunks = s.collect_blocking();
        let mut per_sample = Vec::new();
        for i in 0..2u32 {
            let mine: Vec<&OutputChunk> = chunks.iter().filter(|c| c.index == i).collect();
            let ids: Vec<u32> = mine.iter().flat_map(|c| c.token_ids.clone()).collect();
            let text: String = mine.iter().map(|c| c.text.as_str()).collect();
            assert_eq!(ids.len(), 24);
            assert_eq!(text, decode(&ids)?);
            per_sample.push(text);
        }
        texts.push(per_sample);
    }
    for pair in texts.chunks(2) {
        assert_eq!(pair[0], pair[1], "reader-made and scheduler-made text");
    }

    // A trimmed stop token has no text; with no_stop_trim it has.
    let p = ps[0].clone();
    let free = run_all(&e, std::slice::from_ref(&p), &greedy(20))?.remove(0);
    let stop_id = free[6];
    let first = free.iter().position(|&t| t == stop_id).expect("present");
    for keep in [false, true] {
        let params = SamplingParams {
            stop_token_ids: vec![stop_id],
            no_stop_trim: keep,
            ..greedy(20)
        };
        let chunks = e
            .submit(GenerateRequest::new(p.clone(), params))?
            .collect_blocking();
        let text: String = chunks.iter().map(|c| c.text.as_str()).collect();
        let upto = if keep { first + 1 } else { first };
        assert_eq!(tokens_of(&chunks), free[..=first].to_vec());
        assert_eq!(text, decode(&free[..upto])?, "no_stop_trim {keep}");
    }
    assert_pool_empty(&e);
    Ok(())
}

// The same properties with overlap scheduling forced on: while batch N runs,
// batch N+1's prefills are admitted (and grammar masks filled); the output
// must not change, and every pool must end empty.

#[test]
fn overlap_alone_batched_cached_chunked_and_retracted_agree() -> Result<()> {
    with_overlap(alone_batched_cached_chunked_and_retracted_agree)
}

#[test]
fn overlap_every_policy_and_mixed_chunks_give_the_same_tokens() -> Result<()> {
    with_overlap(every_policy_and_mixed_chunks_give_the_same_tokens)
}

#[test]
fn overlap_abort_frees_pages_and_drop_aborts() -> Result<()> {
    with_overlap(abort_frees_pages_and_drop_aborts)
}

#[test]
fn overlap_n_samples_share_the_prompt_and_seeds_repeat() -> Result<()> {
    with_overlap(n_samples_share_the_prompt_and_seeds_repeat)
}

#[test]
fn overlap_stop_conditions_and_refusals() -> Result<()> {
    with_overlap(stop_conditions)?;
    with_overlap(impossible_requests_are_refused)
}

/// With more requests than `max_running_requests`, admissions really happen
/// during forwards (counted in the stats), and the tokens are unchanged.
#[test]
fn overlap_admits_during_the_forward() -> Result<()> {
    let ps = prompts(16, 41);
    let want = reference(&ps, 16)?;
    let cfg = EngineConfig {
        overlap_schedule: Some(true),
        max_running_requests: 4,
        ..Default::default()
    };
    let e = engine(cfg, 256, 16)?;
    assert_eq!(run_all(&e, &ps, &greedy(16))?, want);
    let admitted = e.stats().overlap_admitted_total;
    assert!(admitted > 0, "no admission overlapped a forward");
    println!("{admitted} of 16 requests admitted during a forward");
    assert_pool_empty(&e);
    Ok(())
}

/// Runs `prompt` (greedy, `max_new` tokens) under `hold`; its tokens and
/// the prompt tokens it found cached.
fn run_held(
    e: &Engine,
    prompt: &[u32],
    max_new: usize,
    hold: Option<&str>,
) -> Result<(Vec<u32>, usize)> {
    let chunks = e
        .submit(GenerateRequest {
            hold: hold.map(Arc::from),
            ..GenerateRequest::new(prompt.to_vec(), greedy(max_new))
        })?
        .collect_blocking();
    let cached = chunks.last().map_or(0, |c| c.meta.cached_tokens);
    Ok((tokens_of(&chunks), cached))
}

/// Waits for the published stats to satisfy `ok`.
fn wait_stats(e: &Engine, ok: impl Fn(&arbor_engine_core::engine::EngineStats) -> bool) {
    for _ in 0..200 {
        if ok(&e.stats()) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("stats never settled: {:?}", e.stats());
}

/// A held sequence survives the eviction that takes an unheld one, is
/// released by its key (then it is evictable: no page in use), replaces
/// the key's hold it extends, gives way to the budget oldest first and to
/// a request that needs its pages, and never changes the tokens.
#[test]
fn holds_keep_a_sequence_cached_until_released() -> Result<()> {
    let cfg = EngineConfig {
        hold_ratio: 0.25,
        ..EngineConfig::default()
    };
    // 16 pages of 16 tokens: 256 tokens, a hold budget of 64.
    let e = engine(cfg, 16, 16)?;
    let turn: Vec<u32> = (0..40).map(|i| (i * 13 + 5) % 497).collect();
    let flood = |seed| -> Vec<Vec<u32>> {
        prompts(60, seed)
            .into_iter()
            .filter(|x| x.len() > 30)
            .take(12)
            .collect()
    };
    // 40 prompt tokens and 7 computed outputs: 2 whole pages are cached.
    let (first, _) = run_held(&e, &turn, 8, Some("s"))?;
    wait_stats(&e, |s| s.held_tokens == 32 && s.num_used_tokens == 32);
    // Other prompts fill the pool twice over: the unheld prefixes go.
    for f in flood(29) {
        run_held(&e, &f, 8, None)?;
    }
    let mut next = turn.clone();
    next.extend(&first);
    next.extend([5, 6, 7]);
    let (second, cached) = run_held(&e, &next, 8, Some("s"))?;
    assert_eq!(cached, 32, "the held turn is served from the cache");
    // The key's new hold (58 computed tokens: 3 pages) replaces the one it extends.
    wait_stats(&e, |s| s.held_tokens == 48);
    let (again, _) = run_held(&e, &next, 8, None)?;
    assert_eq!(again, second, "a hold never changes the tokens");
    e.release_hold("s");
    wait_stats(&e, |s| s.held_tokens == 0 && s.num_used_tokens == 0);
    // Without a hold a flood evicts the turn.
    run_held(&e, &turn, 8, None)?;
    for f in flood(37) {
        run_held(&e, &f, 8, None)?;
    }
    assert_eq!(run_held(&e, &next, 8, None)?.1, 0);

    // The budget (64 tokens): each new 48- or 32-token hold of another key
    // releases the oldest.
    run_held(&e, &next, 8, Some("a"))?;
    wait_stats(&e, |s| s.held_tokens == 48);
    run_held(&e, &[&next[..30], &[9; 20]].concat(), 8, Some("b"))?;
    wait_stats(&e, |s| s.held_tokens == 48);
    run_held(&e, &turn, 8, Some("c"))?;
    wait_stats(&e, |s| s.held_tokens == 32);
    // A request that needs every page takes the hold's too.
    let long: Vec<u32> = (0..240).map(|i| (i * 7 % 497) as u32).collect();
    let (out, _) = run_held(&e, &long, 8, None)?;
    assert_eq!(out.len(), 8);
    wait_stats(&e, |s| s.held_tokens == 0);
    run_held(&e, &turn, 8, Some("c"))?;
    assert_pool_empty(&e);
    assert_eq!(e.stats().held_tokens, 0, "a flush releases every hold");
    Ok(())
}
