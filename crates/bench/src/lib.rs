//! Arbor's benchmarks and workload profiler: `arbor bench serving` (a load
//! generator for servers speaking SGLang's native API or the OpenAI API,
//! printing SGLang `bench_serving`'s result block), `arbor bench one-batch`
//! (in-process prefill and decode latency, like `sglang.bench_one_batch`)
//! and `arbor profile-workload` (the seeds' workload profile: lengths, prefix
//! sharing rate, peak concurrency).
//!
//! The crate is a library of clap `Args` structs and `run_*` functions; the
//! `arbor` binary only dispatches to them. Module map: [`dataset`] and
//! [`traces`] build request sets; [`client`] sends and times one request
//! ([`sse`] parses streams); [`serving`] schedules a run and [`metrics`]
//! turns it into figures; [`one_batch`] and [`profile`] are the other two
//! commands; [`stats`], [`rng`], [`tokenizer`] and [`files`] support them.
//! Invariant across the crate: figures are computed and printed, never
//! asserted; the same `--seed` gives the same requests and arrival times.

pub mod client;
pub mod dataset;
pub mod error;
pub mod files;
pub mod metrics;
pub mod one_batch;
pub mod profile;
pub mod rng;
pub mod serving;
pub mod sse;
pub mod stats;
pub mod tokenizer;
pub mod traces;

// Referenced so the linker keeps their `inventory` registrations (one-batch
// builds the CPU backend and the architectures from the registry).
use arbor_backend_cpu as _;
use arbor_models as _;

pub use client::ApiBackend;
pub use error::{BenchError, Result};
pub use one_batch::{OneBatchArgs, OneBatchResult, run_one_batch};
pub use profile::{ProfileArgs, WorkloadProfile, run_profile_workload};
pub use serving::{ServingArgs, ServingReport, run_serving};

/// The subcommands of `arbor bench`.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum BenchCommand {
    /// Load-test a running server (SGLang native or OpenAI API) and print
    /// SGLang's "Serving Benchmark Result" block.
    Serving(Box<ServingArgs>),
    /// Measure prefill and decode latency of one static batch in-process.
    OneBatch(Box<OneBatchArgs>),
}

/// Runs an `arbor bench` subcommand.
pub fn run_bench(command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Serving(a) => run_serving(*a).map(|_| ()),
        BenchCommand::OneBatch(a) => run_one_batch(*a).map(|_| ()),
    }
}
