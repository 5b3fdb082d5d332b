//! Every kernel compiles with NVRTC for sm_80 (A100) and sm_90 (H100/H200),
//! both to PTX (checked against the launch signatures of `KERNELS`) and to a
//! CUBIN (which also runs ptxas: register and shared-memory limits; the FP8
//! `mma.m16n8k32` only in sm_90's, older targets trap there), the four
//! compilations on threads of their own. No GPU is
//! needed. Without NVRTC the test skips with the reason, unless
//! `ARBOR_REQUIRE_NVRTC=1`, when it fails.
#![allow(clippy::unwrap_used)]

use arbor_backend_cuda::{kernels, nvrtc};

#[test]
fn kernels_compile_for_sm80_and_sm90() {
    if let Err(why) = nvrtc::available() {
        if std::env::var("ARBOR_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
            panic!("ARBOR_REQUIRE_NVRTC=1 but {why}");
        }
        println!("skipped: {why}");
        return;
    }
    let (maj, min) = nvrtc::version().unwrap();
    println!("NVRTC {maj}.{min}");
    let src = kernels::source();
    // NVRTC compiles concurrently from several threads: each target on its
    // own, so the test takes the time of the slowest, not of the sum.
    let t0 = std::time::Instant::now();
    std::thread::scope(|scope| {
        let jobs: Vec<_> = ["80", "90"]
            .into_iter()
            .map(|arch| {
                let src = &src;
                let ptx = scope.spawn(move || {
                    let ptx = nvrtc::compile(src, &format!("compute_{arch}"))
                        .unwrap_or_else(|e| panic!("{e}"));
                    nvrtc::ptx_text(&ptx)
                });
                let cubin = scope.spawn(move || {
                    nvrtc::compile_with_log(src, &format!("sm_{arch}"), &["--ptxas-options=-v"])
                        .unwrap_or_else(|e| panic!("{e}"))
                });
                (arch, ptx, cubin)
            })
            .collect();
        for (arch, ptx, cubin) in jobs {
            let text = ptx.join().unwrap();
            nvrtc::check_ptx(&text).unwrap_or_else(|e| panic!("compute_{arch}: {e}"));
            // The W8A8 GEMM's FP8 tensor-core instruction exists from sm_89.
            let fp8_mma = text.contains("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32");
            assert_eq!(
                fp8_mma,
                arch == "90",
                "compute_{arch}: FP8 mma present: {fp8_mma}"
            );
            let (cubin, log) = cubin.join().unwrap();
            // ptxas reports registers, spills and shared memory per kernel.
            for line in log
                .lines()
                .filter(|l| l.contains("spill") && !l.contains(" 0 bytes spill"))
            {
                println!("sm_{arch} ptxas: {line}");
            }
            if std::env::var("ARBOR_NVRTC_VERBOSE").is_ok() {
                println!("{log}");
            }
            assert!(cubin.starts_with(b"\x7fELF"), "sm_{arch}: not an ELF CUBIN");
            println!(
                "sm_{arch}: {} kernels, PTX {} KiB, CUBIN {} KiB",
                kernels::KERNELS.len(),
                text.len() / 1024,
                cubin.len() / 1024,
            );
        }
    });
    println!("compiled in {:.1} s", t0.elapsed().as_secs_f64());
}
