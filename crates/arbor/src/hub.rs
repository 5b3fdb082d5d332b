//! Hugging Face Hub model ids: `--model-path ORG/NAME` (and
//! `--tokenizer-path`, `--speculative-draft-model-path`) resolve to a folder
//! of the Hugging Face cache, laid out as `huggingface_hub` lays it out
//! (`models--ORG--NAME/{refs,blobs,snapshots}`), so the two share files.
//!
//! - An existing local path is never a hub id; a hub id is `ORG/NAME` (one
//!   slash, letters, digits, `-`, `_`, `.`).
//! - The cache is `HF_HUB_CACHE`, else `HF_HOME/hub`, else
//!   `~/.cache/huggingface/hub`.
//! - A snapshot already complete in the cache (its config, tokenizer and
//!   every weight file its index names) is used without the network. With
//!   `HF_HUB_OFFLINE=1` nothing else is tried.
//! - Otherwise the files are downloaded with the hub's client crate
//!   (`hf-hub`, honouring `HF_ENDPOINT`; the token is `HF_TOKEN`, else the
//!   cache's token file), with a progress bar. Only the top-level files a
//!   server needs are fetched: JSON, templates, tokenizer files and the
//!   weights (safetensors, else PyTorch `.bin`). A file is written to a
//!   `.part` file and renamed into the cache only when complete, so a failed
//!   download leaves nothing a later run would load; the next run resumes it.

use anyhow::{Context, Result, bail};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};
use std::path::{Path, PathBuf};

/// The branch a hub id means without `--revision`.
pub const DEFAULT_REVISION: &str = "main";

/// What a resolved folder must hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// A whole model: config, tokenizer and weights.
    Model,
    /// A tokenizer (and chat template) only.
    Tokenizer,
}

/// `given` as a local path: itself when it exists or is not a hub id, else
/// the hub id resolved through the cache (downloading what is missing).
pub fn local_path(given: &Path, revision: Option<&str>, want: Want) -> Result<PathBuf> {
    match hub_id(given) {
        Some(id) => resolve(id, revision.unwrap_or(DEFAULT_REVISION), want),
        None => Ok(given.to_path_buf()),
    }
}

/// `path` as a hub id (`ORG/NAME`), when it is one and no such local path exists.
pub fn hub_id(path: &Path) -> Option<&str> {
    let s = path.to_str()?;
    if path.exists() {
        return None;
    }
    let (org, name) = s.split_once('/')?;
    let part_ok = |p: &str| {
        !p.is_empty()
            && !p.starts_with('.')
            && !p.ends_with('.')
            && !p.contains("..")
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    (part_ok(org) && part_ok(name)).then_some(s)
}

/// The cache folder: `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(p) = env_path("HF_HUB_CACHE") {
        return Ok(p);
    }
    if let Some(p) = env_path("HF_HOME") {
        return Ok(p.join("hub"));
    }
    let home = env_path("HOME").context("neither HF_HUB_CACHE, HF_HOME nor HOME is set")?;
    Ok(home.join(".cache/huggingface/hub"))
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// `HF_HUB_OFFLINE` set to a true value (1, true, yes, on).
fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// The snapshot folder of `id` at `revision` in the cache at `cache`, if the
/// revision is known there (a branch or tag through `refs/`, or a commit).
pub fn cached_snapshot(cache: &Path, id: &str, revision: &str) -> Option<PathBuf> {
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let commit = match std::fs::read_to_string(repo.join("refs").join(revision)) {
        Ok(c) => c.trim().to_string(),
        Err(_) if is_commit(revision) => revision.to_string(),
        Err(_) => return None,
    };
    let dir = repo.join("snapshots").join(commit);
    dir.is_dir().then_some(dir)
}

fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether `dir` holds what `want` needs: a tokenizer, and for a model its
/// config and every weight file (those its index names, or one file).
pub fn complete(dir: &Path, want: Want) -> bool {
    let has = |f: &str| dir.join(f).is_file();
    let tokenizer = has("tokenizer.json") || has("tokenizer_config.json");
    if want == Want::Tokenizer {
        return tokenizer;
    }
    if !has("config.json") || !tokenizer {
        return false;
    }
    for index in [
        "model.safetensors.index.json",
        "pytorch_model.bin.index.json",
    ] {
        let Ok(text) = std::fs::read_to_string(dir.join(index)) else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
            return false;
        };
        let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
            return false;
        };
        return map
            .values()
            .filter_map(|f| f.as_str())
            .all(|f| dir.join(f).is_file());
    }
    has("model.safetensors") || has("pytorch_model.bin")
}

/// Resolves `id` at `revision` to a complete snapshot folder.
fn resolve(id: &str, revision: &str, want: Want) -> Result<PathBuf> {
    let cache = cache_dir()?;
    if let Some(dir) = cached_snapshot(&cache, id, revision).filter(|d| complete(d, want)) {
        return Ok(dir);
    }
    if offline() {
        bail!(
            "{id} (revision {revision}) is not a local path, and the Hugging Face cache at {} does \
             not hold it complete; HF_HUB_OFFLINE is set, so nothing is downloaded",
            cache.display()
        );
    }
    download(&cache, id, revision, want)
}

/// The repository files `want` needs, of those listed.
fn wanted(files: &[String], want: Want) -> Vec<String> {
    // Top-level files, and sentence-transformers' pooling config of an embedding model.
    let top: Vec<&String> = files
        .iter()
        .filter(|f| !f.contains('/') || f.as_str() == "1_Pooling/config.json")
        .collect();
    let meta = |f: &str| {
        f.ends_with(".json")
            || f.ends_with(".jinja")
            || f.ends_with(".txt")
            || f.ends_with(".model")
            || f.ends_with(".tiktoken")
    };
    let safetensors = top.iter().any(|f| f.ends_with(".safetensors"));
    let weight = |f: &str| {
        want == Want::Model
            && if safetensors {
                f.ends_with(".safetensors")
            } else {
                f.ends_with(".bin")
            }
    };
    top.into_iter()
        .filter(|f| meta(f) || weight(f))
        .cloned()
        .collect()
}

fn download(cache: &Path, id: &str, revision: &str, want: Want) -> Result<PathBuf> {
    let hub_cache = Cache::new(cache.to_path_buf());
    let token = std::env::var("HF_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .or_else(|| hub_cache.token());
    let mut builder = ApiBuilder::from_cache(hub_cache)
        .with_token(token)
        .with_retries(2)
        .with_progress(true);
    let endpoint = std::env::var("HF_ENDPOINT")
        .ok()
        .filter(|e| !e.is_empty())
        .unwrap_or_else(|| "https://huggingface.co".into());
    builder = builder.with_endpoint(endpoint.trim_end_matches('/').to_string());
    let api = builder
        .build()
        .context("starting the Hugging Face Hub client")?;
    let repo = api.repo(Repo::with_revision(
        id.to_string(),
        RepoType::Model,
        revision.to_string(),
    ));
    let where_ = || format!("{id} (revision {revision}) at {endpoint}");
    let info = repo.info().map_err(|e| {
        anyhow::anyhow!(
            "{} is not a local path, and the hub did not list it: {e} (a private or gated \
             model needs HF_TOKEN; HF_HUB_OFFLINE=1 uses only the cache at {})",
            where_(),
            cache.display()
        )
    })?;
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let take = wanted(&files, want);
    if want == Want::Model && !take.iter().any(|f| f == "config.json") {
        let gguf: Vec<&String> = files.iter().filter(|f| f.ends_with(".gguf")).collect();
        if !gguf.is_empty() {
            bail!(
                "{} holds GGUF files ({}) and no config.json: download the one you want and \
                 pass its path",
                where_(),
                gguf.iter()
                    .take(4)
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        bail!("{} has no config.json", where_());
    }
    eprintln!(
        "fetching {} files of {} into {}",
        take.len(),
        where_(),
        cache.display()
    );
    let mut dir = None;
    for f in &take {
        let path = repo
            .get(f)
            .with_context(|| format!("downloading {f} of {}", where_()))?;
        dir = path.parent().map(Path::to_path_buf);
    }
    let dir = dir.with_context(|| format!("{} lists no files to fetch", where_()))?;
    if !complete(&dir, want) {
        bail!(
            "{}: after the download, {} still lacks files (a config, a tokenizer, or weights its \
             index names)",
            where_(),
            dir.display()
        );
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_are_org_slash_name_and_never_local_paths() {
        assert_eq!(
            hub_id(Path::new("Qwen/Qwen3-0.6B")),
            Some("Qwen/Qwen3-0.6B")
        );
        assert_eq!(
            hub_id(Path::new("meta-llama/Llama-3.1-8B_x.y")),
            Some("meta-llama/Llama-3.1-8B_x.y")
        );
        for not in [
            "/abs/x", "./a/b", "a/b/c", "noslash", "a/", "/b", "a/../b", "a b/c",
        ] {
            assert_eq!(hub_id(Path::new(not)), None, "{not}");
        }
        let dir = tempfile::tempdir().unwrap();
        let local = dir.path().join("org").join("name");
        std::fs::create_dir_all(&local).unwrap();
        assert_eq!(hub_id(&local), None);
    }

    #[test]
    fn wanted_files_are_the_top_level_metadata_and_one_weight_format() {
        let files: Vec<String> = [
            "config.json",
            "tokenizer.json",
            "chat_template.jinja",
            "merges.txt",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "pytorch_model.bin",
            "original/consolidated.pth",
            "README.md",
            ".gitattributes",
        ]
        .map(String::from)
        .to_vec();
        let model = wanted(&files, Want::Model);
        assert!(model.contains(&"model-00002-of-00002.safetensors".to_string()));
        assert!(!model.iter().any(|f| f.ends_with(".bin") || f.contains('/')));
        assert!(!model.contains(&"README.md".to_string()));
        let tok = wanted(&files, Want::Tokenizer);
        assert!(tok.iter().all(|f| !f.ends_with(".safetensors")));
        assert!(tok.contains(&"tokenizer.json".to_string()));
        let bin = wanted(
            &["config.json".into(), "pytorch_model.bin".into()],
            Want::Model,
        );
        assert_eq!(
            bin,
            vec!["config.json".to_string(), "pytorch_model.bin".to_string()]
        );
    }

    #[test]
    fn complete_needs_every_indexed_weight_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        std::fs::write(p.join("config.json"), "{}").unwrap();
        std::fs::write(p.join("tokenizer.json"), "{}").unwrap();
        assert!(complete(p, Want::Tokenizer));
        assert!(!complete(p, Want::Model));
        std::fs::write(
            p.join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}"#,
        )
        .unwrap();
        std::fs::write(p.join("m-1.safetensors"), "x").unwrap();
        assert!(!complete(p, Want::Model));
        std::fs::write(p.join("m-2.safetensors"), "x").unwrap();
        assert!(complete(p, Want::Model));
    }
}
