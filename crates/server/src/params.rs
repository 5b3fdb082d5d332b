//! Request parameters: the one parser of the sampling fields, for every
//! route, and the names each API gives the engine's parameters.
//!
//! A [`Dialect`] is an API's way of spelling a request: SGLang's native
//! `/generate` (fields inside `sampling_params`), OpenAI chat, OpenAI
//! completions (fields at the top level, `max_tokens`, `min_tokens`,
//! `response_format`) and OpenAI responses (`max_output_tokens`; its
//! `text.format` is read by the route). [`sampling`] reads the sampling and constraint fields
//! of any dialect into one [`SamplingParams`]; it checks types only. Ranges
//! and consistency are checked once, by the engine (`Engine::submit`), whose
//! typed error names a [`Param`]; [`Dialect::api_name`] turns that into the
//! field the client wrote, so `error.param` is right on every route without
//! reading a message.

use crate::constraint::{self, Constraint, ConstraintSpec};
use crate::error::ApiError;
use crate::fields::Fields;
use arbor_engine_core::{Param, SamplingParams};
use serde_json::Value;

/// An API's spelling of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// SGLang's `/generate`: sampling fields inside `sampling_params`.
    Native,
    /// OpenAI `/v1/chat/completions`.
    Chat,
    /// OpenAI `/v1/completions`.
    Completions,
    /// OpenAI `/v1/responses` (`max_output_tokens`, `input`; structured
    /// output through `text.format`, read by the route).
    Responses,
}

impl Dialect {
    /// Every dialect, for tables over them.
    pub const ALL: [Dialect; 4] = [
        Dialect::Native,
        Dialect::Chat,
        Dialect::Completions,
        Dialect::Responses,
    ];

    /// True for the parameters a native request carries inside `sampling_params`.
    fn in_sampling_params(p: Param) -> bool {
        !matches!(
            p,
            Param::InputIds
                | Param::TopLogprobsNum
                | Param::LogprobStartLen
                | Param::Rid
                | Param::DataParallelRank
                | Param::FirstToken
                | Param::Lora
        )
    }

    /// The keys that carry `p` in a request body (or in `sampling_params`),
    /// in priority order: when several are given, the first wins.
    pub fn keys(self, p: Param) -> &'static [&'static str] {
        match (self, p) {
            (Dialect::Chat, Param::MaxNewTokens) => &["max_completion_tokens", "max_tokens"],
            (Dialect::Completions, Param::MaxNewTokens) => &["max_tokens"],
            (Dialect::Responses, Param::MaxNewTokens) => &["max_output_tokens"],
            (Dialect::Chat | Dialect::Completions | Dialect::Responses, Param::MinNewTokens) => {
                &["min_tokens"]
            }
            (Dialect::Chat | Dialect::Responses, Param::TopLogprobsNum) => &["top_logprobs"],
            (Dialect::Completions, Param::TopLogprobsNum) => &["logprobs"],
            (Dialect::Chat, Param::InputIds) => &["messages"],
            (Dialect::Completions, Param::InputIds) => &["prompt"],
            (Dialect::Responses, Param::InputIds) => &["input"],
            (Dialect::Chat | Dialect::Completions | Dialect::Responses, Param::Lora) => &["model"],
            (_, Param::MaxNewTokens) => &["max_new_tokens"],
            (_, Param::MinNewTokens) => &["min_new_tokens"],
            (_, Param::Temperature) => &["temperature"],
            (_, Param::TopP) => &["top_p"],
            (_, Param::TopK) => &["top_k"],
            (_, Param::MinP) => &["min_p"],
            (_, Param::RepetitionPenalty) => &["repetition_penalty"],
            (_, Param::FrequencyPenalty) => &["frequency_penalty"],
            (_, Param::PresencePenalty) => &["presence_penalty"],
            (_, Param::LogitBias) => &["logit_bias"],
            (_, Param::Stop) => &["stop"],
            (_, Param::StopRegex) => &["stop_regex"],
            (_, Param::StopTokenIds) => &["stop_token_ids"],
            (_, Param::N) => &["n"],
            (_, Param::TopLogprobsNum) => &["top_logprobs_num"],
            (Dialect::Completions, Param::LogprobStartLen) => &["echo"],
            (_, Param::LogprobStartLen) => &["logprob_start_len"],
            (_, Param::Rid) => &["rid"],
            (_, Param::DataParallelRank) => &["data_parallel_rank"],
            (_, Param::FirstToken) => &["bootstrap_room"],
            (_, Param::InputIds) => &["input_ids"],
            (_, Param::Lora) => &["lora_path"],
        }
    }

    /// The field `p` is reported as in an error (`error.param`): the
    /// dialect's last key (OpenAI's `max_tokens` over
    /// `max_completion_tokens`), with native sampling fields under
    /// `sampling_params.`.
    pub fn api_name(self, p: Param) -> String {
        let key = self.keys(p).last().copied().unwrap_or(p.name());
        if self == Dialect::Native && Self::in_sampling_params(p) {
            format!("sampling_params.{key}")
        } else {
            key.to_string()
        }
    }
}

/// A field of [`SamplingParams`], for tables of fields read alike.
type FieldOf<T> = fn(&mut SamplingParams) -> &mut T;

/// Reads the first of `keys` given as a token count of at least `min`.
fn token_count(f: &mut Fields, keys: &[&str], min: i64) -> Result<Option<usize>, ApiError> {
    let mut found = None;
    for k in keys {
        let v = f.int(k, min, i64::from(u32::MAX))?;
        found = found.or(v.map(|x| x as usize));
    }
    Ok(found)
}

/// Reads the sampling and constraint fields of `d` from `f` (the body for
/// OpenAI, `sampling_params` for native). Fields not given keep
/// [`SamplingParams::default`]; `max_new_tokens` is `None` when not given
/// (each route has its own default). Types are checked here, ranges by the
/// engine.
pub(crate) fn sampling(
    d: Dialect,
    f: &mut Fields,
) -> Result<(SamplingParams, Option<usize>, Option<ConstraintSpec>), ApiError> {
    let mut p = SamplingParams::default();
    let key = |param: Param| d.keys(param)[0];
    // OpenAI's token limits are positive; SGLang's 0 asks for a prefill only.
    let least = if d == Dialect::Native { 0 } else { 1 };
    let max_new_tokens = token_count(f, d.keys(Param::MaxNewTokens), least)?;
    if let Some(x) = token_count(f, d.keys(Param::MinNewTokens), 0)? {
        p.min_new_tokens = x;
    }
    let floats: [(Param, FieldOf<f32>); 6] = [
        (Param::Temperature, |p| &mut p.temperature),
        (Param::TopP, |p| &mut p.top_p),
        (Param::MinP, |p| &mut p.min_p),
        (Param::RepetitionPenalty, |p| &mut p.repetition_penalty),
        (Param::FrequencyPenalty, |p| &mut p.frequency_penalty),
        (Param::PresencePenalty, |p| &mut p.presence_penalty),
    ];
    for (param, field) in floats {
        if let Some(x) = f.f32(key(param))? {
            *field(&mut p) = x;
        }
    }
    if let Some(x) = f.int(key(Param::TopK), i64::from(i32::MIN), i64::from(i32::MAX))? {
        // 0 keeps every token, as -1 does (OpenAI clients send 0).
        p.top_k = if x == 0 { -1 } else { x as i32 };
    }
    if let Some(x) = f.int(key(Param::N), 0, i64::from(u32::MAX))? {
        p.n = x as usize;
    }
    if let Some(x) = f.stop(key(Param::Stop))? {
        p.stop = x;
    }
    if let Some(x) = f.stop(key(Param::StopRegex))? {
        p.stop_regex = x;
    }
    if let Some(x) = f.get::<Vec<u32>>(key(Param::StopTokenIds))? {
        p.stop_token_ids = x;
    }
    if let Some(x) = f.logit_bias(key(Param::LogitBias))? {
        p.logit_bias = x;
    }
    let bools: [(&str, FieldOf<bool>); 3] = [
        ("ignore_eos", |p| &mut p.ignore_eos),
        ("skip_special_tokens", |p| &mut p.skip_special_tokens),
        ("no_stop_trim", |p| &mut p.no_stop_trim),
    ];
    for (k, field) in bools {
        if let Some(x) = f.bool(k)? {
            *field(&mut p) = x;
        }
    }
    p.seed = f.get::<u64>("seed")?;
    if d == Dialect::Native {
        // SGLang's older name of the seed.
        let older = f.get::<u64>("sampling_seed")?;
        p.seed = p.seed.or(older);
        if f.bool("spaces_between_special_tokens")? == Some(false) {
            return Err(ApiError::unsupported(
                &f.name("spaces_between_special_tokens"),
                "false",
            ));
        }
        f.unset_only("custom_params", "custom parameters")?;
        f.ignore("stream_interval");
    }
    let constraint = constraint_fields(d, f)?;
    Ok((p, max_new_tokens, constraint))
}

/// Reads the structured-output fields of `d`: `json_schema`, `regex` and
/// `ebnf` everywhere, `structural_tag` in native requests,
/// `response_format` in OpenAI ones. At most one may be given.
fn constraint_fields(d: Dialect, f: &mut Fields) -> Result<Option<ConstraintSpec>, ApiError> {
    let mut c = None;
    if let Some(v) = f.raw("json_schema") {
        let text = match v {
            Value::String(s) => s,
            other => other.to_string(),
        };
        let spec = ConstraintSpec::new(&f.name("json_schema"), Constraint::JsonSchema(text));
        constraint::set(&mut c, spec)?;
    }
    if let Some(s) = f.string("regex")? {
        constraint::set(
            &mut c,
            ConstraintSpec::new(&f.name("regex"), Constraint::Regex(s)),
        )?;
    }
    if let Some(s) = f.string("ebnf")? {
        constraint::set(
            &mut c,
            ConstraintSpec::new(&f.name("ebnf"), Constraint::Ebnf(s)),
        )?;
    }
    match d {
        Dialect::Native => {
            if let Some(s) = f.raw("structural_tag") {
                let spec =
                    ConstraintSpec::new(&f.name("structural_tag"), Constraint::StructuralTag(s));
                constraint::set(&mut c, spec)?;
            }
        }
        Dialect::Chat | Dialect::Completions => {
            if let Some(v) = f.raw("response_format")
                && let Some(spec) = response_format(v)?
            {
                constraint::set(&mut c, spec)?;
            }
        }
        // `text.format`, read by the route.
        Dialect::Responses => {}
    }
    Ok(c)
}

/// Parses OpenAI's `response_format`: `text` asks for nothing; the others are constraints.
fn response_format(v: Value) -> Result<Option<ConstraintSpec>, ApiError> {
    let mut f = Fields::new(v, "'response_format'", "response_format.")?;
    let kind = f.string("type")?.ok_or_else(|| {
        ApiError::bad_param("response_format.type", "'response_format.type' is required")
    })?;
    let spec = match kind.as_str() {
        "text" => None,
        "json_object" => Some(Constraint::JsonObject),
        "json_schema" => {
            // OpenAI nests the schema: {"json_schema": {"name", "schema", "strict"}}.
            let mut js = f.raw("json_schema").unwrap_or(Value::Null);
            let schema = match js.get_mut("schema") {
                Some(s) => s.take(),
                None => js,
            };
            Some(Constraint::JsonSchema(schema.to_string()))
        }
        "structural_tag" => Some(Constraint::StructuralTag(Value::Null)),
        other => {
            return Err(ApiError::bad_param(
                "response_format.type",
                format!(
                    "'response_format.type' must be text, json_object, json_schema or structural_tag, got '{other}'"
                ),
            ));
        }
    };
    // The rest of the object belongs to the constraint (schema, tags...).
    Ok(spec.map(|c| ConstraintSpec::new("response_format", c)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_parameter_has_a_name_in_every_dialect() {
        for d in Dialect::ALL {
            for p in Param::ALL {
                assert!(!d.keys(p).is_empty(), "{d:?} {p:?}");
            }
        }
        assert_eq!(
            Dialect::Native.api_name(Param::Temperature),
            "sampling_params.temperature"
        );
        assert_eq!(Dialect::Native.api_name(Param::Rid), "rid");
        assert_eq!(Dialect::Chat.api_name(Param::MaxNewTokens), "max_tokens");
        assert_eq!(
            Dialect::Completions.api_name(Param::TopLogprobsNum),
            "logprobs"
        );
    }

    #[test]
    fn the_dialects_read_the_same_values() {
        let native = json!({"max_new_tokens": 7, "min_new_tokens": 2, "temperature": 0.5,
            "top_k": 0, "stop": "x", "sampling_seed": 3});
        let openai = json!({"max_completion_tokens": 7, "max_tokens": 9, "min_tokens": 2,
            "temperature": 0.5, "top_k": 0, "stop": ["x"], "seed": 3});
        let mut f = Fields::new(native, "s", "sampling_params.").unwrap();
        let (a, an, _) = sampling(Dialect::Native, &mut f).unwrap();
        f.finish().unwrap();
        let mut f = Fields::new(openai, "body", "").unwrap();
        let (b, bn, _) = sampling(Dialect::Chat, &mut f).unwrap();
        f.finish().unwrap();
        assert_eq!(a, b);
        assert_eq!((an, bn), (Some(7), Some(7)));
        assert_eq!(a.top_k, -1);
        assert_eq!(a.seed, Some(3));
    }

    #[test]
    fn response_format_extracts_the_schema() {
        let v = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}});
        let spec = response_format(v).unwrap().unwrap();
        assert_eq!(spec.field, "response_format");
        assert_eq!(
            spec.constraint,
            Constraint::JsonSchema("{\"type\":\"object\"}".into())
        );
        assert!(response_format(json!({"type": "text"})).unwrap().is_none());
        assert!(response_format(json!({"type": "xml"})).is_err());
        assert!(response_format(json!({})).is_err());
    }
}
