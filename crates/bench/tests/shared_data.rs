//! The real traces and ShareGPT file in ../shared/data (skipped with a
//! printed reason when absent), and the exact-tokenizer paths with the tiny
//! Llama's tokenizer from tests/fixtures.

use anyhow::Result;
use arbor_bench::dataset::{self, GspSpec, Prompt};
use arbor_bench::files::{self, AZURE, MOONCAKE, SHAREGPT};
use arbor_bench::profile::{self, ProfileArgs, block_sharing_rate};
use arbor_bench::rng::Rng;
use arbor_bench::tokenizer::PromptTokenizer;
use arbor_bench::traces::{self, BLOCK};
use std::path::PathBuf;

fn data(rel: &str) -> Option<PathBuf> {
    let p = files::find_data_file(rel);
    if p.is_none() {
        println!("skipped: {rel} not found under {:?}", files::data_dirs());
    }
    p
}

fn tiny_tokenizer() -> Option<PromptTokenizer> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
    if !dir.join("tokenizer.json").is_file() {
        println!("skipped: {} is absent", dir.display());
        return None;
    }
    PromptTokenizer::load(&dir).ok()
}

#[test]
fn mooncake_trace_blocks_and_profile() -> Result<()> {
    let Some(path) = data(MOONCAKE) else {
        return Ok(());
    };
    let recs = traces::load_mooncake(&path, Some(2000))?;
    assert_eq!(recs.len(), 2000);
    assert!(recs.iter().all(|r| r.input_len <= r.hash_ids.len() * BLOCK));
    let rate = block_sharing_rate(&recs);
    assert!(rate > 0.0 && rate < 1.0);
    let args = ProfileArgs {
        log: path,
        model_path: None,
        limit: Some(2000),
        assume_ttft_ms: 500.0,
        assume_tpot_ms: 30.0,
        json: false,
    };
    let p = profile::run_profile_workload(args)?;
    assert_eq!(p.requests, 2000);
    assert_eq!(p.prefix_sharing_rate, Some(rate));
    assert!(p.peak_concurrency.is_some());
    Ok(())
}

#[test]
fn azure_trace_parses() -> Result<()> {
    let Some(path) = data(AZURE) else {
        return Ok(());
    };
    let recs = traces::load_azure(&path, Some(500))?;
    assert_eq!(recs.len(), 500);
    let ts: Vec<f64> = recs.iter().filter_map(|r| r.timestamp_s).collect();
    assert_eq!(ts.len(), 500);
    assert!(ts.windows(2).all(|w| w[1] >= w[0] - 1e-6));
    Ok(())
}

#[test]
fn sharegpt_with_the_exact_tokenizer() -> Result<()> {
    let Some(path) = data(SHAREGPT) else {
        return Ok(());
    };
    let Some(tok) = tiny_tokenizer() else {
        return Ok(());
    };
    let pairs = dataset::load_sharegpt_pairs(&path)?;
    assert!(pairs.len() > 2000, "{}", pairs.len());
    let rows = dataset::sample_sharegpt(&pairs, 50, &tok, None, Some(4096), &mut Rng::new(1))?;
    assert_eq!(rows.len(), 50);
    for r in &rows {
        let Prompt::Text(t) = &r.prompt else {
            panic!("text expected")
        };
        assert_eq!(tok.count(t, true)?, r.prompt_len);
        assert!(r.prompt_len >= 2 && r.output_len >= 2 && r.prompt_len + r.output_len <= 4096);
    }
    let spec = dataset::RandomSpec {
        num_prompts: 20,
        input_len: 64,
        output_len: 8,
        range_ratio: 0.5,
    };
    let rows = dataset::sample_random(spec, &tok, &pairs, &mut Rng::new(2))?;
    assert!(rows.iter().all(|r| (32..=64).contains(&r.prompt_len)
        && r.tokens.as_ref().map(Vec::len) == Some(r.prompt_len)));
    Ok(())
}

#[test]
fn shared_prefix_with_the_exact_tokenizer() -> Result<()> {
    let Some(tok) = tiny_tokenizer() else {
        return Ok(());
    };
    let spec = GspSpec {
        num_groups: 3,
        prompts_per_group: 5,
        system_prompt_len: 64,
        question_len: 16,
        output_len: 4,
        range_ratio: 1.0,
        hot_fraction: 0.0,
    };
    let rows = dataset::sample_gsp(spec, &tok, &mut Rng::new(5))?;
    assert_eq!(rows.len(), 15);
    // Prompts with the same system prompt text share a long token prefix.
    let mut by_system = std::collections::HashMap::<String, Vec<Vec<u32>>>::new();
    for r in &rows {
        let Prompt::Text(t) = &r.prompt else {
            panic!("text expected")
        };
        let system = t.split("\n\n").next().unwrap_or_default().to_string();
        by_system
            .entry(system)
            .or_default()
            .push(r.tokens.clone().unwrap_or_default());
    }
    assert_eq!(by_system.len(), 3);
    for seqs in by_system.values() {
        assert_eq!(seqs.len(), 5);
        for s in &seqs[1..] {
            let common = s.iter().zip(&seqs[0]).take_while(|(a, b)| a == b).count();
            assert!(common >= 40, "only {common} tokens shared");
        }
    }
    let mut seqs: Vec<Vec<u32>> = rows.iter().filter_map(|r| r.tokens.clone()).collect();
    assert!(profile::prefix_sharing_rate(&mut seqs) > 0.4);
    Ok(())
}
