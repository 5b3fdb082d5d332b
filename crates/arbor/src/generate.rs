//! `arbor generate`: one prompt in, streamed text out, then speed figures.

use crate::setup::{self, ModelArgs};
use anyhow::{Context, Result, bail};
use arbor_engine_core::runner::{ModelRunner, SamplingSetup, generate_static};
use arbor_engine_core::{IncrementalDetokenizer, SamplingParams};
use arbor_models::ChatMessage;
use clap::Args;
use std::io::Write;

/// Options of `arbor generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens to generate.
    #[arg(long = "max-new-tokens", default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long = "top-p", default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long = "top-k", default_value_t = -1)]
    pub top_k: i32,
    #[arg(long = "min-p", default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long = "repetition-penalty", default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long = "frequency-penalty", default_value_t = 0.0)]
    pub frequency_penalty: f32,
    #[arg(long = "presence-penalty", default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Seed of the sampler (same seed, same output).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating past EOS.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let registry = setup::registry()?;
    let backend = setup::backend(&registry, &args.model)?;
    let mut loaded = setup::load(&registry, backend.clone(), &args.model)?;
    setup::apply_tokenizer_path(&mut loaded, &args.model)?;
    let kv_dtype = setup::kv_dtype(&args.model, &*backend, loaded.model.spec())?.dtype;
    let tok = loaded.tokenizer.clone();
    let prompt_text = if args.chat {
        let Some(t) = &loaded.chat_template else {
            bail!(
                "{} has no chat template; drop --chat",
                loaded.path.display()
            );
        };
        let mut msgs = Vec::new();
        if let Some(s) = &args.system {
            msgs.push(ChatMessage::new("system", s));
        }
        msgs.push(ChatMessage::new("user", &args.prompt));
        t.render(
            &msgs,
            true,
            tok.bos_token.as_deref(),
            tok.eos_token.as_deref(),
            None,
        )?
    } else {
        args.prompt.clone()
    };
    // A chat template already writes BOS where the model wants it.
    let ids = tok.encode(&prompt_text, !args.chat)?;
    if ids.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    let params = SamplingParams {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        frequency_penalty: args.frequency_penalty,
        presence_penalty: args.presence_penalty,
        seed: args.seed,
        ignore_eos: args.ignore_eos,
        ..Default::default()
    };
    let spec = loaded.model.spec().clone();
    params.validate(spec.vocab_size)?;
    let page_size = args.model.page_size.max(1);
    let need = ids.len() + args.max_new_tokens;
    let context = args.model.context_len(&spec)?;
    if need > context {
        let whose = if args.model.context_length.is_some() {
            "--context-length"
        } else {
            "the model's context"
        };
        bail!(
            "prompt ({}) + max-new-tokens ({}) exceed {whose} of {context}",
            ids.len(),
            args.max_new_tokens,
        );
    }
    let runner = ModelRunner::new(
        loaded.model.clone(),
        backend,
        None,
        page_size,
        need.div_ceil(page_size),
        kv_dtype,
    )?;
    let pool = runner.new_page_pool();
    let sampler = registry.samplers.get("standard")?()?;
    let processors = vec![
        registry.logits_processors.get("penalties")?(&serde_json::Value::Null)?,
        registry.logits_processors.get("logit_bias")?(&serde_json::Value::Null)?,
    ];
    let setup = SamplingSetup {
        sampler: &*sampler,
        processors: &processors,
        eos_token_ids: &tok.eos_token_ids,
    };
    let mut detok = IncrementalDetokenizer::new(&ids[ids.len().saturating_sub(4)..], true);
    let mut out = std::io::stdout().lock();
    let mut stream_err = None;
    let (outputs, timings) = generate_static(
        &runner,
        &pool,
        std::slice::from_ref(&ids),
        std::slice::from_ref(&params),
        &setup,
        &mut |_, t| match detok.push(&*tok, &[t]) {
            Ok(s) => {
                let _ = out.write_all(s.as_bytes());
                let _ = out.flush();
            }
            Err(e) => stream_err = Some(e),
        },
    )
    .context("generating")?;
    if let Some(e) = stream_err {
        return Err(e.into());
    }
    let _ = out.write_all(detok.flush(&*tok)?.as_bytes());
    drop(out);
    let n_out = outputs.first().map_or(0, |o| o.tokens.len());
    let prefill_s = timings.prefill.as_secs_f64();
    let decode_s = timings.decode.as_secs_f64();
    eprintln!();
    eprintln!(
        "\nprompt tokens: {}, generated tokens: {n_out}, finish: {:?}",
        ids.len(),
        outputs.first().map(|o| &o.finish)
    );
    eprintln!(
        "prefill: {:.1} tok/s ({:.1} ms); decode: {:.1} tok/s ({} steps in {:.1} ms)",
        ids.len() as f64 / prefill_s.max(1e-9),
        prefill_s * 1e3,
        timings.decode_steps as f64 / decode_s.max(1e-9),
        timings.decode_steps,
        decode_s * 1e3
    );
    Ok(())
}
