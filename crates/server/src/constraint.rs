//! Structured-output constraints found in requests, and the one place that
//! decides what to do with them.
//!
//! Both APIs extract their constraint fields (`json_schema`, `regex`, `ebnf`,
//! `structural_tag`, OpenAI's `response_format` and `tools`) into a
//! [`ConstraintSpec`] while parsing; [`admit`] is then called once per request
//! before submission. Until the grammar layer exists it refuses every
//! constraint with a 400 that names the field; the grammar issue replaces its
//! body (compile, cache, attach to the engine request) without touching the
//! parsers.

use crate::error::ApiError;
use arbor_engine_core::grammar::GrammarSpec;
use serde_json::Value;

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
    /// Tool calling (OpenAI `tools`), which needs a tool-call grammar and parser.
    Tools(Value),
}

impl Constraint {
    /// The engine's grammar for this constraint, when it is a plain grammar
    /// (structural tags and tools need more than one).
    pub fn grammar_spec(&self) -> Option<GrammarSpec> {
        match self {
            Constraint::JsonSchema(s) => Some(GrammarSpec::JsonSchema(s.clone())),
            Constraint::JsonObject => Some(GrammarSpec::JsonObject),
            Constraint::Regex(s) => Some(GrammarSpec::Regex(s.clone())),
            Constraint::Ebnf(s) => Some(GrammarSpec::Ebnf(s.clone())),
            Constraint::StructuralTag(_) | Constraint::Tools(_) => None,
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

/// Decides whether the request's constraint can be served.
pub(crate) fn admit(spec: Option<&ConstraintSpec>) -> Result<(), ApiError> {
    let Some(spec) = spec else {
        return Ok(());
    };
    let what = match &spec.constraint {
        Constraint::Tools(_) => "tool calling",
        _ => "structured output (constrained decoding)",
    };
    Err(ApiError::unsupported(&spec.field, what))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_with_the_field_name() {
        assert!(admit(None).is_ok());
        let s = ConstraintSpec::new("regex", Constraint::Regex("a+".into()));
        let e = admit(Some(&s)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("regex"));
        assert!(e.message.contains("not supported yet"));
        assert_eq!(
            s.constraint.grammar_spec(),
            Some(GrammarSpec::Regex("a+".into()))
        );
        assert_eq!(Constraint::Tools(Value::Null).grammar_spec(), None);
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
