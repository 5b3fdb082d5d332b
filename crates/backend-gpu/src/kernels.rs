//! The GPU kernels: their one source, their table, and the cache of their
//! compiled images.
//!
//! Every kernel the backend launches is listed once in [`KERNELS`] with its
//! `extern "C"` name and its parameter signature (`p` device pointer, `l` u64,
//! `i` 32-bit integer, `f` f32). Launches are checked against the signature
//! before they are queued ([`crate::exec::Args`]), and the NVRTC and hiprtc
//! tests check the signatures against the compiled kernels' own parameter
//! lists ([`check_signatures`]), so the Rust and GPU sides of every launch
//! agree without a GPU.
//!
//! The source (`kernels/*.cu`) is CUDA C that NVRTC and hiprtc both compile;
//! `kernels/common.cuh` holds the few differences. Kernels are compiled at run
//! time for the device's architecture by the runtime's [`KernelCompiler`],
//! cached per process and on disk (`$ARBOR_<RUNTIME>_CACHE`, else
//! `$XDG_CACHE_HOME/arbor/<runtime>`, else `~/.cache/arbor/<runtime>`) under a
//! hash of the source, the compiler's version and the target, so a restart
//! does not recompile. Cache files are written whole and renamed into place.

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
    SigmoidMul = "sigmoid_mul": "pppl",
    GatedDeltaNet = "gated_delta_net": "pppppppppppiiiiii",
    AddAssign = "add_assign": "ppl",
    GatherRows = "gather_rows": "pppiii",
    CopyCols = "copy_cols": "ppiiii",
    CastBf16 = "cast_f32_bf16": "ppl",
    CastF16 = "cast_f32_f16": "ppl",
    AddBias = "add_bias": "ppii",
    KvWriteF32 = "kv_write_f32": "pppppiiiff",
    KvWriteF16 = "kv_write_f16": "pppppiiiff",
    KvWriteBf16 = "kv_write_bf16": "pppppiiiff",
    KvWriteE4m3 = "kv_write_e4m3": "pppppiiiff",
    KvWriteE5m2 = "kv_write_e5m2": "pppppiiiff",
    FillF32 = "fill_uniform_f32": "pllff",
    FillF16 = "fill_uniform_f16": "pllff",
    FillBf16 = "fill_uniform_bf16": "pllff",
    DecodeF32D128 = "decode_split_f32_d128": "pppppppiiiiififf",
    DecodeF16D128 = "decode_split_f16_d128": "pppppppiiiiififf",
    DecodeBf16D128 = "decode_split_bf16_d128": "pppppppiiiiififf",
    DecodeF32D256 = "decode_split_f32_d256": "pppppppiiiiififf",
    DecodeF16D256 = "decode_split_f16_d256": "pppppppiiiiififf",
    DecodeBf16D256 = "decode_split_bf16_d256": "pppppppiiiiififf",
    DecodeE4m3D128 = "decode_split_e4m3_d128": "pppppppiiiiififf",
    DecodeE5m2D128 = "decode_split_e5m2_d128": "pppppppiiiiififf",
    DecodeE4m3D256 = "decode_split_e4m3_d256": "pppppppiiiiififf",
    DecodeE5m2D256 = "decode_split_e5m2_d256": "pppppppiiiiififf",
    DecodeF32D576 = "decode_split_f32_d576": "pppppppiiiiififf",
    DecodeF16D576 = "decode_split_f16_d576": "pppppppiiiiififf",
    DecodeBf16D576 = "decode_split_bf16_d576": "pppppppiiiiififf",
    DecodeE4m3D576 = "decode_split_e4m3_d576": "pppppppiiiiififf",
    DecodeE5m2D576 = "decode_split_e5m2_d576": "pppppppiiiiififf",
    DecodeMerge = "decode_merge": "ppppiii",
    PrefillF32D128 = "prefill_f32_d128": "pppppppiiiififf",
    PrefillF16D128 = "prefill_f16_d128": "pppppppiiiififf",
    PrefillBf16D128 = "prefill_bf16_d128": "pppppppiiiififf",
    PrefillF32D256 = "prefill_f32_d256": "pppppppiiiififf",
    PrefillF16D256 = "prefill_f16_d256": "pppppppiiiififf",
    PrefillBf16D256 = "prefill_bf16_d256": "pppppppiiiififf",
    PrefillF32D256Small = "prefill_f32_d256_small": "pppppppiiiififf",
    PrefillF16D256Small = "prefill_f16_d256_small": "pppppppiiiififf",
    PrefillBf16D256Small = "prefill_bf16_d256_small": "pppppppiiiififf",
    PrefillE4m3D128 = "prefill_e4m3_d128": "pppppppiiiififf",
    PrefillE5m2D128 = "prefill_e5m2_d128": "pppppppiiiififf",
    PrefillE4m3D256 = "prefill_e4m3_d256": "pppppppiiiififf",
    PrefillE5m2D256 = "prefill_e5m2_d256": "pppppppiiiififf",
    PrefillE4m3D256Small = "prefill_e4m3_d256_small": "pppppppiiiififf",
    PrefillE5m2D256Small = "prefill_e5m2_d256_small": "pppppppiiiififf",
    PrefillF32D576 = "prefill_f32_d576": "pppppppiiiififf",
    PrefillF16D576 = "prefill_f16_d576": "pppppppiiiififf",
    PrefillBf16D576 = "prefill_bf16_d576": "pppppppiiiififf",
    PrefillE4m3D576 = "prefill_e4m3_d576": "pppppppiiiififf",
    PrefillE5m2D576 = "prefill_e5m2_d576": "pppppppiiiififf",
    PrefillMmaBf16D64 = "prefill_mma_bf16_d64": "pppppppiiiififf",
    PrefillMmaBf16D128 = "prefill_mma_bf16_d128": "pppppppiiiififf",
    SampleRows = "sample_rows": "pppii",
    EditTokens = "edit_tokens": "ppii",
    MaskRows = "mask_rows": "pppiii",
    LogprobStats = "logprob_stats": "ppppiii",
    DequantF8S32 = "dequant_f8_s32": "ppl",
    DequantU4S32 = "dequant_u4_s32": "ppl",
    DequantU8S32 = "dequant_u8_s32": "ppl",
    DequantF4S16 = "dequant_f4_s16": "ppl",
    GemmF8S32M16 = "gemm_f8_s32_m16": "pppiii",
    GemmF8S32M64 = "gemm_f8_s32_m64": "pppiii",
    GemmU4S32M16 = "gemm_u4_s32_m16": "pppiii",
    GemmU4S32M64 = "gemm_u4_s32_m64": "pppiii",
    GemmU8S32M16 = "gemm_u8_s32_m16": "pppiii",
    GemmU8S32M64 = "gemm_u8_s32_m64": "pppiii",
    GemmF4S16M16 = "gemm_f4_s16_m16": "pppiii",
    GemmF4S16M64 = "gemm_f4_s16_m64": "pppiii",
    QuantActE4m3 = "quant_act_e4m3": "pppiiff",
    RoundActE4m3 = "round_act_e4m3": "ppiiff",
    GemmF8S32W8a8M16 = "gemm_f8_s32_w8a8_m16": "ppppiii",
    GemmF8S32W8a8M64 = "gemm_f8_s32_w8a8_m64": "ppppiii",
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

/// The NVIDIA architecture of a kernel target (`sm_90` or `compute_90` gives
/// 90); `None` for other vendors' targets (`gfx90a`).
pub fn nvidia_sm(target: &str) -> Option<u32> {
    target
        .strip_prefix("sm_")
        .or_else(|| target.strip_prefix("compute_"))?
        .parse()
        .ok()
}

/// The host emulator of the CUDA execution model (C++17, for the system's
/// compiler): put before [`source`], it runs the kernels on the CPU
/// (`arbor-backend-simt`, and the kernel tests of this crate).
pub const SIMT_HEADER: &str = include_str!("../kernels/host/simt.h");

/// The CUDA C source of every kernel, as one translation unit.
pub fn source() -> String {
    [
        include_str!("../kernels/common.cuh"),
        include_str!("../kernels/fp8.cuh"),
        include_str!("../kernels/mma.cuh"),
        include_str!("../kernels/elementwise.cu"),
        include_str!("../kernels/recurrent.cu"),
        include_str!("../kernels/attention.cu"),
        include_str!("../kernels/sampling.cu"),
        include_str!("../kernels/dequant.cu"),
        include_str!("../kernels/gemm.cu"),
    ]
    .join("\n")
}

/// A runtime's compiler of the kernel source (NVRTC, hiprtc).
pub trait KernelCompiler {
    /// The runtime's short name: the cache's subfolder (`cuda`, `rocm`).
    fn runtime(&self) -> &'static str;
    /// The environment variable naming the cache folder (`ARBOR_CUDA_CACHE`).
    fn cache_env(&self) -> &'static str;
    /// The compiler's version, part of the cache key.
    fn version(&self) -> Result<String, String>;
    /// Compiles `src` for `target`.
    fn compile(&self, src: &str, target: &str) -> Result<Vec<u8>, String>;
    /// Whether a cached image for `target` is of the kind `compile` makes.
    fn looks_valid(&self, image: &[u8], target: &str) -> bool;
}

/// Compiled kernels and their target.
#[derive(Clone, Debug)]
pub struct Image {
    /// The bytes to load as a module (CUBIN, PTX text, AMD code object).
    pub bytes: Vec<u8>,
    /// The target (`sm_90`, `compute_90`, `gfx90a`).
    pub target: String,
}

fn fnv1a(data: &[u8], mut h: u64) -> u64 {
    for b in data {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn cache_dir(c: &dyn KernelCompiler) -> Option<PathBuf> {
    if let Some(d) = std::env::var_os(c.cache_env()) {
        return Some(PathBuf::from(d));
    }
    let sub = format!("arbor/{}", c.runtime());
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join(sub));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join(sub))
}

/// Every kernel compiled for `target`, from the process cache, the disk
/// cache, or the compiler.
pub fn compile_cached(c: &dyn KernelCompiler, target: &str) -> Result<Image, String> {
    static MEM: OnceLock<Mutex<HashMap<String, Image>>> = OnceLock::new();
    let mem = MEM.get_or_init(|| Mutex::new(HashMap::new()));
    let mem_key = format!("{}/{target}", c.runtime());
    if let Some(img) = mem.lock().unwrap_or_else(|e| e.into_inner()).get(&mem_key) {
        return Ok(img.clone());
    }
    let src = source();
    let version = c.version()?;
    let key = fnv1a(
        format!("{version}/{target}/").as_bytes(),
        fnv1a(src.as_bytes(), 0xcbf2_9ce4_8422_2325),
    );
    let file = cache_dir(c).map(|d| d.join(format!("kernels-{target}-{key:016x}.bin")));
    let cached = file.as_ref().and_then(|f| std::fs::read(f).ok());
    let bytes = match cached {
        Some(b) if c.looks_valid(&b, target) => b,
        _ => {
            let t0 = std::time::Instant::now();
            let b = c.compile(&src, target)?;
            tracing::info!(
                "compiled {} {} kernels for {target} in {:.1} s",
                KERNELS.len(),
                c.runtime(),
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
        .insert(mem_key, img.clone());
    Ok(img)
}

/// A parameter of a compiled kernel as its image describes it: what each
/// runtime's metadata can tell apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// A global pointer (AMD metadata: `global_buffer`).
    Pointer,
    /// 8 bytes of unknown kind (PTX `.u64`: a pointer or a u64).
    Bits64,
    /// An 8-byte value (AMD `by_value`, size 8).
    Value64,
    /// A 4-byte value of unknown kind (AMD `by_value`, size 4; PTX `.u32`).
    Bits32,
    /// A 4-byte float (PTX `.f32`).
    F32,
    /// Anything else.
    Other,
}

fn accepts(sig: char, p: Param) -> bool {
    matches!(
        (sig, p),
        ('p', Param::Pointer | Param::Bits64)
            | ('l', Param::Value64 | Param::Bits64)
            | ('i', Param::Bits32)
            | ('f', Param::Bits32 | Param::F32)
    )
}

/// Checks that every kernel of [`KERNELS`] is among the compiled `entries`
/// with parameters its signature accepts.
pub fn check_signatures(entries: &HashMap<String, Vec<Param>>) -> Result<(), String> {
    let mut problems = Vec::new();
    for (_, name, sig) in KERNELS {
        let Some(params) = entries.get(*name) else {
            problems.push(format!("{name}: missing from the compiled kernels"));
            continue;
        };
        let fits =
            params.len() == sig.len() && sig.chars().zip(params).all(|(c, p)| accepts(c, *p));
        if !fits {
            problems.push(format!(
                "{name}: compiled parameters {params:?} do not match the signature {sig}"
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
    fn signatures_are_checked_per_parameter() {
        let ok: HashMap<String, Vec<Param>> = KERNELS
            .iter()
            .map(|(_, name, sig)| {
                let params = sig
                    .chars()
                    .map(|c| match c {
                        'p' => Param::Pointer,
                        'l' => Param::Bits64,
                        'i' => Param::Bits32,
                        _ => Param::F32,
                    })
                    .collect();
                (name.to_string(), params)
            })
            .collect();
        check_signatures(&ok).unwrap();
        let mut bad = ok.clone();
        bad.get_mut("rms_norm").unwrap().pop();
        bad.remove("rope");
        let e = check_signatures(&bad).unwrap_err();
        assert!(e.contains("rms_norm: compiled parameters"), "{e}");
        assert!(e.contains("rope: missing"), "{e}");
        let mut swapped = ok;
        swapped.get_mut("add_assign").unwrap()[0] = Param::Bits32;
        assert!(check_signatures(&swapped).is_err());
    }
}
