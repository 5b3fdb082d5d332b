//! Every kernel compiles with hiprtc for CDNA2 (gfx90a: MI200, 64-wide
//! wavefronts) and RDNA2 (gfx1030: 32-wide), from the same source NVRTC
//! compiles, and each code object's metadata lists every kernel of
//! `KERNELS` with parameters of its launch signature. Each target compiles
//! in a process of its own (hiprtc serialises compilations within one). No
//! GPU is needed.
//! Without hiprtc the test skips with the reason, unless
//! `ARBOR_REQUIRE_HIPRTC=1`, when it fails. `ARBOR_HIPRTC_ARCHES` (comma
//! separated) replaces the two targets: Debian's hiprtc 5.2 knows gfx900,
//! gfx906, gfx908, gfx90a and gfx1030, and aborts on newer ones.
#![allow(clippy::unwrap_used)]

use arbor_backend_rocm::{codeobj, hiprtc, kernels};
use std::collections::HashMap;

fn required() -> bool {
    std::env::var("ARBOR_REQUIRE_HIPRTC").is_ok_and(|v| v == "1")
}

#[test]
fn kernels_compile_for_gfx90a_and_gfx1030() {
    if let Err(why) = hiprtc::available() {
        assert!(!required(), "ARBOR_REQUIRE_HIPRTC=1 but {why}");
        println!("skipped: {why}");
        return;
    }
    println!("hiprtc from {}", hiprtc::library().unwrap());
    let arches = std::env::var("ARBOR_HIPRTC_ARCHES").unwrap_or_else(|_| "gfx90a,gfx1030".into());
    // hiprtc serialises compilations inside a process (comgr's lock), so
    // each target compiles in a process of its own: this test binary again,
    // running only `one_target_compiles`.
    let exe = std::env::current_exe().unwrap();
    let t0 = std::time::Instant::now();
    let children: Vec<_> = arches
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(|arch| {
            let child = std::process::Command::new(&exe)
                .args(["one_target_compiles", "--exact", "--ignored", "--nocapture"])
                .env(ONE_TARGET, arch)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            (arch.to_string(), child)
        })
        .collect();
    for (arch, child) in children {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        println!("{stdout}");
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{arch}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    println!("compiled in {:.1} s", t0.elapsed().as_secs_f64());
}

/// Names the one target `one_target_compiles` compiles.
const ONE_TARGET: &str = "ARBOR_HIPRTC_ONE_TARGET";

/// One target's compile and checks, run in a process of its own by
/// `kernels_compile_for_gfx90a_and_gfx1030` (ignored when run otherwise).
#[test]
#[ignore = "run by kernels_compile_for_gfx90a_and_gfx1030, one process per target"]
fn one_target_compiles() {
    let arch = std::env::var(ONE_TARGET).expect("ARBOR_HIPRTC_ONE_TARGET names the target");
    let arch = arch.as_str();
    let src = kernels::source();
    let t0 = std::time::Instant::now();
    let (code, log) = hiprtc::compile_with_log(&src, arch, &[]).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        code.starts_with(b"\x7fELF"),
        "{arch}: not an ELF code object"
    );
    if !log.trim().is_empty() {
        println!("{arch} log:\n{log}");
    }
    let meta = codeobj::metadata(&code).unwrap_or_else(|e| panic!("{arch}: {e}"));
    let target = meta
        .get("amdhsa.target")
        .and_then(|t| t.as_str())
        .unwrap_or("?");
    assert!(target.contains(arch), "{arch}: code object for {target}");
    let infos = codeobj::kernels(&meta).unwrap();
    let params: HashMap<String, Vec<kernels::Param>> = infos
        .iter()
        .map(|(n, i)| (n.clone(), i.params.clone()))
        .collect();
    kernels::check_signatures(&params).unwrap_or_else(|e| panic!("{arch}: {e}"));
    let wave = if arch.starts_with("gfx10") || arch.starts_with("gfx11") {
        32
    } else {
        64
    };
    for (_, name, _) in kernels::KERNELS {
        let i = &infos[*name];
        assert_eq!(i.wavefront_size, wave, "{arch} {name}");
        assert!(
            i.group_segment <= 64 * 1024,
            "{arch} {name}: {} B of static LDS",
            i.group_segment
        );
        if i.sgpr_spills + i.vgpr_spills > 0 {
            println!(
                "{arch} {name}: {} SGPR / {} VGPR spills",
                i.sgpr_spills, i.vgpr_spills
            );
        }
    }
    println!(
        "{arch}: {} kernels, code object {} KiB, wave{wave}, {:.1} s",
        kernels::KERNELS.len(),
        code.len() / 1024,
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn a_broken_source_reports_the_compiler_log() {
    if let Err(why) = hiprtc::available() {
        assert!(!required(), "ARBOR_REQUIRE_HIPRTC=1 but {why}");
        println!("skipped: {why}");
        return;
    }
    let e = hiprtc::compile_with_log(
        "extern \"C\" __global__ void k() { undefined_fn(); }",
        "gfx90a",
        &[],
    )
    .unwrap_err();
    assert!(e.contains("undefined_fn"), "{e}");
}

#[test]
fn opening_without_a_device_is_an_error_not_a_panic() {
    match arbor_backend_rocm::open(&Default::default()) {
        Ok(b) => println!(
            "a ROCm device is present: {}",
            arbor_engine_core::Backend::info(&b).name
        ),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                !std::env::var("ARBOR_REQUIRE_ROCM").is_ok_and(|v| v == "1"),
                "ARBOR_REQUIRE_ROCM=1 but {msg}"
            );
            assert!(msg.contains("no ROCm device"), "{msg}");
            println!("{msg}");
        }
    }
}
