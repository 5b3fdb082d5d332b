//! Prefill/decode disaggregation between two engines on the tiny Llama,
//! over a real TCP transfer: the prefill engine computes each prompt, its
//! KV pages travel to the decode engine, and the decode engine's greedy
//! output equals that of an engine that computed everything itself, with
//! the transferred prefix counted as cached, also between engines of two
//! data-parallel ranks; a decode request that starts from the prefill's
//! first token (pulled from a bootstrap room) gives the same output, greedy
//! and seeded, with one forward pass fewer. The pools are empty after a
//! flush.

#[path = "../../engine-core/tests/support/tiny.rs"]
mod tiny;

use anyhow::{Context, Result, ensure};
use arbor_engine_core::engine::refit::PauseMode;
use arbor_engine_core::engine::transfer::{
    FirstToken, KvRooms, KvTransfer, Prefilled, TransferError,
};
use arbor_engine_core::engine::{
    Engine, EngineConfig, EngineParts, FinishKind, GenerateRequest, LoadBalance,
};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{CacheNamespace, DType, PrefixCacheOptions, SamplingParams};
use arbor_kv_radix as _;
use arbor_kv_transfer::wire::Limits;
use arbor_kv_transfer::{RoomConfig, TcpReceiver, TcpRooms, TcpTransfer};
use std::sync::Arc;
use tiny::{assert_pool_empty, greedy, prompts, shared};

fn engine(page: usize, dtype: DType) -> Result<Engine> {
    Ok(Engine::new(config(), parts(page, dtype)?)?)
}

fn config() -> EngineConfig {
    EngineConfig {
        disable_radix_cache: false,
        ..EngineConfig::default()
    }
}

/// An engine of two data-parallel ranks, requests spread in turn.
fn two_rank_engine(page: usize) -> Result<Engine> {
    Ok(Engine::data_parallel(
        config(),
        vec![parts(page, DType::F32)?, parts(page, DType::F32)?],
        LoadBalance::RoundRobin,
    )?)
}

/// One rank's parts: its runner, a radix cache, no processors.
fn parts(page: usize, dtype: DType) -> Result<EngineParts> {
    let s = shared();
    let runner = ModelRunner::new(
        s.model.model.clone(),
        s.backend.clone(),
        None,
        page,
        256,
        dtype,
    )?;
    let policy = s.registry.eviction_policies.get("lru")?()?;
    let cache = s.registry.prefix_caches.get("radix")?(&PrefixCacheOptions {
        page_size: page,
        policy,
    })?;
    let parts = EngineParts::local(
        runner,
        cache,
        s.registry.samplers.get("standard")?()?,
        Vec::new(),
        s.model.tokenizer.clone(),
        s.model.tokenizer.eos_token_ids.clone(),
    );
    Ok(parts)
}

fn generate(e: &Engine, prompt: &[u32], p: &SamplingParams) -> Result<(Vec<u32>, usize)> {
    let chunks = e
        .submit(GenerateRequest::new(prompt.to_vec(), p.clone()))?
        .collect_blocking();
    let last = chunks.last().context("a chunk")?;
    Ok((
        chunks.iter().flat_map(|c| c.token_ids.clone()).collect(),
        last.meta.cached_tokens,
    ))
}

fn receiver(decode: &Arc<Engine>) -> Result<TcpReceiver> {
    let e = decode.clone();
    Ok(TcpReceiver::bind(
        "127.0.0.1:0",
        Arc::new(move |p| e.import_kv(p).map_err(|e| e.to_string())),
        Limits::default(),
    )?)
}

#[test]
fn decode_after_a_transfer_equals_computing_everything() -> Result<()> {
    for page in [1, 16] {
        let reference = engine(page, DType::F32)?;
        let prefill = engine(page, DType::F32)?;
        let decode = Arc::new(engine(page, DType::F32)?);
        let rx = receiver(&decode)?;
        let peer = rx.local_addr().to_string();
        let tcp = TcpTransfer::default();
        for prompt in prompts(6, 11).into_iter().filter(|p| p.len() > page) {
            let (want, _) = generate(&reference, &prompt, &greedy(12))?;
            // The prefill engine computes the prompt (and one token).
            generate(&prefill, &prompt, &greedy(1))?;
            let pages = prefill.export_kv(&prompt, &CacheNamespace::default(), None)?;
            let whole = (prompt.len() / page) * page;
            // The radix cache holds whole pages of the prompt (page 1: all
            // but nothing, since the finished sequence is cached whole).
            ensure!(
                pages.tokens.len() == whole && pages.tokens[..] == prompt[..whole],
                "{page}: {pages:?}"
            );
            let report = tcp.send(&peer, &pages)?;
            ensure!(
                report.tokens == whole && report.bytes == pages.bytes(),
                "{report:?}"
            );
            let (got, cached) = generate(&decode, &prompt, &greedy(12))?;
            ensure!(got == want, "page {page}: {got:?} != {want:?}");
            // The decode engine computed only what the transfer lacked.
            ensure!(
                cached == whole.min(prompt.len() - 1) / page * page,
                "cached {cached} of {}",
                prompt.len()
            );
        }
        assert_pool_empty(&reference);
        assert_pool_empty(&prefill);
        assert_pool_empty(&decode);
    }
    Ok(())
}

/// Two data-parallel ranks on both sides: the prefill engine exports from
/// whichever rank served the prompt, the decode engine imports into the
/// rank its load balance picks (in turn), and the request of that prompt
/// follows its KV there. Without that, every other request would land on
/// the other rank and compute its whole prompt.
#[test]
fn data_parallel_ranks_export_and_follow_the_imported_kv() -> Result<()> {
    let page = 16;
    let reference = engine(page, DType::F32)?;
    let prefill = two_rank_engine(page)?;
    let decode = Arc::new(two_rank_engine(page)?);
    let rx = receiver(&decode)?;
    let peer = rx.local_addr().to_string();
    let tcp = TcpTransfer::default();
    let prompts: Vec<Vec<u32>> = prompts(10, 29)
        .into_iter()
        .filter(|p| p.len() > page)
        .collect();
    ensure!(prompts.len() >= 4, "{} prompts", prompts.len());
    for prompt in &prompts {
        let (want, _) = generate(&reference, prompt, &greedy(12))?;
        generate(&prefill, prompt, &greedy(1))?;
        let pages = prefill.export_kv(prompt, &CacheNamespace::default(), None)?;
        let whole = (prompt.len() / page) * page;
        ensure!(pages.tokens.len() == whole, "{pages:?}");
        tcp.send(&peer, &pages)?;
        let (got, cached) = generate(&decode, prompt, &greedy(12))?;
        ensure!(got == want, "{got:?} != {want:?}");
        ensure!(
            cached == whole.min(prompt.len() - 1) / page * page,
            "cached {cached} of {}: the request missed the rank holding its KV",
            prompt.len()
        );
    }
    // A request pinned to a replica (SGLang's data_parallel_rank) has its
    // KV imported there, and runs there on it; a rank the engine does not
    // have refuses the import.
    let prompt: Vec<u32> = prompts[0].iter().map(|t| t + 1).collect();
    let (want, _) = generate(&reference, &prompt, &greedy(12))?;
    generate(&prefill, &prompt, &greedy(1))?;
    let pages = prefill.export_kv(&prompt, &CacheNamespace::default(), None)?;
    let whole = pages.tokens.len();
    ensure!(whole > 0);
    let e = decode
        .import_kv_on(pages.clone(), Some(2))
        .err()
        .context("an import into rank 2 of 2")?;
    ensure!(
        e.to_string()
            .contains("data_parallel_rank 2 is out of range"),
        "{e}"
    );
    for rank in [1, 0] {
        ensure!(decode.import_kv_on(pages.clone(), Some(rank))? == whole);
        let before: Vec<u64> = decode
            .rank_stats()
            .iter()
            .map(|s| s.num_requests_total)
            .collect();
        let chunks = decode
            .submit(GenerateRequest {
                data_parallel_rank: Some(rank),
                ..GenerateRequest::new(prompt.clone(), greedy(12))
            })?
            .collect_blocking();
        let got: Vec<u32> = chunks.iter().flat_map(|c| c.token_ids.clone()).collect();
        let cached = chunks.last().context("a chunk")?.meta.cached_tokens;
        ensure!(got == want, "{got:?} != {want:?}");
        ensure!(
            cached == whole.min(prompt.len() - 1) / page * page,
            "cached {cached}"
        );
        let after: Vec<u64> = decode
            .rank_stats()
            .iter()
            .map(|s| s.num_requests_total)
            .collect();
        ensure!(after[rank] == before[rank] + 1, "{before:?} -> {after:?}");
    }
    assert_pool_empty(&reference);
    assert_pool_empty(&prefill);
    assert_pool_empty(&decode);
    Ok(())
}

#[test]
fn mismatched_or_unreachable_peers_fail_cleanly() -> Result<()> {
    let prefill = engine(16, DType::F32)?;
    // Another KV dtype is another layout: refused, nothing allocated.
    let decode = Arc::new(engine(16, DType::F16)?);
    let rx = receiver(&decode)?;
    let prompt: Vec<u32> = (1..40).collect();
    generate(&prefill, &prompt, &greedy(1))?;
    let pages = prefill.export_kv(&prompt, &CacheNamespace::default(), None)?;
    ensure!(pages.pages.len() == 2);
    let tcp = TcpTransfer::default();
    match tcp.send(&rx.local_addr().to_string(), &pages) {
        Err(TransferError::Refused(m)) => ensure!(m.contains("another layout"), "{m}"),
        other => anyhow::bail!("{other:?}"),
    }
    ensure!(matches!(
        tcp.send("127.0.0.1:1", &pages),
        Err(TransferError::Io(_))
    ));
    ensure!(matches!(
        tcp.send("no port", &pages),
        Err(TransferError::BadPeer(_))
    ));
    // Nothing cached: an empty export, and an import of it caches nothing.
    let none = prefill.export_kv(&[400, 401, 402], &CacheNamespace::default(), None)?;
    ensure!(none.pages.is_empty() && prefill.import_kv(none)? == 0);
    // A namespace keeps its pages apart.
    let salted = prefill.export_kv(&prompt, &CacheNamespace::new(None, Some("tenant")), None)?;
    ensure!(salted.pages.is_empty());
    assert_pool_empty(&prefill);
    assert_pool_empty(&decode);
    Ok(())
}

/// SGLang's flow: the prefill engine's room holds the pages and the first
/// token it sampled; the decode engine imports the pages and starts the
/// request from that token. Greedy and seeded sampled output equal an
/// engine that computed everything (the seeded sampler skips the draw the
/// token took), the token is streamed before any step (even while the
/// engine is paused), and the decode
/// engine runs one forward pass fewer per request than tokens it returns.
#[test]
fn starting_from_the_prefills_first_token_equals_computing_everything() -> Result<()> {
    let sampled = |max_new| SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(1234),
        ..greedy(max_new)
    };
    let rooms = TcpRooms::bind("127.0.0.1:0", RoomConfig::default())?;
    let tcp = TcpTransfer::default();
    let mut room = 0;
    for page in [1, 16] {
        let reference = engine(page, DType::F32)?;
        let prefill = engine(page, DType::F32)?;
        let decode = engine(page, DType::F32)?;
        for prompt in prompts(5, 17) {
            for params in [greedy(10), sampled(10)] {
                let (want, _) = generate(&reference, &prompt, &params)?;
                let one = SamplingParams {
                    max_new_tokens: 1,
                    ..params.clone()
                };
                let (first, _) = generate(&prefill, &prompt, &one)?;
                ensure!(first[..] == want[..1], "{first:?} vs {want:?}");
                let pages = prefill.export_kv(&prompt, &CacheNamespace::default(), None)?;
                let prompt_tail = prompt[pages.tokens.len()..].to_vec();
                room += 1;
                rooms.put(
                    room,
                    Ok(Prefilled {
                        pages,
                        first: Some(FirstToken {
                            prompt_tail,
                            token: first[0],
                        }),
                    }),
                );
                let got = tcp.pull(&rooms.address(), room)?;
                let token = got.first_token_for(&prompt);
                ensure!(token == Some(first[0]), "{token:?}");
                decode.import_kv(got.pages)?;
                let before = decode.stats();
                // Paused, the engine runs no step: the token arrives anyway.
                decode.pause_generation(PauseMode::InPlace)?;
                let mut stream = decode.submit(GenerateRequest {
                    first_token: token,
                    ..GenerateRequest::new(prompt.clone(), params.clone())
                })?;
                let head = stream.blocking_next().context("the first chunk")?;
                ensure!(head.token_ids == first, "{:?}", head.token_ids);
                decode.continue_generation()?;
                let mut out = head.token_ids;
                out.extend(
                    stream
                        .collect_blocking()
                        .iter()
                        .flat_map(|c| c.token_ids.clone()),
                );
                ensure!(out == want, "page {page}: {out:?} != {want:?}");
                let after = decode.stats();
                ensure!(
                    after.iterations - before.iterations == want.len() as u64 - 1,
                    "{} forward passes for {} tokens",
                    after.iterations - before.iterations,
                    want.len()
                );
                ensure!(after.given_first_tokens_total == before.given_first_tokens_total + 1);
            }
        }
        assert_pool_empty(&reference);
        assert_pool_empty(&prefill);
        assert_pool_empty(&decode);
    }
    Ok(())
}

/// A given first token that ends the request (EOS, or a length of one)
/// finishes it without a step; one the request cannot take is refused.
#[test]
fn a_given_first_token_can_end_the_request_and_bad_ones_are_refused() -> Result<()> {
    let e = engine(16, DType::F32)?;
    let eos = *shared()
        .model
        .tokenizer
        .eos_token_ids
        .first()
        .context("an EOS id")?;
    let prompt: Vec<u32> = (5..30).collect();
    let before = e.stats().iterations;
    for (params, token, kind) in [
        (SamplingParams::greedy(8), eos, FinishKind::Stop),
        (greedy(1), 77, FinishKind::Length),
    ] {
        let chunks = e
            .submit(GenerateRequest {
                first_token: Some(token),
                ..GenerateRequest::new(prompt.clone(), params)
            })?
            .collect_blocking();
        let last = chunks.last().context("a chunk")?;
        let out: Vec<u32> = chunks.iter().flat_map(|c| c.token_ids.clone()).collect();
        ensure!(out == [token], "{out:?}");
        ensure!(
            last.finish.as_ref().map(|f| f.kind) == Some(kind),
            "{:?}",
            last.finish
        );
        ensure!(last.meta.completion_tokens == 1);
    }
    ensure!(e.stats().iterations == before, "a step ran");
    let vocab = shared().model.model.spec().vocab_size as u32;
    for (req, why) in [
        (
            GenerateRequest {
                first_token: Some(vocab),
                ..GenerateRequest::new(prompt.clone(), greedy(4))
            },
            "outside the vocabulary",
        ),
        (
            GenerateRequest {
                first_token: Some(3),
                ..GenerateRequest::new(prompt.clone(), SamplingParams { n: 2, ..greedy(4) })
            },
            "first_token needs n = 1",
        ),
        (
            GenerateRequest {
                first_token: Some(3),
                return_logprob: true,
                ..GenerateRequest::new(prompt.clone(), greedy(4))
            },
            "first_token needs n = 1",
        ),
        (
            GenerateRequest {
                first_token: Some(3),
                ..GenerateRequest::new(prompt.clone(), greedy(0))
            },
            "max_new_tokens > 0",
        ),
    ] {
        let err = e.submit(req).err().context("refused")?;
        ensure!(err.to_string().contains(why), "{err}");
    }
    assert_pool_empty(&e);
    Ok(())
}
