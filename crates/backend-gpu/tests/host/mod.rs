//! Building the GPU kernels' sources for the host with the system's C++
//! compiler (`$CXX`, else `c++`), for tests on machines without a GPU.
//! [`compiler`] says whether one runs: a test skips, printing why, when none
//! does, unless `ARBOR_REQUIRE_CXX=1` makes that a failure.

#![allow(dead_code)]

use anyhow::{Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The C++ compiler, or `None` (the reason printed) when none runs.
pub fn compiler(what: &str) -> Result<Option<String>> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    if Command::new(&cxx).arg("--version").output().is_ok() {
        return Ok(Some(cxx));
    }
    if std::env::var("ARBOR_REQUIRE_CXX").is_ok_and(|v| v == "1") {
        bail!("ARBOR_REQUIRE_CXX=1 but the C++ compiler '{cxx}' does not run");
    }
    println!("skipped: no C++ compiler ('{cxx}') to build {what} for the host");
    Ok(None)
}

/// Compiles `source` (C++17, -O2) into the executable `dir/name`.
pub fn build(cxx: &str, dir: &Path, name: &str, source: &str) -> Result<PathBuf> {
    let src = dir.join(format!("{name}.cpp"));
    let bin = dir.join(name);
    std::fs::write(&src, source)?;
    let out = Command::new(cxx)
        .args(["-O2", "-std=c++17", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()?;
    if !out.status.success() {
        bail!("{cxx} {name}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(bin)
}
