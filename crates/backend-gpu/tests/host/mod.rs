//! Building the GPU kernels' sources for the host with the system's C++
//! compiler (`$CXX`, else `c++`), for tests on machines without a GPU, and
//! running them on the emulator (`kernels/host/simt.h`) over records in a file.
//! [`compiler`] says whether one runs: a test skips, printing why, when none
//! does, unless `ARBOR_REQUIRE_CXX=1` makes that a failure.

#![allow(dead_code)]

use anyhow::{Result, bail};
use std::io::Write;
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

/// An executable built for the emulator, in a folder removed on drop.
pub struct Emulated {
    _dir: tempfile::TempDir,
    pub bin: PathBuf,
}

/// The emulator, the kernel sources `kernels` (their text, in order) and a
/// `main` compiled into the executable `name`; `None` (the reason printed)
/// without a C++ compiler, as [`compiler`] says.
pub fn build_on_emulator(name: &str, kernels: &[&str], main: &str) -> Result<Option<Emulated>> {
    let Some(cxx) = compiler(name)? else {
        return Ok(None);
    };
    let dir = tempfile::tempdir()?;
    let mut source = vec![arbor_backend_gpu::kernels::SIMT_HEADER];
    source.extend_from_slice(kernels);
    source.push(main);
    let bin = build(&cxx, dir.path(), name, &source.join("\n"))?;
    Ok(Some(Emulated { _dir: dir, bin }))
}

/// Whether `a` and `b` hold the same f32 bits.
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Runs `bin` with a file of `records` and the path of its output file;
/// returns the output bytes.
pub fn run_records(bin: &Path, records: &[u8]) -> Result<Vec<u8>> {
    let dir = tempfile::tempdir()?;
    let (inp, outp) = (dir.path().join("in.bin"), dir.path().join("out.bin"));
    std::fs::File::create(&inp)?.write_all(records)?;
    let st = Command::new(bin).arg(&inp).arg(&outp).output()?;
    if !st.status.success() {
        bail!("{}: {}", bin.display(), String::from_utf8_lossy(&st.stderr));
    }
    Ok(std::fs::read(&outp)?)
}

/// Little-endian f32s of `bytes`.
pub fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// A seeded uniform generator in [-1, 1).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}
