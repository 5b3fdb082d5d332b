//! Settings declared once: each configuration section is one struct that
//! derives clap's `Args` (its flags, SGLang's names) and serde (its TOML
//! keys), every field an `Option`. [`layered`] merges generically:
//! defaults < TOML file < flags, by key, so no section lists its keys again
//! to merge them.
//!
//! Invariants: a field's TOML key is its name; its flag is its name in
//! kebab case unless its `#[arg(long = ...)]` says otherwise (the
//! `speculative-` prefix, SGLang's spelling). [`Section::defaults`] is the
//! only place a default is written; `arbor serve --help` and the reference
//! pages show it from there ([`with_defaults_in_help`]). Flags that spell a
//! key differently (`--disable-jump-forward` for `jump_forward = false`)
//! are fields the file never sees (`#[serde(skip)]`), folded into their key
//! by [`Section::fold_flags`].

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

/// A configuration section: flags and TOML keys from one struct.
pub trait Section: Serialize + DeserializeOwned + Default {
    /// The section's defaults: keys without one stay `None`.
    fn defaults() -> Self;

    /// Folds flags spelled differently from their key into the key (flags
    /// only; the default does nothing).
    fn fold_flags(&mut self) {}

    /// Fills keys whose default depends on other keys, after the merge
    /// (the default does nothing).
    fn settle(&mut self) {}
}

fn to_map<T: Serialize>(v: &T) -> Map<String, Value> {
    match serde_json::to_value(v) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    }
}

/// `over`'s given keys replace `base`'s.
pub fn overlay<T: Section>(base: T, over: &T) -> T {
    let mut merged = to_map(&base);
    for (k, v) in to_map(over) {
        if !v.is_null() {
            merged.insert(k, v);
        }
    }
    // Both halves came from `T`'s own serialization: they deserialize back.
    serde_json::from_value(Value::Object(merged)).unwrap_or(base)
}

/// Defaults < `file` < `flags`.
pub fn layered<T: Section + Clone>(file: T, flags: &T) -> T {
    let mut flags = flags.clone();
    flags.fold_flags();
    let mut merged = overlay(overlay(T::defaults(), &file), &flags);
    merged.settle();
    merged
}

/// The defaults of a section as (key, value shown to people).
pub fn default_values<T: Section>() -> Vec<(String, String)> {
    to_map(&T::defaults())
        .into_iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| {
            let shown = match v {
                Value::String(s) => s,
                Value::Array(a) => a
                    .iter()
                    .map(|x| x.as_str().map_or_else(|| x.to_string(), str::to_string))
                    .collect::<Vec<_>>()
                    .join(" "),
                other => other.to_string(),
            };
            (k, shown)
        })
        .collect()
}

/// Adds "[default: X]" from `defaults` to the help of each flag whose
/// argument id is the key (clap's id is the field name) and whose help
/// does not state a default already.
pub fn with_defaults_in_help(
    mut cmd: clap::Command,
    defaults: &[(String, String)],
) -> clap::Command {
    for (key, value) in defaults {
        let Some(arg) = cmd.get_arguments().find(|a| a.get_id() == key.as_str()) else {
            continue;
        };
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        if help.contains("[default:") {
            continue;
        }
        let help = format!("{} [default: {value}]", help.trim_end_matches('.'));
        cmd = cmd.mut_arg(key.as_str(), |a| a.help(help));
    }
    cmd
}

/// An engine error, with a setting at fault named as the binary takes it:
/// `[section] key / --flag: reason` (the flag is the `arbor serve`
/// argument whose id is the key).
pub fn named_setting(e: arbor_engine_core::CoreError, section: &str) -> anyhow::Error {
    let arbor_engine_core::CoreError::InvalidSetting { key, reason } = e else {
        return e.into();
    };
    anyhow::anyhow!("{}: {reason}", setting_name(section, key))
}

/// A setting as the binary takes it: `[section] key / --flag` (the flag is
/// the `arbor serve` argument whose id is the key), or `[section] key`
/// for a key with no flag.
pub fn setting_name(section: &str, key: &str) -> String {
    let cmd = crate::cli_command();
    let flag = cmd
        .find_subcommand("serve")
        .and_then(|s| s.get_arguments().find(|a| a.get_id() == key))
        .and_then(|a| a.get_long().map(str::to_string));
    match flag {
        Some(f) => format!("[{section}] {key} / --{f}"),
        None => format!("[{section}] {key}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Args;
    use serde::Deserialize;

    #[derive(Args, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Demo {
        /// A size.
        #[arg(long)]
        size: Option<usize>,
        /// A name.
        #[arg(long)]
        name: Option<String>,
        /// A switch.
        #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
        on: Option<bool>,
        /// The switch's negation.
        #[arg(long = "disable-on")]
        #[serde(skip)]
        disable_on: bool,
    }

    impl Section for Demo {
        fn defaults() -> Self {
            Self {
                size: Some(4),
                on: Some(true),
                ..Default::default()
            }
        }
        fn fold_flags(&mut self) {
            if self.disable_on {
                self.on = Some(false);
            }
        }
    }

    #[test]
    fn flags_over_file_over_defaults() {
        let file: Demo = toml::from_str("name = \"f\"\nsize = 9").unwrap();
        let flags = Demo {
            name: Some("c".into()),
            disable_on: true,
            ..Default::default()
        };
        let got = layered(file.clone(), &flags);
        assert_eq!(
            (got.size, got.name.as_deref(), got.on),
            (Some(9), Some("c"), Some(false))
        );
        let got = layered(Demo::default(), &Demo::default());
        assert_eq!((got.size, got.name, got.on), (Some(4), None, Some(true)));
        assert!(toml::from_str::<Demo>("disable_on = true").is_err());
    }

    #[test]
    fn help_shows_the_declared_default() {
        let cmd = with_defaults_in_help(
            Demo::augment_args(clap::Command::new("demo")),
            &default_values::<Demo>(),
        );
        let size = cmd.get_arguments().find(|a| a.get_id() == "size").unwrap();
        assert_eq!(size.get_help().unwrap().to_string(), "A size [default: 4]");
    }
}
