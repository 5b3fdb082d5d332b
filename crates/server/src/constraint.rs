//! Structured-output constraints found in requests, and the one place that
//! decides what to do with them.
//!
//! Both APIs extract their constraint fields (`json_schema`, `regex`, `ebnf`,
//! `structural_tag`, OpenAI's `response_format` and `tools`) into a
//! [`ConstraintSpec`] while parsing; [`compile`] then turns it into a compiled
//! grammar (through the server's grammar cache) that the engine request
//! carries, or refuses it with a 400 that names the field.

use crate::error::ApiError;
use crate::state::AppState;
use arbor_engine_core::grammar::{CompiledGrammar, GrammarSpec};
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// The kind of constraint a request asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    /// Output must match a JSON schema (given as JSON text).
    JsonSchema(String),
    /// Output must be some JSON object (`response_format: json_object`).
    JsonObject,
    /// Output must match a regular expression.
    Regex(String),
    /// Output must match an EBNF / Lark grammar.
    Ebnf(String),
    /// SGLang's structural tags.
    StructuralTag(Value),
    /// A forced tool call (OpenAI `tools` with `tool_choice` required or named):
    /// the JSON schema over the call(s).
    Tools(String),
}

impl Constraint {
    /// The engine's grammar for this constraint (structural tags have none).
    pub fn grammar_spec(&self) -> Option<GrammarSpec> {
        match self {
            Constraint::JsonSchema(s) => Some(GrammarSpec::JsonSchema(s.clone())),
            Constraint::JsonObject => Some(GrammarSpec::JsonObject),
            Constraint::Regex(s) => Some(GrammarSpec::Regex(s.clone())),
            Constraint::Ebnf(s) => Some(GrammarSpec::Ebnf(s.clone())),
            Constraint::Tools(s) => Some(GrammarSpec::JsonSchema(s.clone())),
            Constraint::StructuralTag(_) => None,
        }
    }
}

/// A constraint and the request field it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct ConstraintSpec {
    /// The field, as the client wrote it (e.g. `response_format`).
    pub field: String,
    /// What it asks for.
    pub constraint: Constraint,
}

impl ConstraintSpec {
    /// A constraint from `field`.
    pub fn new(field: &str, constraint: Constraint) -> Self {
        Self {
            field: field.to_string(),
            constraint,
        }
    }
}

/// Sets `slot` to `spec`, refusing a second constraint in one request.
pub(crate) fn set(slot: &mut Option<ConstraintSpec>, spec: ConstraintSpec) -> Result<(), ApiError> {
    if let Some(prev) = slot {
        return Err(ApiError::bad_param(
            &spec.field,
            format!(
                "'{}' and '{}' cannot be combined; give one constraint",
                prev.field, spec.field
            ),
        ));
    }
    *slot = Some(spec);
    Ok(())
}

/// Compiles the request's constraint through the grammar cache, off the async
/// threads (compilation can take a while; requests waiting for it are counted
/// as `num_grammar_queue_reqs`). Invalid grammars are a 400 naming the field.
pub(crate) async fn compile(
    st: &Arc<AppState>,
    spec: Option<&ConstraintSpec>,
) -> Result<Option<Arc<dyn CompiledGrammar>>, ApiError> {
    let Some(spec) = spec else {
        return Ok(None);
    };
    let grammar = match &spec.constraint {
        Constraint::Tools(schema) => GrammarSpec::JsonSchema(schema.clone()),
        Constraint::StructuralTag(_) => {
            return Err(ApiError::unsupported(&spec.field, "structural tags"));
        }
        other => other
            .grammar_spec()
            .ok_or_else(|| ApiError::unsupported(&spec.field, "this constraint"))?,
    };
    let Some(cache) = st.grammar.clone() else {
        return Err(ApiError::unsupported(
            &spec.field,
            "structured output without a grammar backend",
        ));
    };
    st.grammar_queue.fetch_add(1, Ordering::SeqCst);
    let res = tokio::task::spawn_blocking(move || cache.get(&grammar)).await;
    st.grammar_queue.fetch_sub(1, Ordering::SeqCst);
    match res {
        Ok(Ok(g)) => Ok(Some(g)),
        Ok(Err(e)) if e.is_client_error() => Err(ApiError::bad_param(
            &spec.field,
            format!("'{}' cannot be used: {e}", spec.field),
        )),
        Ok(Err(e)) => Err(ApiError::internal(format!(
            "compiling '{}': {e}",
            spec.field
        ))),
        Err(e) => Err(ApiError::internal(format!(
            "grammar compilation failed: {e}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_constraint_per_request() {
        let s = ConstraintSpec::new("regex", Constraint::Regex("a+".into()));
        assert_eq!(
            s.constraint.grammar_spec(),
            Some(GrammarSpec::Regex("a+".into()))
        );
        assert_eq!(Constraint::StructuralTag(Value::Null).grammar_spec(), None);
        let mut slot = None;
        set(&mut slot, s.clone()).unwrap();
        assert!(
            set(
                &mut slot,
                ConstraintSpec::new("ebnf", Constraint::Ebnf("x".into()))
            )
            .is_err()
        );
    }
}
