//! The `arbor` binary: one command-line entry point for every job.
//!
//! Subcommands live in their own modules; this file parses the command line,
//! sets up logging and dispatches. Built-in feature crates are referenced here
//! so the linker keeps their `inventory` registrations.

mod generate;
mod info;
mod setup;

use arbor_backend_cpu as _;
use arbor_models as _;
use clap::{Parser, Subcommand};

/// Arbor: an LLM inference serving engine.
#[derive(Parser, Debug)]
#[command(name = "arbor", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text from a prompt and print speed figures.
    Generate(generate::GenerateArgs),
    /// List registered implementations and the devices they run on.
    Info(info::InfoArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ARBOR_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Info(a) => info::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
