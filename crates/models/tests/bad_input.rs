//! Broken model folders give clear errors that name the file and the key or
//! tensor — never a panic: missing or malformed config.json, an unsupported
//! architecture, a missing tensor, a tensor of the wrong shape or dtype, a
//! truncated safetensors file, and a tokenizer that does not load.

#![allow(clippy::unwrap_used)]

use anyhow::Result;
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::{Backend, LoadOptions, Registry};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-qwen2")
}

/// A copy of the tiny Qwen2 folder to break.
fn copy() -> Result<tempfile::TempDir> {
    let d = tempfile::tempdir()?;
    for e in std::fs::read_dir(fixture())? {
        let e = e?;
        std::fs::copy(e.path(), d.path().join(e.file_name()))?;
    }
    Ok(d)
}

fn load(dir: &Path) -> String {
    let registry = Registry::builtin().unwrap();
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(1).unwrap());
    let opts = LoadOptions {
        backend,
        quant: registry.quant_methods.get("auto").unwrap()(&Default::default()).unwrap(),
        progress: None,
    };
    match arbor_models::load_model(dir, &registry, &opts) {
        Ok(_) => "loaded".into(),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) -> Result<()> {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p)?)?;
    f(&mut v);
    std::fs::write(p, serde_json::to_string(&v)?)?;
    Ok(())
}

/// Rewrites model.safetensors with `f` applied to its tensors.
fn edit_tensors(
    dir: &Path,
    f: impl FnOnce(&mut BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) -> Result<()> {
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p)?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let mut m = BTreeMap::new();
    for (name, t) in st.tensors() {
        m.insert(name, (t.dtype(), t.shape().to_vec(), t.data().to_vec()));
    }
    f(&mut m);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = m
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &p)?;
    Ok(())
}

#[test]
fn the_fixture_loads() -> Result<()> {
    let d = copy()?;
    assert_eq!(load(d.path()), "loaded");
    Ok(())
}

#[test]
fn config_errors_name_file_and_key() -> Result<()> {
    let d = copy()?;
    std::fs::remove_file(d.path().join("config.json"))?;
    let e = load(d.path());
    assert!(
        e.contains("config.json") && e.contains("No such file"),
        "{e}"
    );

    let d = copy()?;
    std::fs::write(d.path().join("config.json"), "{ not json")?;
    let e = load(d.path());
    assert!(
        e.contains("config.json") && e.contains("invalid JSON"),
        "{e}"
    );

    let d = copy()?;
    edit_config(d.path(), |v| {
        v["architectures"] = serde_json::json!(["GPTBigCodeForCausalLM"])
    })?;
    let e = load(d.path());
    assert!(
        e.contains("GPTBigCodeForCausalLM")
            && e.contains("not supported")
            && e.contains("Qwen2ForCausalLM"),
        "{e}"
    );

    let d = copy()?;
    edit_config(d.path(), |v| {
        v["num_attention_heads"] = serde_json::json!("four")
    })?;
    let e = load(d.path());
    assert!(
        e.contains("config.json") && e.contains("num_attention_heads"),
        "{e}"
    );

    let d = copy()?;
    edit_config(d.path(), |v| {
        v.as_object_mut().unwrap().remove("hidden_size");
    })?;
    let e = load(d.path());
    assert!(e.contains("hidden_size") && e.contains("missing"), "{e}");
    Ok(())
}

#[test]
fn tensor_errors_name_the_tensor() -> Result<()> {
    let name = "model.layers.1.mlp.up_proj.weight";
    let d = copy()?;
    edit_tensors(d.path(), |m| {
        m.remove(name);
    })?;
    let e = load(d.path());
    assert!(e.contains(name) && e.contains("missing"), "{e}");

    let d = copy()?;
    edit_tensors(d.path(), |m| {
        let t = m.get_mut(name).unwrap();
        t.1 = vec![t.1[1], t.1[0]];
    })?;
    let e = load(d.path());
    assert!(e.contains(name) && e.contains("shape"), "{e}");

    let d = copy()?;
    edit_tensors(d.path(), |m| {
        let t = m.get_mut(name).unwrap();
        t.0 = safetensors::Dtype::I32;
    })?;
    let e = load(d.path());
    assert!(e.contains(name) && e.contains("has dtype i32"), "{e}");

    let d = copy()?;
    let p = d.path().join("model.safetensors");
    let bytes = std::fs::read(&p)?;
    std::fs::write(&p, &bytes[..bytes.len() / 2])?;
    let e = load(d.path());
    assert!(e.contains("model.safetensors"), "{e}");
    Ok(())
}

#[test]
fn a_broken_tokenizer_is_named() -> Result<()> {
    let d = copy()?;
    std::fs::write(d.path().join("tokenizer.json"), "{\"model\": 3}")?;
    let e = load(d.path());
    assert!(e.contains("tokenizer.json"), "{e}");
    let d = copy()?;
    std::fs::remove_file(d.path().join("tokenizer.json"))?;
    let e = load(d.path());
    assert!(e.contains("tokenizer.json") && e.contains("missing"), "{e}");
    let d = copy()?;
    std::fs::write(
        d.path().join("tokenizer_config.json"),
        "{\"chat_template\": \"{% for %}\"}",
    )?;
    let e = load(d.path());
    assert!(e.contains("chat template"), "{e}");
    Ok(())
}
