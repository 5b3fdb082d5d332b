//! `arbor bench serving`: a load generator for any server speaking SGLang's
//! native API or the OpenAI API, with SGLang `bench_serving`'s options,
//! phases and printed result.
//!
//! Phases: build the data set (client tokenizer, seed); resolve the model
//! name (`/v1/models` when `--model` is absent); warm up with
//! `--warmup-requests` copies of the first request (at most 32 output
//! tokens, not measured); optionally `POST /flush_cache`; pause one second;
//! then send every request at its arrival time (Poisson gaps at
//! `--request-rate`, all at once for `inf`, or the trace's timestamps divided
//! by `--trace-speed`), at most `--max-concurrency` in flight; measure; print
//! the block; write the per-request JSONL file.
//! Invariants: arrival times do not wait for the concurrency limit (a
//! request that arrives while the limit is reached waits for a slot, and its
//! clock starts when it is sent, as in SGLang); outputs keep the data set's
//! order; the run ends when every request has finished or failed.

use crate::client::{ApiBackend, ClientConfig, RequestOutput, send_request};
use crate::dataset::{self, DatasetRow, GspSpec, Prompt, RandomSpec};
use crate::error::{BenchError, Result};
use crate::files;
use crate::metrics::{self, BlockHeader, MetricOptions, Metrics, Slo};
use crate::profile::prefix_sharing_rate;
use crate::rng::Rng;
use crate::tokenizer::PromptTokenizer;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Map, Value, json};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The request sets of `--dataset-name`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DatasetName {
    /// ShareGPT text cut or repeated to random lengths (random ids without the ShareGPT file).
    Random,
    /// Consecutive vocabulary ids of random lengths.
    RandomIds,
    /// First turns of ShareGPT conversations.
    Sharegpt,
    /// Groups of prompts sharing a random system prompt.
    GeneratedSharedPrefix,
    /// A Mooncake trace: shared 512-token blocks and timestamps.
    Mooncake,
    /// An Azure LLM inference trace: lengths and timestamps.
    Azure,
    /// A JSONL log of prompts (`--dataset-path`).
    Custom,
}

/// Options of `arbor bench serving` (SGLang's names and defaults, except the backend).
#[derive(Args, Debug, Clone)]
pub struct ServingArgs {
    /// API to speak: arbor and sglang use the native /generate; openai uses
    /// /v1/completions; openai-chat uses /v1/chat/completions.
    #[arg(long, value_enum, default_value = "arbor")]
    pub backend: ApiBackend,
    /// Server base URL (overrides --host and --port), e.g. http://127.0.0.1:30000.
    #[arg(long = "base-url")]
    pub base_url: Option<String>,
    /// Server host (without --base-url).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Server port (without --base-url).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Model name for the OpenAI APIs (default: the first of /v1/models); a
    /// local model folder here also supplies the tokenizer.
    #[arg(long)]
    pub model: Option<String>,
    /// Tokenizer: a model folder or a tokenizer.json. Without one, words stand
    /// in for tokens (counts are approximate; see the crate documentation).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The request set.
    #[arg(long = "dataset-name", value_enum, default_value = "sharegpt")]
    pub dataset_name: DatasetName,
    /// Data file (default: the matching file under ../shared/data/traces when present).
    #[arg(long = "dataset-path")]
    pub dataset_path: Option<PathBuf>,
    /// Requests (traces and logs: the first N; generated-shared-prefix: groups x prompts per group).
    #[arg(long = "num-prompts", default_value_t = 1000)]
    pub num_prompts: usize,
    /// Output length of every ShareGPT request (default: the reply's length).
    #[arg(long = "sharegpt-output-len")]
    pub sharegpt_output_len: Option<usize>,
    /// Drop ShareGPT pairs longer than this context.
    #[arg(long = "sharegpt-context-len")]
    pub sharegpt_context_len: Option<usize>,
    /// Largest input length of random prompts (custom logs: unused).
    #[arg(long = "random-input-len", default_value_t = 1024)]
    pub random_input_len: usize,
    /// Largest output length of random prompts (custom logs: the default output length).
    #[arg(long = "random-output-len", default_value_t = 1024)]
    pub random_output_len: usize,
    /// Random lengths are uniform in [ratio * len, len].
    #[arg(long = "random-range-ratio", default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// generated-shared-prefix: groups (distinct system prompts).
    #[arg(long = "gsp-num-groups", default_value_t = 64)]
    pub gsp_num_groups: usize,
    /// generated-shared-prefix: prompts per group.
    #[arg(long = "gsp-prompts-per-group", default_value_t = 16)]
    pub gsp_prompts_per_group: usize,
    /// generated-shared-prefix: system prompt tokens.
    #[arg(long = "gsp-system-prompt-len", default_value_t = 2048)]
    pub gsp_system_prompt_len: usize,
    /// generated-shared-prefix: question tokens.
    #[arg(long = "gsp-question-len", default_value_t = 128)]
    pub gsp_question_len: usize,
    /// generated-shared-prefix: output tokens.
    #[arg(long = "gsp-output-len", default_value_t = 256)]
    pub gsp_output_len: usize,
    /// generated-shared-prefix lengths are uniform in [ratio * len, len] (1: fixed).
    #[arg(long = "gsp-range-ratio", default_value_t = 1.0)]
    pub gsp_range_ratio: f64,
    /// generated-shared-prefix: share of all prompts in the first group, a
    /// hot prefix (0: groups of equal size; the total stays groups x prompts per group).
    #[arg(long = "gsp-hot-group-fraction", default_value_t = 0.0)]
    pub gsp_hot_group_fraction: f64,
    /// Requests per second, Poisson arrivals; inf sends all at once.
    #[arg(long = "request-rate", default_value_t = f64::INFINITY)]
    pub request_rate: f64,
    /// Most requests in flight at once.
    #[arg(long = "max-concurrency")]
    pub max_concurrency: Option<usize>,
    /// Trace replay speed-up: arrivals at timestamp / speed (inf: ignore the
    /// timestamps and use --request-rate).
    #[arg(long = "trace-speed", default_value_t = 1.0)]
    pub trace_speed: f64,
    /// Mooncake: tokens per hash block (512 in the trace); smaller values
    /// shrink prompts in proportion and keep which requests share what.
    #[arg(long = "trace-block-tokens", default_value_t = crate::traces::BLOCK)]
    pub trace_block_tokens: usize,
    /// Traces: every request's output length (default: the trace's).
    #[arg(long = "trace-output-len")]
    pub trace_output_len: Option<usize>,
    /// Unmeasured requests before the run (copies of the first, at most 32 output tokens).
    #[arg(long = "warmup-requests", default_value_t = 1)]
    pub warmup_requests: usize,
    /// POST /flush_cache after the warmup.
    #[arg(long = "flush-cache")]
    pub flush_cache: bool,
    /// Always print the prefix-cache section (it is printed anyway when the server reports cached tokens).
    #[arg(long = "cache-report")]
    pub cache_report: bool,
    /// Ask for whole answers instead of streams (TTFT then equals the latency).
    #[arg(long = "disable-stream")]
    pub disable_stream: bool,
    /// Let the server stop at EOS (outputs may be shorter than asked).
    #[arg(long = "disable-ignore-eos")]
    pub disable_ignore_eos: bool,
    /// Send token ids instead of text (needs the tokenizer; not with openai-chat).
    #[arg(long = "tokenize-prompt")]
    pub tokenize_prompt: bool,
    /// JSON object merged into every request body.
    #[arg(long = "extra-request-body")]
    pub extra_request_body: Option<String>,
    /// Seed of the data set and of the arrival times.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write one JSON record per request (JSONL) to this file.
    #[arg(long = "output-file")]
    pub output_file: Option<PathBuf>,
    /// Append one JSON line with the run's figures (SGLang's result keys) to this file.
    #[arg(long = "output-summary")]
    pub output_summary: Option<PathBuf>,
    /// Goodput: largest acceptable time to first token (ms).
    #[arg(long = "slo-ttft-ms")]
    pub slo_ttft_ms: Option<f64>,
    /// Goodput: largest acceptable gap between two tokens of a request (ms).
    #[arg(long = "slo-itl-ms")]
    pub slo_itl_ms: Option<f64>,
    /// No progress bar.
    #[arg(long = "disable-tqdm", alias = "disable-progress")]
    pub disable_tqdm: bool,
}

/// The outcome of `arbor bench serving`.
#[derive(Debug)]
pub struct ServingReport {
    pub header: BlockHeader,
    pub metrics: Metrics,
    /// The printed block.
    pub block: String,
    /// Per-request measurements, in data set order.
    pub outputs: Vec<RequestOutput>,
}

/// Send times of `n` requests at `rate` per second: SGLang's Poisson process
/// (the first at 0, then exponential gaps); all 0 when `rate` is infinite.
pub fn arrival_times(n: usize, rate: f64, rng: &mut Rng) -> Vec<f64> {
    let mut t = 0.0;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(t);
        if rate.is_finite() {
            t += rng.exponential(rate);
        }
    }
    v
}

/// Send times from trace timestamps: `(ts - first) / speed`.
pub fn trace_times(ts: &[f64], speed: f64) -> Vec<f64> {
    let t0 = ts.iter().copied().fold(f64::INFINITY, f64::min);
    ts.iter().map(|t| ((t - t0) / speed).max(0.0)).collect()
}

fn default_path(args: &ServingArgs, relative: &str) -> Option<PathBuf> {
    args.dataset_path
        .clone()
        .or_else(|| files::find_data_file(relative))
}

fn need_path(args: &ServingArgs, relative: &str) -> Result<PathBuf> {
    default_path(args, relative).ok_or_else(|| {
        let looked: Vec<String> = files::data_dirs()
            .iter()
            .map(|d| d.join(relative).display().to_string())
            .collect();
        BenchError::invalid(format!(
            "no data file: pass --dataset-path (looked in {})",
            looked.join(", ")
        ))
    })
}

/// Builds the request set that `args` describe.
pub fn build_dataset(
    args: &ServingArgs,
    tok: &PromptTokenizer,
    rng: &mut Rng,
) -> Result<Vec<DatasetRow>> {
    let spec = RandomSpec {
        num_prompts: args.num_prompts,
        input_len: args.random_input_len,
        output_len: args.random_output_len,
        range_ratio: args.random_range_ratio,
    };
    let limit = Some(args.num_prompts);
    let mut rows = match args.dataset_name {
        DatasetName::Random => match default_path(args, files::SHAREGPT) {
            Some(p) => dataset::sample_random(spec, tok, &dataset::load_sharegpt_pairs(&p)?, rng)?,
            None => {
                eprintln!(
                    "note: no ShareGPT file found; random prompts use random token ids (as random-ids)"
                );
                dataset::sample_random_ids(spec, tok, rng)?
            }
        },
        DatasetName::RandomIds => dataset::sample_random_ids(spec, tok, rng)?,
        DatasetName::Sharegpt => {
            let pairs = dataset::load_sharegpt_pairs(&need_path(args, files::SHAREGPT)?)?;
            dataset::sample_sharegpt(
                &pairs,
                args.num_prompts,
                tok,
                args.sharegpt_output_len,
                args.sharegpt_context_len,
                rng,
            )?
        }
        DatasetName::GeneratedSharedPrefix => {
            let g = GspSpec {
                num_groups: args.gsp_num_groups,
                prompts_per_group: args.gsp_prompts_per_group,
                system_prompt_len: args.gsp_system_prompt_len,
                question_len: args.gsp_question_len,
                output_len: args.gsp_output_len,
                range_ratio: args.gsp_range_ratio,
                hot_fraction: args.gsp_hot_group_fraction,
            };
            if !(0.0..=1.0).contains(&g.hot_fraction) {
                return Err(BenchError::invalid(
                    "--gsp-hot-group-fraction must be in 0..=1",
                ));
            }
            dataset::sample_gsp(g, tok, rng)?
        }
        DatasetName::Mooncake => {
            let recs = crate::traces::load_mooncake(&need_path(args, files::MOONCAKE)?, limit)?;
            let block = args.trace_block_tokens;
            if block == 0 {
                return Err(BenchError::invalid("--trace-block-tokens must be positive"));
            }
            let recs = crate::traces::scale(&recs, block, args.trace_output_len);
            dataset::from_trace(&recs, tok, args.seed, args.tokenize_prompt, block)?
        }
        DatasetName::Azure => {
            let recs = crate::traces::load_azure(&need_path(args, files::AZURE)?, limit)?;
            let recs = crate::traces::scale(&recs, crate::traces::BLOCK, args.trace_output_len);
            dataset::from_trace(
                &recs,
                tok,
                args.seed,
                args.tokenize_prompt,
                crate::traces::BLOCK,
            )?
        }
        DatasetName::Custom => {
            let p = args
                .dataset_path
                .as_ref()
                .ok_or_else(|| BenchError::invalid("--dataset-name custom needs --dataset-path"))?;
            dataset::from_log(&dataset::load_log(p, limit)?, tok, args.random_output_len)?
        }
    };
    if args.tokenize_prompt {
        for r in &mut rows {
            if let Some(t) = &r.tokens {
                r.prompt = Prompt::Ids(t.clone());
            }
        }
    }
    Ok(rows)
}

fn validate(args: &ServingArgs, tok: &PromptTokenizer) -> Result<()> {
    if args.request_rate.is_nan() || args.request_rate <= 0.0 {
        return Err(BenchError::invalid(
            "--request-rate must be positive (inf: all at once)",
        ));
    }
    if args.trace_speed.is_nan() || args.trace_speed <= 0.0 {
        return Err(BenchError::invalid(
            "--trace-speed must be positive (inf: ignore timestamps)",
        ));
    }
    if args.max_concurrency == Some(0) {
        return Err(BenchError::invalid("--max-concurrency must be at least 1"));
    }
    if args.tokenize_prompt && !tok.is_exact() {
        return Err(BenchError::invalid(
            "--tokenize-prompt needs the model's tokenizer (--tokenizer)",
        ));
    }
    if args.tokenize_prompt && args.backend == ApiBackend::OpenaiChat {
        return Err(BenchError::invalid(
            "--tokenize-prompt cannot be used with openai-chat (messages are text)",
        ));
    }
    Ok(())
}

fn http_client() -> Result<reqwest::Client> {
    // reqwest is built without a default TLS crypto provider: install ring's.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(6 * 3600))
        .build()
        .map_err(|e| BenchError::Server(format!("building the HTTP client: {e}")))
}

fn authorization() -> Option<String> {
    if let Ok(k) = std::env::var("OPENAI_API_KEY").map(|k| k.trim().to_string())
        && !k.is_empty()
    {
        return Some(format!("Bearer {k}"));
    }
    std::env::var("API_KEY")
        .ok()
        .filter(|k| !k.trim().is_empty())
}

async fn model_name(client: &reqwest::Client, base: &str, auth: Option<&str>) -> Option<String> {
    let mut req = client.get(format!("{base}/v1/models"));
    if let Some(a) = auth {
        req = req.header(reqwest::header::AUTHORIZATION, a);
    }
    let v: Value = req.send().await.ok()?.json().await.ok()?;
    v.get("data")?
        .as_array()?
        .first()?
        .get("id")?
        .as_str()
        .map(str::to_string)
}

/// `tokenizer_path` and `model_path` of `/get_model_info` (SGLang and Arbor).
async fn model_info_paths(client: &reqwest::Client, base: &str, auth: Option<&str>) -> Vec<String> {
    let mut req = client.get(format!("{base}/get_model_info"));
    if let Some(a) = auth {
        req = req.header(reqwest::header::AUTHORIZATION, a);
    }
    let Some(v) = async { req.send().await.ok()?.json::<Value>().await.ok() }.await else {
        return Vec::new();
    };
    ["tokenizer_path", "model_path"]
        .iter()
        .filter_map(|k| v.get(*k).and_then(Value::as_str).map(str::to_string))
        .collect()
}

async fn accept_length(client: &reqwest::Client, base: &str) -> Option<f64> {
    let v: Value = client
        .get(format!("{base}/get_server_info"))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    let v = v.get("decode").and_then(|d| d.get(0)).unwrap_or(&v);
    v.get("internal_states")?
        .get(0)?
        .get("avg_spec_accept_length")?
        .as_f64()
        .filter(|a| *a > 0.0)
}

fn progress(n: usize, hidden: bool) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(n as u64);
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:40} {pos}/{len} [{elapsed_precise}<{eta_precise}, {per_sec}]",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

/// What the async part of a run needs.
struct Plan {
    cfg: Arc<ClientConfig>,
    base_url: String,
    rows: Arc<Vec<DatasetRow>>,
    times: Vec<f64>,
    warmup: usize,
    flush_cache: bool,
    max_concurrency: Option<usize>,
    hide_progress: bool,
}

async fn execute(
    plan: Plan,
    client: reqwest::Client,
) -> Result<(Vec<RequestOutput>, f64, Option<f64>)> {
    let Some(first) = plan.rows.first() else {
        return Err(BenchError::invalid("the data set gave no requests"));
    };
    if plan.warmup > 0 {
        eprintln!("Starting warmup with {} sequences...", plan.warmup);
        let t = Instant::now();
        let ol = first.output_len.min(32);
        let tasks: Vec<_> = (0..plan.warmup)
            .map(|_| {
                let (c, cfg, p) = (client.clone(), plan.cfg.clone(), first.prompt.clone());
                let pl = first.prompt_len;
                tokio::spawn(async move { send_request(&c, &cfg, &p, pl, ol, t).await })
            })
            .collect();
        let mut outs = Vec::new();
        for h in tasks {
            outs.push(
                h.await
                    .map_err(|e| BenchError::Server(format!("warmup task: {e}")))?,
            );
        }
        if !outs.iter().any(|o| o.success) {
            return Err(BenchError::WarmupFailed(
                outs.first().map(|o| o.error.clone()).unwrap_or_default(),
            ));
        }
        eprintln!(
            "Warmup completed with {} sequences. Starting main benchmark run...",
            plan.warmup
        );
    }
    if plan.flush_cache {
        let r = client
            .post(format!("{}/flush_cache", plan.base_url))
            .send()
            .await;
        match r {
            Ok(resp) if resp.status().is_success() => {}
            Ok(resp) => eprintln!("warning: /flush_cache answered {}", resp.status()),
            Err(e) => eprintln!("warning: /flush_cache failed: {e}"),
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    let sem = plan
        .max_concurrency
        .map(|n| Arc::new(tokio::sync::Semaphore::new(n)));
    let pb = progress(plan.rows.len(), plan.hide_progress);
    let t_bench = Instant::now();
    let mut handles = Vec::with_capacity(plan.rows.len());
    for (i, &at) in plan.times.iter().enumerate() {
        tokio::time::sleep_until((t_bench + Duration::from_secs_f64(at)).into()).await;
        let (c, cfg, rows, sem, pb) = (
            client.clone(),
            plan.cfg.clone(),
            plan.rows.clone(),
            sem.clone(),
            pb.clone(),
        );
        handles.push(tokio::spawn(async move {
            let _permit = match sem {
                Some(s) => s.acquire_owned().await.ok(),
                None => None,
            };
            let row = &rows[i];
            let mut out = send_request(
                &c,
                &cfg,
                &row.prompt,
                row.prompt_len,
                row.output_len,
                t_bench,
            )
            .await;
            out.index = i;
            pb.inc(1);
            out
        }));
    }
    let mut outputs = Vec::with_capacity(handles.len());
    for (i, h) in handles.into_iter().enumerate() {
        outputs.push(h.await.unwrap_or_else(|e| RequestOutput {
            index: i,
            prompt_len: plan.rows[i].prompt_len,
            error: format!("request task failed: {e}"),
            ..Default::default()
        }));
    }
    let duration = t_bench.elapsed().as_secs_f64();
    pb.finish_and_clear();
    let accept = if plan.cfg.backend.is_native() {
        accept_length(&client, &plan.base_url).await
    } else {
        None
    };
    Ok((outputs, duration, accept))
}

fn write_outputs(path: &Path, outputs: &[RequestOutput]) -> Result<()> {
    let mut f =
        std::io::BufWriter::new(std::fs::File::create(path).map_err(|e| BenchError::io(path, e))?);
    for o in outputs {
        let line = serde_json::to_string(o).map_err(|e| BenchError::data(path, e.to_string()))?;
        writeln!(f, "{line}").map_err(|e| BenchError::io(path, e))?;
    }
    f.flush().map_err(|e| BenchError::io(path, e))
}

fn summary_record(args: &ServingArgs, h: &BlockHeader, m: &Metrics) -> Value {
    let mut r = Map::new();
    let mut put = |k: &str, v: Value| {
        r.insert(k.to_string(), v);
    };
    put("backend", json!(h.backend));
    put(
        "dataset_name",
        json!(
            args.dataset_name
                .to_possible_value()
                .map(|v| v.get_name().to_string())
        ),
    );
    put("request_rate", json!(h.request_rate));
    put("max_concurrency", json!(h.max_concurrency));
    put("random_input_len", json!(args.random_input_len));
    put("random_output_len", json!(args.random_output_len));
    put("random_range_ratio", json!(args.random_range_ratio));
    put("duration", json!(h.duration));
    put("completed", json!(m.completed));
    put("failed", json!(m.failed));
    put("total_input_tokens", json!(m.total_input));
    put("total_output_tokens", json!(m.total_output));
    put(
        "total_output_tokens_retokenized",
        json!(m.total_output_retokenized),
    );
    put("request_throughput", json!(m.request_throughput));
    put("input_throughput", json!(m.input_throughput));
    put("output_throughput", json!(m.output_throughput));
    put("total_throughput", json!(m.total_throughput));
    for (name, s) in [
        ("e2e_latency", &m.e2e_ms),
        ("ttft", &m.ttft_ms),
        ("tpot", &m.tpot_ms),
        ("itl", &m.itl_ms),
    ] {
        for (stat, v) in [
            ("mean", s.mean),
            ("median", s.median),
            ("std", s.std),
            ("p90", s.p90),
            ("p95", s.p95),
            ("p99", s.p99),
        ] {
            put(&format!("{stat}_{name}_ms"), json!(v));
        }
    }
    put("max_itl_ms", json!(m.itl_ms.max));
    put("concurrency", json!(m.concurrency));
    put("accept_length", json!(h.accept_length));
    put("max_output_tokens_per_s", json!(m.max_output_tokens_per_s));
    put("max_concurrent_requests", json!(m.max_concurrent_requests));
    put("goodput", json!(m.goodput));
    put("cache", json!(m.cache));
    Value::Object(r)
}

/// Runs `arbor bench serving`: prints the result block and returns the report.
pub fn run_serving(args: ServingArgs) -> Result<ServingReport> {
    let base_url = args
        .base_url
        .clone()
        .unwrap_or_else(|| format!("http://{}:{}", args.host, args.port))
        .trim_end_matches('/')
        .to_string();
    let client = http_client()?;
    let auth = authorization();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::Server(format!("starting the async runtime: {e}")))?;
    let model = served_model(&args, &runtime, &client, &base_url, auth.as_deref())?;
    // Like SGLang, the model name doubles as the tokenizer when it is a local
    // model; the server's own tokenizer path is the next guess.
    let info_paths = if args.tokenizer.is_none() && !PromptTokenizer::usable(Path::new(&model)) {
        runtime.block_on(model_info_paths(&client, &base_url, auth.as_deref()))
    } else {
        Vec::new()
    };
    let mut candidates: Vec<&str> = vec![model.as_str()];
    candidates.extend(info_paths.iter().map(String::as_str));
    let tok = PromptTokenizer::resolve(args.tokenizer.as_deref(), &candidates)?;
    validate(&args, &tok)?;
    let extra_body: Map<String, Value> = match &args.extra_request_body {
        Some(s) => serde_json::from_str(s).map_err(|e| {
            BenchError::invalid(format!("--extra-request-body is not a JSON object: {e}"))
        })?,
        None => Map::new(),
    };
    let mut rng = Rng::new(args.seed);
    let mut rows = build_dataset(&args, &tok, &mut rng)?;
    eprintln!(
        "#Input tokens: {}",
        rows.iter().map(|r| r.prompt_len).sum::<usize>()
    );
    eprintln!(
        "#Output tokens: {}",
        rows.iter().map(|r| r.output_len).sum::<usize>()
    );
    let (times, use_trace) = arrival_schedule(&args, &mut rows)?;
    let cfg = ClientConfig {
        backend: args.backend,
        api_url: format!("{base_url}{}", args.backend.path()),
        model,
        stream: !args.disable_stream,
        ignore_eos: !args.disable_ignore_eos,
        extra_body,
        authorization: auth,
    };
    let rows = Arc::new(rows);
    let plan = Plan {
        cfg: Arc::new(cfg),
        base_url,
        rows: rows.clone(),
        times,
        warmup: args.warmup_requests,
        flush_cache: args.flush_cache,
        max_concurrency: args.max_concurrency,
        hide_progress: args.disable_tqdm,
    };
    let (outputs, duration, accept) = runtime.block_on(execute(plan, client))?;
    drop(runtime);

    let retok: Option<Vec<usize>> = match &tok {
        PromptTokenizer::Exact(_) => Some(
            outputs
                .iter()
                .map(|o| tok.count(&o.generated_text, false))
                .collect::<Result<_>>()?,
        ),
        PromptTokenizer::Words => None,
    };
    let wants_cache = args.cache_report || outputs.iter().any(|o| o.cached_tokens.is_some());
    let sharing = if wants_cache && rows.iter().all(|r| r.tokens.is_some()) {
        let mut seqs: Vec<&[u32]> = rows.iter().filter_map(|r| r.tokens.as_deref()).collect();
        Some(prefix_sharing_rate(&mut seqs))
    } else {
        None
    };
    let opt = MetricOptions {
        prefer_server_prompt_tokens: !tok.is_exact(),
        slo: Slo {
            ttft_ms: args.slo_ttft_ms,
            itl_ms: args.slo_itl_ms,
        },
        force_cache_report: args.cache_report,
        dataset_sharing_rate: sharing,
    };
    let metrics = metrics::calculate(&outputs, duration, retok.as_deref(), opt);
    let header = BlockHeader {
        backend: args.backend.name().to_string(),
        request_rate: if use_trace {
            "trace".into()
        } else {
            metrics::py_float(args.request_rate)
        },
        max_concurrency: args.max_concurrency,
        duration,
        accept_length: accept,
    };
    let block = metrics::render_block(&header, &metrics);
    println!("\n{block}");
    warn_failures(&metrics, &outputs);
    write_files(&args, &header, &metrics, &outputs)?;
    Ok(ServingReport {
        header,
        metrics,
        block,
        outputs,
    })
}

/// The model name the requests carry: `--model`, else the one the server
/// lists at `/v1/models` (the native API needs none).
fn served_model(
    args: &ServingArgs,
    runtime: &tokio::runtime::Runtime,
    client: &reqwest::Client,
    base_url: &str,
    auth: Option<&str>,
) -> Result<String> {
    let served = match &args.model {
        Some(_) => None,
        None => runtime.block_on(model_name(client, base_url, auth)),
    };
    match (&args.model, &served) {
        (Some(m), _) | (None, Some(m)) => Ok(m.clone()),
        (None, None) if args.backend.is_native() => Ok("default".into()),
        (None, None) => Err(BenchError::Server(format!(
            "could not read the model name from {base_url}/v1/models; pass --model or check --host/--port"
        ))),
    }
}

/// When each request is sent, in seconds from the start: the rows' trace
/// timestamps (sorted, sped up by `--trace-speed`) when every row has one,
/// else arrivals at `--request-rate`; and whether the trace set them.
fn arrival_schedule(args: &ServingArgs, rows: &mut [DatasetRow]) -> Result<(Vec<f64>, bool)> {
    let use_trace = !rows.is_empty()
        && args.trace_speed.is_finite()
        && rows.iter().all(|r| r.timestamp_s.is_some());
    let times = if use_trace {
        rows.sort_by(|a, b| {
            a.timestamp_s
                .unwrap_or(0.0)
                .total_cmp(&b.timestamp_s.unwrap_or(0.0))
        });
        eprintln!(
            "Using trace timestamps for request generation with speed-up {}.",
            args.trace_speed
        );
        let ts: Vec<f64> = rows.iter().filter_map(|r| r.timestamp_s).collect();
        let t = trace_times(&ts, args.trace_speed);
        let last = t.last().copied().unwrap_or(0.0);
        if last > 1e7 {
            return Err(BenchError::invalid(format!(
                "replaying the trace would take {last:.0} s; raise --trace-speed (or inf to ignore timestamps)"
            )));
        }
        t
    } else {
        arrival_times(
            rows.len(),
            args.request_rate,
            &mut Rng::derived(args.seed, 0xA11),
        )
    };
    Ok((times, use_trace))
}

/// Warns with the first error when some requests failed.
fn warn_failures(metrics: &Metrics, outputs: &[RequestOutput]) {
    if metrics.failed > 0 {
        let first = outputs
            .iter()
            .find(|o| !o.success)
            .map(|o| o.error.as_str())
            .unwrap_or_default();
        eprintln!(
            "warning: {} of {} requests failed; first error: {first}",
            metrics.failed,
            outputs.len()
        );
    }
}

/// Writes `--output-file` (every request's output) and appends the summary
/// record to `--output-summary`, when asked.
fn write_files(
    args: &ServingArgs,
    header: &BlockHeader,
    metrics: &Metrics,
    outputs: &[RequestOutput],
) -> Result<()> {
    if let Some(p) = &args.output_file {
        write_outputs(p, outputs)?;
    }
    if let Some(p) = &args.output_summary {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .map_err(|e| BenchError::io(p, e))?;
        writeln!(f, "{}", summary_record(args, header, metrics))
            .map_err(|e| BenchError::io(p, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_arrival_rate_within_tolerance() {
        let mut rng = Rng::new(11);
        let n = 20_000;
        let rate = 50.0;
        let t = arrival_times(n, rate, &mut rng);
        assert_eq!(t[0], 0.0);
        assert!(t.windows(2).all(|w| w[1] >= w[0]));
        let observed = (n - 1) as f64 / t[n - 1];
        assert!(
            (observed - rate).abs() / rate < 0.03,
            "observed {observed}/s"
        );
        // Poisson counts: variance over one-second windows close to the mean.
        let secs = t[n - 1].floor() as usize;
        let mut counts = vec![0f64; secs];
        for &x in &t {
            if (x as usize) < secs {
                counts[x as usize] += 1.0;
            }
        }
        let mean = crate::stats::mean(&counts);
        let var = crate::stats::std_dev(&counts).powi(2);
        assert!((var / mean - 1.0).abs() < 0.25, "dispersion {}", var / mean);
        // Infinite rate: all at once.
        assert!(
            arrival_times(5, f64::INFINITY, &mut rng)
                .iter()
                .all(|&x| x == 0.0)
        );
    }

    #[test]
    fn trace_times_scale_by_speed() {
        assert_eq!(trace_times(&[10.0, 12.0, 11.0], 2.0), vec![0.0, 1.0, 0.5]);
        assert_eq!(trace_times(&[3.0, 4.0], f64::INFINITY), vec![0.0, 0.0]);
    }
}
