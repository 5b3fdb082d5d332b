//! `--log-requests` (SGLang's flag): one log line when a request's prompt
//! is enqueued and one when each of its samples finishes, at the
//! `arbor::requests` tracing target (shown by default; `ARBOR_LOG` filters
//! it like any target).
//!
//! The level is SGLang's `--log-requests-level`: 0 the metadata (request id,
//! token counts, finish, latency); 1 adds the sampling parameters; 2 adds the
//! prompt and output text cut to their first 2048 characters; 3 the whole
//! texts. Nothing is logged when the option is off.

use arbor_engine_core::TokenDecoder;
use arbor_engine_core::engine::{Finish, FinishKind, GenerateRequest, OutputMeta};

/// The target the lines are logged under.
pub const TARGET: &str = "arbor::requests";

/// Characters of prompt and output text kept at level 2.
const CUT_CHARS: usize = 2048;

/// How much a request line says ([`ServerOptions::log_requests`](crate::ServerOptions)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LogLevel(u8);

impl LogLevel {
    /// The highest level.
    pub const MAX: u8 = 3;

    /// A level of 0 to [`Self::MAX`].
    pub fn new(level: u8) -> Option<Self> {
        (level <= Self::MAX).then_some(Self(level))
    }
}

fn cut(text: &str, level: LogLevel) -> String {
    if level.0 >= 3 {
        return text.to_string();
    }
    match text.char_indices().nth(CUT_CHARS) {
        Some((i, _)) => format!("{}...", &text[..i]),
        None => text.to_string(),
    }
}

/// What a received request's line says beyond its id (built before the
/// request moves into the engine).
pub(crate) fn describe(
    req: &GenerateRequest,
    level: LogLevel,
    tokenizer: &arbor_models::TextTokenizer,
) -> String {
    let mut line = format!(
        "prompt_tokens={} max_new_tokens={}",
        req.input_ids.len(),
        req.params.max_new_tokens
    );
    if level.0 >= 1 {
        line.push_str(&format!(" sampling_params={:?}", req.params));
    }
    if level.0 >= 2 {
        let text = tokenizer.decode(&req.input_ids, false).unwrap_or_default();
        line.push_str(&format!(" text={:?}", cut(&text, level)));
    }
    line
}

/// Logs a received request.
pub(crate) fn received(rid: &str, description: &str) {
    tracing::info!(target: TARGET, "Receive: rid={rid} {description}");
}

/// Logs a finished sample.
pub(crate) fn finished(rid: &str, level: LogLevel, finish: &Finish, meta: &OutputMeta, text: &str) {
    let mut line = format!(
        "Finish: rid={rid} finish={} completion_tokens={} cached_tokens={} e2e_latency={:.3}s",
        match finish.kind {
            FinishKind::Stop => "stop",
            FinishKind::Length => "length",
            FinishKind::Abort => "abort",
        },
        meta.completion_tokens,
        meta.cached_tokens,
        meta.elapsed
    );
    if level.0 >= 2 {
        line.push_str(&format!(" out={:?}", cut(text, level)));
    }
    tracing::info!(target: TARGET, "{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_cuts() {
        assert!(LogLevel::new(4).is_none());
        let two = LogLevel::new(2).unwrap();
        let long = "é".repeat(3000);
        let c = cut(&long, two);
        assert_eq!(c.chars().count(), CUT_CHARS + 3);
        assert_eq!(cut(&long, LogLevel::new(3).unwrap()), long);
        assert_eq!(cut("short", two), "short");
    }
}
