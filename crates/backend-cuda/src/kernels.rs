//! The NVRTC kernels: their sources, their table, and their compilation.
//!
//! Every kernel the backend launches is listed once in [`KERNELS`] with its
//! `extern "C"` name and its parameter signature (`p` device pointer, `l` u64,
//! `i` 32-bit integer, `f` f32). Launches are checked against the signature
//! before they are queued ([`crate::exec::Args`]), and the NVRTC test checks
//! the signatures against the `.entry` declarations of the compiled PTX, so the
//! Rust and CUDA sides of every launch agree without a GPU.
//!
//! Kernels are compiled at run time for the device's architecture (a CUBIN for
//! `sm_XY`, falling back to PTX for `compute_XY`), cached per process and on
//! disk (`$ARBOR_CUDA_CACHE`, else `$XDG_CACHE_HOME/arbor/cuda`, else
//! `~/.cache/arbor/cuda`) under a hash of the source, the NVRTC version and the
//! target, so a restart does not recompile.

use crate::nvrtc;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

macro_rules! kernels {
    ($($id:ident = $name:literal : $sig:literal,)*) => {
        /// A kernel of [`KERNELS`], by position.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum K { $($id,)* }
        /// Every kernel: id, `extern "C"` name, parameter signature.
        pub const KERNELS: &[(K, &str, &str)] = &[$((K::$id, $name, $sig),)*];
    };
}

kernels! {
    EmbeddingF32 = "embedding_f32": "pppiii",
    EmbeddingF16 = "embedding_f16": "pppiii",
    EmbeddingBf16 = "embedding_bf16": "pppiii",
    RmsNorm = "rms_norm": "pppiif",
    AddRmsNorm = "add_rms_norm": "ppppiif",
    Rope = "rope": "pppiiiii",
    SiluMul = "silu_mul": "pppl",
    AddAssign = "add_assign": "ppl",
    GatherRows = "gather_rows": "pppiii",
    CastBf16 = "cast_f32_bf16": "ppl",
    CastF16 = "cast_f32_f16": "ppl",
    AddBias = "add_bias": "ppii",
    KvWriteF32 = "kv_write_f32": "pppppiii",
    KvWriteF16 = "kv_write_f16": "pppppiii",
    KvWriteBf16 = "kv_write_bf16": "pppppiii",
    FillF32 = "fill_uniform_f32": "pllff",
    FillF16 = "fill_uniform_f16": "pllff",
    FillBf16 = "fill_uniform_bf16": "pllff",
    DecodeF32D128 = "decode_split_f32_d128": "pppppppiiiiifi",
    DecodeF16D128 = "decode_split_f16_d128": "pppppppiiiiifi",
    DecodeBf16D128 = "decode_split_bf16_d128": "pppppppiiiiifi",
    DecodeF32D256 = "decode_split_f32_d256": "pppppppiiiiifi",
    DecodeF16D256 = "decode_split_f16_d256": "pppppppiiiiifi",
    DecodeBf16D256 = "decode_split_bf16_d256": "pppppppiiiiifi",
    DecodeMerge = "decode_merge": "ppppiii",
    PrefillF32D128 = "prefill_f32_d128": "ppppppiiiifi",
    PrefillF16D128 = "prefill_f16_d128": "ppppppiiiifi",
    PrefillBf16D128 = "prefill_bf16_d128": "ppppppiiiifi",
    PrefillF32D256 = "prefill_f32_d256": "ppppppiiiifi",
    PrefillF16D256 = "prefill_f16_d256": "ppppppiiiifi",
    PrefillBf16D256 = "prefill_bf16_d256": "ppppppiiiifi",
    SampleRows = "sample_rows": "pppii",
    DequantF8S32 = "dequant_f8_s32": "ppl",
    DequantU4S32 = "dequant_u4_s32": "ppl",
    DequantF4S16 = "dequant_f4_s16": "ppl",
}

impl K {
    /// The kernel's `extern "C"` name.
    pub fn name(self) -> &'static str {
        KERNELS[self as usize].1
    }
    /// The kernel's parameter signature.
    pub fn signature(self) -> &'static str {
        KERNELS[self as usize].2
    }
}

/// The CUDA C source of every kernel, as one translation unit.
pub fn source() -> String {
    [
        include_str!("../kernels/common.cuh"),
        include_str!("../kernels/elementwise.cu"),
        include_str!("../kernels/attention.cu"),
        include_str!("../kernels/sampling.cu"),
        include_str!("../kernels/dequant.cu"),
    ]
    .join("\n")
}

/// Compiled kernels: a CUBIN or a PTX text (NUL-terminated), and which.
#[derive(Clone, Debug)]
pub struct Image {
    /// The bytes to load with `cuModuleLoadData`.
    pub bytes: Vec<u8>,
    /// The NVRTC target (`sm_90`, `compute_90`).
    pub target: String,
}

fn fnv1a(data: &[u8], mut h: u64) -> u64 {
    for b in data {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("ARBOR_CUDA_CACHE") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("arbor/cuda"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/arbor/cuda"))
}

/// Compiles every kernel for `target` (`sm_XY` gives a CUBIN, `compute_XY`
/// PTX), from the process cache, the disk cache, or NVRTC.
pub fn compile_cached(target: &str) -> Result<Image, String> {
    static MEM: OnceLock<Mutex<HashMap<String, Image>>> = OnceLock::new();
    let mem = MEM.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(img) = mem.lock().unwrap_or_else(|e| e.into_inner()).get(target) {
        return Ok(img.clone());
    }
    let src = source();
    let (maj, min) = nvrtc::version()?;
    let key = fnv1a(
        format!("{maj}.{min}/{target}/").as_bytes(),
        fnv1a(src.as_bytes(), 0xcbf2_9ce4_8422_2325),
    );
    let file = cache_dir().map(|d| d.join(format!("kernels-{target}-{key:016x}.bin")));
    let cached = file.as_ref().and_then(|f| std::fs::read(f).ok());
    let bytes = match cached {
        Some(b) if looks_valid(&b, target) => b,
        _ => {
            let t0 = std::time::Instant::now();
            let b = nvrtc::compile(&src, target).map_err(|e| e.to_string())?;
            tracing::info!(
                "compiled {} CUDA kernels for {target} in {:.1} s",
                KERNELS.len(),
                t0.elapsed().as_secs_f64()
            );
            if let Some(f) = &file {
                // Write then rename, so a reader never sees a partial file.
                let tmp = f.with_extension(format!("tmp{}", std::process::id()));
                let written = f
                    .parent()
                    .map(std::fs::create_dir_all)
                    .transpose()
                    .and_then(|_| std::fs::write(&tmp, &b))
                    .and_then(|_| std::fs::rename(&tmp, f));
                if let Err(e) = written {
                    tracing::debug!("not caching kernels in {}: {e}", f.display());
                }
            }
            b
        }
    };
    let img = Image {
        bytes,
        target: target.to_string(),
    };
    mem.lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(target.to_string(), img.clone());
    Ok(img)
}

/// A cached image is used only if it is a CUBIN (ELF) or a NUL-terminated PTX text.
fn looks_valid(b: &[u8], target: &str) -> bool {
    if target.starts_with("sm_") {
        b.starts_with(b"\x7fELF")
    } else {
        b.last() == Some(&0) && b.windows(8).any(|w| w == b".version")
    }
}

/// The `.entry` kernels of a PTX text with their parameter types (`u64`, `u32`, `f32`...).
pub fn ptx_entries(ptx: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry ") {
        rest = &rest[at + ".entry ".len()..];
        let name_end = rest.find(['(', ' ', '\n']).unwrap_or(rest.len());
        let name = rest[..name_end].trim().to_string();
        let params_end = rest.find(')').unwrap_or(rest.len());
        let params = rest[..params_end]
            .split(".param")
            .skip(1)
            .filter_map(|p| p.split_whitespace().next())
            .map(|t| t.trim_start_matches('.').to_string())
            .collect();
        out.push((name, params));
        rest = &rest[params_end..];
    }
    out
}

/// Checks that every kernel of [`KERNELS`] is in the PTX with parameters of its signature.
pub fn check_ptx(ptx: &str) -> Result<(), String> {
    let entries: HashMap<String, Vec<String>> = ptx_entries(ptx).into_iter().collect();
    let mut problems = Vec::new();
    for (_, name, sig) in KERNELS {
        let Some(params) = entries.get(*name) else {
            problems.push(format!("{name}: missing from the PTX"));
            continue;
        };
        let want: Vec<&str> = sig
            .chars()
            .map(|c| match c {
                'p' | 'l' => "64",
                'i' => "32",
                _ => "f32",
            })
            .collect();
        let got: Vec<&str> = params
            .iter()
            .map(|t| match t.as_str() {
                "u64" | "s64" | "b64" => "64",
                "u32" | "s32" | "b32" => "32",
                "f32" => "f32",
                _ => "?",
            })
            .collect();
        if want != got {
            problems.push(format!(
                "{name}: PTX parameters {params:?} do not match the signature {sig}"
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_consistent() {
        for (i, (k, name, sig)) in KERNELS.iter().enumerate() {
            assert_eq!(*k as usize, i);
            assert!(sig.chars().all(|c| "plif".contains(c)), "{name}");
            assert!(
                source().contains(&format!("{name}(")) || source().contains(&format!("({name},")),
                "{name} is not in the source"
            );
        }
    }

    #[test]
    fn parses_ptx_entries() {
        let ptx = ".visible .entry rms_norm(\n\t.param .u64 rms_norm_param_0,\n\t.param .u32 a,\n\t.param .f32 b\n)\n{ ret; }\n.visible .entry x(\n)\n";
        let e = ptx_entries(ptx);
        assert_eq!(e[0].0, "rms_norm");
        assert_eq!(e[0].1, vec!["u64", "u32", "f32"]);
        assert_eq!(e[1].0, "x");
        assert!(e[1].1.is_empty());
    }
}
