//! PEFT's `adapter_config.json`: what Arbor reads of it and what it refuses.
//!
//! Read: `peft_type` (must be `LORA`), `r`, `lora_alpha`, `use_rslora`,
//! `target_modules` (a list of module names, `all-linear`, or a regex string,
//! in which case the tensor names decide), `layers_to_transform`,
//! `rank_pattern` and `alpha_pattern` (keys matched against a module's full
//! name `model.layers.{i}.self_attn.q_proj` as PEFT does: the whole name, or
//! a suffix after a `.`). Refused with a message naming the key: DoRA,
//! `fan_in_fan_out`, LoRA biases, `modules_to_save`, and target modules
//! outside q/k/v/o/gate/up/down.

use crate::error::{LoraError, Result};
use arbor_engine_core::LoraTarget;
use serde_json::Value;
use std::collections::BTreeMap;

/// Which modules the config names.
#[derive(Clone, Debug, PartialEq)]
pub enum TargetModules {
    /// These modules (a list in the config).
    Listed(Vec<LoraTarget>),
    /// Whatever the tensors hold (`all-linear`, a regex, or absent).
    FromTensors,
}

/// The parts of a PEFT LoRA config Arbor serves.
#[derive(Clone, Debug)]
pub struct PeftConfig {
    /// Default rank.
    pub r: usize,
    /// Default alpha.
    pub alpha: f64,
    /// Scaling `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
    /// Targeted modules.
    pub targets: TargetModules,
    /// Layers the config restricts the adapter to (`None`: every layer).
    pub layers: Option<Vec<usize>>,
    /// Rank per module pattern.
    pub rank_pattern: BTreeMap<String, usize>,
    /// Alpha per module pattern.
    pub alpha_pattern: BTreeMap<String, f64>,
}

fn invalid(name: &str, msg: String) -> LoraError {
    LoraError::Invalid {
        name: name.to_string(),
        msg,
    }
}

fn unsupported(name: &str, what: &str) -> LoraError {
    LoraError::Unsupported {
        name: name.to_string(),
        what: what.to_string(),
    }
}

fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::String(s)) => !s.is_empty() && s != "none",
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    }
}

impl PeftConfig {
    /// Parses the text of `adapter_config.json` of the adapter `name`.
    pub fn parse(name: &str, text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| invalid(name, format!("adapter_config.json is not JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| invalid(name, "adapter_config.json is not an object".into()))?;
        let peft_type = obj
            .get("peft_type")
            .and_then(Value::as_str)
            .unwrap_or("LORA");
        if !peft_type.eq_ignore_ascii_case("lora") {
            return Err(unsupported(name, &format!("peft_type '{peft_type}'")));
        }
        if truthy(obj.get("use_dora")) {
            return Err(unsupported(name, "use_dora (DoRA)"));
        }
        if truthy(obj.get("fan_in_fan_out")) {
            return Err(unsupported(name, "fan_in_fan_out"));
        }
        if truthy(obj.get("lora_bias")) || truthy(obj.get("bias")) {
            return Err(unsupported(
                name,
                "a LoRA bias ('bias' other than \"none\")",
            ));
        }
        if truthy(obj.get("modules_to_save")) {
            return Err(unsupported(
                name,
                "modules_to_save (full copies of modules)",
            ));
        }
        let r =
            match obj.get("r") {
                Some(x) => x.as_u64().filter(|&r| r > 0).ok_or_else(|| {
                    invalid(name, format!("'r' must be a positive integer, got {x}"))
                })? as usize,
                None => return Err(invalid(name, "adapter_config.json has no 'r'".into())),
            };
        let alpha = match obj.get("lora_alpha") {
            None | Some(Value::Null) => 8.0,
            Some(x) => x
                .as_f64()
                .ok_or_else(|| invalid(name, format!("'lora_alpha' must be a number, got {x}")))?,
        };
        let use_rslora = matches!(obj.get("use_rslora"), Some(Value::Bool(true)));
        let targets = match obj.get("target_modules") {
            Some(Value::Array(a)) => {
                let mut t = Vec::with_capacity(a.len());
                for m in a {
                    let m = m.as_str().ok_or_else(|| {
                        invalid(name, format!("'target_modules' holds {m}, not a name"))
                    })?;
                    let target = LoraTarget::from_module(m).ok_or_else(|| {
                        invalid(
                            name,
                            format!(
                                "target module '{m}' is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
                            ),
                        )
                    })?;
                    if !t.contains(&target) {
                        t.push(target);
                    }
                }
                t.sort();
                TargetModules::Listed(t)
            }
            _ => TargetModules::FromTensors,
        };
        let layers =
            match obj.get("layers_to_transform") {
                None | Some(Value::Null) => None,
                Some(Value::Number(n)) => Some(vec![n.as_u64().ok_or_else(|| {
                    invalid(name, format!("'layers_to_transform' {n} is not a layer"))
                })? as usize]),
                Some(Value::Array(a)) => Some(
                    a.iter()
                        .map(|x| {
                            x.as_u64().map(|l| l as usize).ok_or_else(|| {
                                invalid(name, format!("'layers_to_transform' holds {x}"))
                            })
                        })
                        .collect::<Result<Vec<_>>>()?,
                ),
                Some(x) => {
                    return Err(invalid(
                        name,
                        format!("'layers_to_transform' must be a layer or a list, got {x}"),
                    ));
                }
            };
        let rank_pattern = pattern(name, obj.get("rank_pattern"), "rank_pattern", |v| {
            v.as_u64().filter(|&r| r > 0).map(|r| r as usize)
        })?;
        let alpha_pattern = pattern(
            name,
            obj.get("alpha_pattern"),
            "alpha_pattern",
            Value::as_f64,
        )?;
        Ok(Self {
            r,
            alpha,
            use_rslora,
            targets,
            layers,
            rank_pattern,
            alpha_pattern,
        })
    }

    /// Rank and scaling of the module with full name `module`
    /// (`model.layers.3.self_attn.q_proj`).
    pub fn rank_and_scaling(&self, module: &str) -> (usize, f64) {
        let r = lookup(&self.rank_pattern, module).unwrap_or(self.r);
        let alpha = lookup(&self.alpha_pattern, module).unwrap_or(self.alpha);
        let scaling = if self.use_rslora {
            alpha / (r as f64).sqrt()
        } else {
            alpha / r as f64
        };
        (r, scaling)
    }
}

fn pattern<T>(
    name: &str,
    v: Option<&Value>,
    key: &str,
    parse: impl Fn(&Value) -> Option<T>,
) -> Result<BTreeMap<String, T>> {
    let mut out = BTreeMap::new();
    let Some(Value::Object(o)) = v else {
        return Ok(out);
    };
    for (k, x) in o {
        let val = parse(x).ok_or_else(|| invalid(name, format!("'{key}' has {k}: {x}")))?;
        out.insert(k.clone(), val);
    }
    Ok(out)
}

/// The value of the pattern matching `module`: the key equal to the whole
/// name, else the longest key that is a suffix after a `.`.
fn lookup<T: Copy>(patterns: &BTreeMap<String, T>, module: &str) -> Option<T> {
    if let Some(v) = patterns.get(module) {
        return Some(*v);
    }
    patterns
        .iter()
        .filter(|(k, _)| {
            module
                .strip_suffix(k.as_str())
                .is_some_and(|head| head.ends_with('.'))
        })
        .max_by_key(|(k, _)| k.len())
        .map(|(_, v)| *v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_and_refusals() {
        let c = PeftConfig::parse(
            "t",
            r#"{"peft_type":"LORA","r":8,"lora_alpha":16,"target_modules":["v_proj","q_proj"],
               "rank_pattern":{"q_proj":4,"model.layers.1.self_attn.v_proj":2},"alpha_pattern":{"q_proj":2}}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            c.targets,
            TargetModules::Listed(vec![LoraTarget::Q, LoraTarget::V])
        );
        assert_eq!(
            c.rank_and_scaling("model.layers.0.self_attn.q_proj"),
            (4, 0.5)
        );
        assert_eq!(
            c.rank_and_scaling("model.layers.1.self_attn.v_proj"),
            (2, 8.0)
        );
        assert_eq!(
            c.rank_and_scaling("model.layers.0.self_attn.v_proj"),
            (8, 2.0)
        );
        // A key matches only after a dot.
        assert_eq!(
            c.rank_and_scaling("model.layers.0.self_attn.xq_proj"),
            (8, 2.0)
        );
        for (cfg, word) in [
            (r#"{"r":8,"use_dora":true}"#, "DoRA"),
            (r#"{"r":8,"bias":"all"}"#, "bias"),
            (
                r#"{"r":8,"modules_to_save":["lm_head"]}"#,
                "modules_to_save",
            ),
            (r#"{"r":8,"target_modules":["lm_head"]}"#, "lm_head"),
            (r#"{"r":0}"#, "'r'"),
            (r#"{"peft_type":"IA3","r":8}"#, "IA3"),
        ] {
            let e = PeftConfig::parse("t", cfg).err().map(|e| e.to_string());
            assert!(
                e.as_deref().is_some_and(|e| e.contains(word)),
                "{cfg}: {e:?}"
            );
        }
    }
}
