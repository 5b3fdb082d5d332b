//! `cargo run --release -p example-minimal-engine -- [MODEL] ["question"]`:
//! answers a question with the default model (or MODEL) through a custom
//! engine assembled in src/lib.rs.

use anyhow::{Context, Result};
use std::io::Write;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let model = match args.next() {
        Some(p) => p.into(),
        None => arbor_models::default_model_path()
            .filter(|p| p.exists())
            .context("no model given and the default one is absent: run `arbor fetch-default`")?,
    };
    let question = args
        .next()
        .unwrap_or_else(|| "What is the capital of France?".into());
    example_minimal_engine::answer(&model, &question, 64, &mut |t| {
        print!("{t}");
        let _ = std::io::stdout().flush();
    })?;
    println!();
    Ok(())
}
