//! `arbor info`: what this binary can do.

use crate::setup;
use anyhow::{Context, Result};
use arbor_engine_core::BackendOptions;
use arbor_engine_core::registry::Origin;
use clap::Args;

/// Options of `arbor info`.
#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Also load this plugin library and list what it provides (repeatable).
    #[arg(long = "plugin", value_name = "PATH")]
    pub plugin: Vec<std::path::PathBuf>,
    /// Also load the `[[plugins]]` of this `arbor serve` config file, with their config.
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
}

pub fn run(args: InfoArgs) -> Result<()> {
    let mut registry = setup::registry()?;
    let mut plugins: Vec<(std::path::PathBuf, serde_json::Value)> = Vec::new();
    if let Some(path) = &args.config {
        for p in crate::config::FileConfig::load(path)?.plugins {
            let config = match &p.config {
                Some(t) => serde_json::to_value(t)?,
                None => serde_json::Value::Null,
            };
            plugins.push((p.path, config));
        }
    }
    plugins.extend(
        args.plugin
            .iter()
            .map(|p| (p.clone(), serde_json::Value::Null)),
    );
    for (p, config) in &plugins {
        let info = arbor_engine_core::plugin::load_plugin(p, config, &mut registry)
            .with_context(|| format!("plugin {}", p.display()))?;
        println!("plugin {} {} ({})", info.name, info.version, p.display());
    }
    println!("Arbor {}", env!("CARGO_PKG_VERSION"));
    let mut last = "";
    for (kind, name, about, origin) in registry.listing() {
        if kind != last {
            println!("\n{}:", plural(kind));
            last = kind;
        }
        let from = match origin {
            Origin::Builtin => "built-in".to_string(),
            Origin::Plugin(p) => format!("plugin {p}"),
        };
        println!("  {name:<22} {about} ({from})");
    }
    println!("\ndevices:");
    for name in registry.backends.names() {
        let factory = registry.backends.get(&name)?;
        match factory(&BackendOptions::default()) {
            Ok(b) => {
                let i = b.info();
                let caps = b.capabilities();
                println!(
                    "  {name}: {} ({} threads); attention: {}; KV dtypes: {}",
                    i.name,
                    i.parallelism.unwrap_or(1),
                    caps.attention.join(", "),
                    caps.kv_dtypes
                        .iter()
                        .map(|d| d.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            Err(e) => println!("  {name}: unavailable ({e})"),
        }
    }
    #[cfg(feature = "wgpu")]
    wgpu_adapters();
    Ok(())
}

/// The adapters `--device wgpu --wgpu-adapter NAME` can pick, with their limits.
#[cfg(feature = "wgpu")]
fn wgpu_adapters() {
    let all = arbor_backend_wgpu::adapters();
    println!(
        "\nwgpu adapters{}:",
        if all.is_empty() { " (none found)" } else { "" }
    );
    for a in all {
        println!(
            "  {} ({}, {}, {}): max buffer {} MiB, max storage binding {} MiB, \
             {} invocations per workgroup, {} workgroups per dimension, shader-f16 {}",
            a.name,
            a.backend,
            a.device_type,
            a.driver,
            a.max_buffer_size >> 20,
            a.max_storage_binding >> 20,
            a.max_workgroup_invocations,
            a.max_workgroups_per_dim,
            if a.shader_f16 { "yes" } else { "no" }
        );
    }
}

/// The plural of a registry kind's name ("eviction policy": "eviction policies").
fn plural(kind: &str) -> String {
    match kind.strip_suffix('y') {
        Some(stem) => format!("{stem}ies"),
        None => format!("{kind}s"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn kinds_are_listed_in_the_plural() {
        assert_eq!(super::plural("eviction policy"), "eviction policies");
        assert_eq!(super::plural("quantization method"), "quantization methods");
    }
}
