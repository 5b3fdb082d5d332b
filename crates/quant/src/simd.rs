//! SIMD level detection.
//!
//! The only global state in the crate: the detected level, computed once with
//! `is_x86_feature_detected!` and cached in an atomic. Every kernel entry point
//! checks that the level it runs at is at most the detected one, so a forced
//! level can only lower, never raise, what the CPU is asked to execute.

use std::sync::atomic::{AtomicU8, Ordering};

/// Instruction-set level a kernel runs at. Ordered: a higher level implies
/// every feature of the lower ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable Rust, any target.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (256-bit float, `vpmaddubsw` integer dots).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL/DQ + VNNI (512-bit float, `vpdpbusd` integer dots),
    /// on top of everything in [`SimdLevel::Avx2`].
    Avx512,
    /// [`SimdLevel::Avx512`] plus AVX-512 BF16 and AMX (tiles and bf16,
    /// with the OS permission for the tile state): bf16 weights meet
    /// bf16-rounded activations in AMX tiles (`tdpbf16ps`; `vdpbf16ps`
    /// where `k` is not a multiple of 32). That is ggml's pairing for bf16
    /// weights; the lower levels keep f32 activations for them.
    Amx,
}

impl SimdLevel {
    /// All levels, lowest first.
    pub const ALL: [SimdLevel; 4] = [
        SimdLevel::Scalar,
        SimdLevel::Avx2,
        SimdLevel::Avx512,
        SimdLevel::Amx,
    ];

    /// Levels usable on this CPU, lowest first.
    pub fn available() -> Vec<SimdLevel> {
        let top = detected_level();
        Self::ALL.iter().copied().filter(|l| *l <= top).collect()
    }

    /// Short lowercase name ("scalar", "avx2", "avx512", "amx").
    pub const fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Amx => "amx",
        }
    }
}

const UNKNOWN: u8 = u8::MAX;
static DETECTED: AtomicU8 = AtomicU8::new(UNKNOWN);

fn encode(l: SimdLevel) -> u8 {
    match l {
        SimdLevel::Scalar => 0,
        SimdLevel::Avx2 => 1,
        SimdLevel::Avx512 => 2,
        SimdLevel::Amx => 3,
    }
}

fn decode(v: u8) -> SimdLevel {
    match v {
        3 => SimdLevel::Amx,
        2 => SimdLevel::Avx512,
        1 => SimdLevel::Avx2,
        _ => SimdLevel::Scalar,
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> SimdLevel {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let avx512 = avx2
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512dq")
        && is_x86_feature_detected!("avx512vnni");
    if avx512 && is_x86_feature_detected!("avx512bf16") && amx_bf16() {
        SimdLevel::Amx
    } else if avx512 {
        SimdLevel::Avx512
    } else if avx2 {
        SimdLevel::Avx2
    } else {
        SimdLevel::Scalar
    }
}

/// AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22), and the OS
/// grants the tile state to this process.
#[cfg(target_arch = "x86_64")]
fn amx_bf16() -> bool {
    // CPUID leaf 7 exists on every CPU with AVX-512 (checked first).
    let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
    let cpu = edx & (1 << 24) != 0 && edx & (1 << 22) != 0;
    cpu && crate::x86::amx::request_tile_permission()
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> SimdLevel {
    SimdLevel::Scalar
}

/// The best level this CPU supports (cached after the first call).
///
/// The environment variable `ARBOR_QUANT_SIMD` (`scalar`, `avx2`, `avx512`,
/// `amx`) lowers it, which is useful to compare paths end to end.
pub fn detected_level() -> SimdLevel {
    let v = DETECTED.load(Ordering::Relaxed);
    if v != UNKNOWN {
        return decode(v);
    }
    let mut l = detect();
    if let Ok(s) = std::env::var("ARBOR_QUANT_SIMD") {
        let want = match s.to_ascii_lowercase().as_str() {
            "scalar" => Some(SimdLevel::Scalar),
            "avx2" => Some(SimdLevel::Avx2),
            "avx512" => Some(SimdLevel::Avx512),
            "amx" => Some(SimdLevel::Amx),
            _ => None,
        };
        if let Some(w) = want {
            l = l.min(w);
        }
    }
    DETECTED.store(encode(l), Ordering::Relaxed);
    l
}
