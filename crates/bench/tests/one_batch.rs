//! `bench one-batch` on the tiny seeded Llama in tests/fixtures: the sweep
//! runs every shape that fits, skips the one that does not, and writes one
//! record per run. Figures are printed, not asserted.

use anyhow::Result;
use arbor_bench::{OneBatchArgs, run_one_batch};
use clap::Parser;
use std::path::PathBuf;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: OneBatchArgs,
}

#[test]
fn sweep_on_the_tiny_llama() -> Result<()> {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
    if !model.join("config.json").is_file() {
        println!("skipped: {} is absent", model.display());
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("one_batch.jsonl");
    let m = model.to_string_lossy().to_string();
    let o = out.to_string_lossy().to_string();
    let args = Cli::parse_from([
        "one-batch",
        "--model-path",
        &m,
        "--threads",
        "1",
        "--batch-size",
        "1",
        "3",
        "--input-len",
        "16",
        "300",
        "--output-len",
        "4",
        "--result-filename",
        &o,
        "--run-name",
        "tiny",
    ])
    .args;
    let results = run_one_batch(args)?;
    // 300 + 4 tokens exceed the context of 256: two of the four shapes run.
    assert_eq!(results.len(), 2);
    for r in &results {
        assert_eq!(
            (r.input_len, r.output_len, r.run_name.as_str()),
            (16, 4, "tiny")
        );
        assert!(r.prefill_latency > 0.0 && r.total_latency >= r.prefill_latency);
        assert!(r.median_decode_latency.is_some());
    }
    assert_eq!(
        results.iter().map(|r| r.batch_size).collect::<Vec<_>>(),
        vec![1, 3]
    );
    let lines = std::fs::read_to_string(&out)?;
    assert_eq!(lines.lines().count(), 2);
    Ok(())
}
