//! Plugins through the configuration of the real binary: the example plugins
//! are built by the test, listed by `arbor info --plugin`, loaded from
//! `[[plugins]]` (and `--plugin`) into `arbor serve`, and change its behaviour
//! (banned tokens never appear; the size-aware policy is selectable); a
//! plugin with a bad path stops start-up with a clear message.

#![allow(clippy::unwrap_used)]

mod common;

use anyhow::{Context, Result};
use common::*;
use serde_json::json;
use std::path::PathBuf;
use std::process::Command;

fn plugin(name: &str) -> Result<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let target = root.join("target").join("plugin-tests");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "build",
            "-p",
            "arbor-plugin-banned-words",
            "-p",
            "arbor-plugin-size-aware-eviction",
            "-p",
            "arbor-plugin-typical-sampler",
        ])
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(&root)
        .status()?;
    anyhow::ensure!(status.success(), "building the example plugins failed");
    Ok(target.join("debug").join(format!(
        "{}{name}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    )))
}

#[test]
fn info_lists_plugins_next_to_builtins() -> Result<()> {
    let lib = plugin("arbor_plugin_size_aware_eviction")?;
    let out = Command::new(BIN)
        .arg("info")
        .arg("--plugin")
        .arg(&lib)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("plugin size-aware-eviction 0.1.0"), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("size-aware "))
        .context("listed")?;
    assert!(line.contains("plugin"), "{line}");
    assert!(
        text.lines()
            .any(|l| l.contains("lru") && l.contains("built-in"))
    );
    Ok(())
}

/// A sampler plugin named in `[sampling] sampler` through the config file:
/// `arbor info --config` lists it with its origin, and in `arbor serve` it
/// samples every request (typical_p = 0 keeps one candidate per step, so two
/// seeds give the same tokens; the built-in sampler gives different ones).
#[tokio::test]
async fn a_plugin_sampler_from_the_config() -> Result<()> {
    let lib = plugin("arbor_plugin_typical_sampler")?;
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("arbor.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[plugins]]\npath = {:?}\nconfig = {{ typical_p = 0.0 }}\n\n[sampling]\nsampler = \"typical\"\n",
            lib.display().to_string()
        ),
    )?;
    let cfg_s = cfg.display().to_string();
    let out = Command::new(BIN)
        .args(["info", "--config", &cfg_s])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("plugin typical-sampler 0.1.0"), "{text}");
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("typical "))
        .context("typical listed")?;
    assert!(line.contains("plugin"), "{line}");

    let c = client();
    let body = |seed: u64| {
        json!({"input_ids": [10, 52, 7, 99, 130, 41, 77],
               "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "seed": seed, "ignore_eos": true}})
    };
    let ids = |v: &serde_json::Value| -> Vec<u64> {
        v["output_ids"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
            .unwrap_or_default()
    };
    let (std1, std2) = {
        let s = Server::tiny(&[])?;
        let a = ids(&post_ok(&c, &s.url("/generate"), &body(1)).await?);
        let b = ids(&post_ok(&c, &s.url("/generate"), &body(2)).await?);
        (a, b)
    };
    assert_ne!(
        std1, std2,
        "the standard sampler draws differently per seed"
    );
    let s = Server::tiny(&["--config", &cfg_s])?;
    assert!(
        s.log_contains("loaded plugin typical-sampler"),
        "{}",
        s.logs()
    );
    let a = ids(&post_ok(&c, &s.url("/generate"), &body(1)).await?);
    let b = ids(&post_ok(&c, &s.url("/generate"), &body(2)).await?);
    assert_eq!(a.len(), 16);
    assert_eq!(
        a, b,
        "typical_p = 0: one candidate per step whatever the seed"
    );
    assert_no_leak(&c, &s, "arbor", None).await
}

#[tokio::test]
async fn plugins_load_from_the_config_and_take_effect() -> Result<()> {
    let banned_lib = plugin("arbor_plugin_banned_words")?;
    let size_lib = plugin("arbor_plugin_size_aware_eviction")?;
    let c = client();
    let prompt = json!({"input_ids": [10, 52, 7, 99, 130, 41, 77],
                        "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": true}});

    // Without plugins: the free greedy continuation.
    let free = {
        let s = Server::tiny(&[])?;
        let v = post_ok(&c, &s.url("/generate"), &prompt).await?;
        v["output_ids"]
            .as_array()
            .context("ids")?
            .iter()
            .filter_map(|x| x.as_u64())
            .collect::<Vec<_>>()
    };
    let banned: Vec<u64> = free.iter().copied().take(3).collect();

    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("arbor.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[plugins]]\npath = {:?}\nconfig = {{ token_ids = {:?} }}\n\n[cache]\nradix_eviction_policy = \"size-aware\"\n",
            banned_lib.display().to_string(),
            banned
        ),
    )?;
    let cfg_s = cfg.display().to_string();
    let size_s = size_lib.display().to_string();
    let s = Server::tiny(&["--config", &cfg_s, "--plugin", &size_s])?;
    assert!(s.log_contains("loaded plugin banned-words"), "{}", s.logs());
    assert!(
        s.log_contains("loaded plugin size-aware-eviction"),
        "{}",
        s.logs()
    );
    let v = post_ok(&c, &s.url("/generate"), &prompt).await?;
    let out: Vec<u64> = v["output_ids"]
        .as_array()
        .context("ids")?
        .iter()
        .filter_map(|x| x.as_u64())
        .collect();
    assert_eq!(out.len(), 16);
    assert!(
        out.iter().all(|t| !banned.contains(t)),
        "banned {banned:?} appear in {out:?}"
    );
    assert_ne!(out, free);
    drop(s);

    // A missing plugin path stops start-up with a message naming it.
    let out = Command::new(BIN)
        .args([
            "serve",
            "--model-path",
            &fixture("tiny-llama"),
            "--port",
            "0",
            "--plugin",
            "/nonexistent/libx.so",
        ])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("/nonexistent/libx.so") && err.contains("no such file"),
        "{err}"
    );
    Ok(())
}
