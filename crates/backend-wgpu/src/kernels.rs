//! WGSL sources and their specialization.
//!
//! Each kernel lives in its own `.wgsl` file under `shaders/`, written with
//! `{{NAME}}` placeholders for compile-time choices (weight format, tile
//! sizes, cache type, optional bindings). [`specialize`] prepends the shared
//! helpers of `common.wgsl` and substitutes the placeholders; the result is
//! compiled once per distinct key and cached by [`crate::context::Gpu`].
//!
//! [`Kernel`] names every variant the backend compiles; its
//! [`Kernel::source`] is the only place sources are specialized, so tests can
//! validate every variant without a device.
//!
//! Invariant: every placeholder of a source is substituted (checked by
//! [`specialize`]), and a kernel declares exactly the bindings its callers
//! pass (pipelines use automatic layouts, which omit unused bindings).

use crate::matmul_gen;
use arbor_engine_core::{CoreError, DType, Result};

pub const COMMON: &str = include_str!("shaders/common.wgsl");
pub const EMBEDDING: &str = include_str!("shaders/embedding.wgsl");
pub const RMS_NORM: &str = include_str!("shaders/rms_norm.wgsl");
pub const ROPE: &str = include_str!("shaders/rope.wgsl");
pub const SILU_MUL: &str = include_str!("shaders/silu_mul.wgsl");
pub const ADD: &str = include_str!("shaders/add.wgsl");
pub const GATHER: &str = include_str!("shaders/gather.wgsl");
pub const QUANT_ACT: &str = include_str!("shaders/quant_act.wgsl");
pub const ROUND_ACT_E4M3: &str = include_str!("shaders/round_act_e4m3.wgsl");
pub const MATMUL_Q: &str = include_str!("shaders/matmul_q.wgsl");
pub const MATMUL_F: &str = include_str!("shaders/matmul_f.wgsl");
pub const KV_WRITE: &str = include_str!("shaders/kv_write.wgsl");
pub const ATTENTION: &str = include_str!("shaders/attention.wgsl");
pub const SAMPLE: &str = include_str!("shaders/sample.wgsl");
pub const EDIT_TOKENS: &str = include_str!("shaders/edit_tokens.wgsl");
pub const MASK_ROWS: &str = include_str!("shaders/mask_rows.wgsl");
pub const LOGPROB_STATS: &str = include_str!("shaders/logprob_stats.wgsl");
pub const GATED_DELTA_NET: &str = include_str!("shaders/gated_delta_net.wgsl");
pub const SIGMOID_MUL: &str = include_str!("shaders/sigmoid_mul.wgsl");

/// Invocations per workgroup of the 1-D kernels (`WG` in common.wgsl).
pub const WG: u32 = 64;

/// `common.wgsl` + `body` with `{{KEY}}` replaced by each value.
pub fn specialize(body: &str, subs: &[(&str, String)]) -> String {
    let mut s = format!("{COMMON}\n{body}");
    for (k, v) in subs {
        s = s.replace(&format!("{{{{{k}}}}}"), v);
    }
    debug_assert!(!s.contains("{{"), "unsubstituted placeholder in a kernel");
    s
}

/// One compiled variant of a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Table dtype code ([`weight_code`]).
    Embedding {
        dt: u32,
    },
    /// RMSNorm, fused with the residual add when `add`.
    RmsNorm {
        add: bool,
    },
    Rope,
    SiluMul,
    Add,
    Gather,
    QuantAct,
    /// E4M3 rounding of the inputs of W8A8 FP8 weights (`round_act_e4m3.wgsl`).
    RoundActE4m3,
    /// Quantized matmul: tile, weight code, word-aligned rows, paired Q8_0 blocks, bias.
    MatmulQ {
        tm: usize,
        tn: usize,
        wdt: u32,
        aligned: bool,
        pair: bool,
        bias: bool,
    },
    /// Float matmul: tile, weight code, 4-wide loads, bias.
    MatmulF {
        tm: usize,
        tn: usize,
        wdt: u32,
        fast: bool,
        bias: bool,
    },
    /// KV write into a cache of dtype code `cdt` ([`cache_code`]).
    KvWrite {
        cdt: u32,
    },
    /// Paged attention over a cache of dtype code `cdt`, head dimension `hd` (even).
    Attention {
        cdt: u32,
        hd: usize,
    },
    Sample,
    /// Token edits of logits rows (`edit_tokens.wgsl`).
    EditTokens,
    /// Grammar masks of logits rows (`mask_rows.wgsl`).
    MaskRows,
    /// Log-sum-exp and top alternatives of logits rows (`logprob_stats.wgsl`).
    LogprobStats,
    /// A Gated DeltaNet layer's recurrence (`gated_delta_net.wgsl`).
    GatedDeltaNet,
    /// `x * sigmoid(gate)` (`sigmoid_mul.wgsl`).
    SigmoidMul,
}

fn bias_decl(bias: bool, binding: u32) -> (&'static str, String) {
    let decl = if bias {
        format!("@group(0) @binding({binding}) var<storage, read> bias: array<f32>;")
    } else {
        String::new()
    };
    ("BIAS_DECL", decl)
}

impl Kernel {
    /// The pipeline cache key.
    pub fn key(&self) -> String {
        format!("{self:?}")
    }

    /// The specialized WGSL source.
    pub fn source(&self) -> String {
        match *self {
            Kernel::Embedding { dt } => specialize(EMBEDDING, &[("DT", dt.to_string())]),
            Kernel::RmsNorm { add } => {
                let row = "p.res_off + r * p.dim + j";
                let subs: [(&str, String); 4] = if add {
                    [
                        (
                            "RES_DECL",
                            "@group(0) @binding(4) var<storage, read_write> res: array<f32>;"
                                .into(),
                        ),
                        ("ADD", "true".into()),
                        (
                            "ADD_STEP",
                            format!("v = res[{row}] + v; if (live) {{ res[{row}] = v; }}"),
                        ),
                        ("LOAD_NORMED", format!("let v = res[{row}];")),
                    ]
                } else {
                    [
                        ("RES_DECL", String::new()),
                        ("ADD", "false".into()),
                        ("ADD_STEP", String::new()),
                        ("LOAD_NORMED", "let v = x[p.x_off + r * p.dim + j];".into()),
                    ]
                };
                specialize(RMS_NORM, &subs)
            }
            Kernel::Rope => specialize(ROPE, &[]),
            Kernel::SiluMul => specialize(SILU_MUL, &[]),
            Kernel::Add => specialize(ADD, &[]),
            Kernel::Gather => specialize(GATHER, &[]),
            Kernel::QuantAct => specialize(QUANT_ACT, &[]),
            Kernel::RoundActE4m3 => specialize(ROUND_ACT_E4M3, &[]),
            Kernel::MatmulQ {
                tm,
                tn,
                wdt,
                aligned,
                pair,
                bias,
            } => specialize(
                MATMUL_Q,
                &[
                    ("TM", tm.to_string()),
                    ("TN", tn.to_string()),
                    ("WDT", wdt.to_string()),
                    ("ALIGNED", aligned.to_string()),
                    bias_decl(bias, 5),
                    ("BODY", matmul_gen::q_body(tm, tn, wdt, bias, pair)),
                ],
            ),
            Kernel::MatmulF {
                tm,
                tn,
                wdt,
                fast,
                bias,
            } => specialize(
                MATMUL_F,
                &[
                    ("TM", tm.to_string()),
                    ("TN", tn.to_string()),
                    ("WDT", wdt.to_string()),
                    ("FAST", fast.to_string()),
                    bias_decl(bias, 4),
                    ("BODY", matmul_gen::f_body(tm, tn, fast, bias)),
                ],
            ),
            Kernel::KvWrite { cdt } => {
                let body = if cdt == 0 {
                    "kc[p.kc_off + slot * p.width + e] = k[p.k_off + t * p.width + e];\n    \
                     vc[p.vc_off + slot * p.width + e] = v[p.v_off + t * p.width + e];"
                } else if cdt >= 3 {
                    "let i = p.k_off + t * p.width + 4u * e;\n    \
                     kc[p.kc_off + slot * (p.width / 4u) + e] = pack4(k[i], k[i + 1u], k[i + 2u], k[i + 3u], p.k_scale);\n    \
                     let j = p.v_off + t * p.width + 4u * e;\n    \
                     vc[p.vc_off + slot * (p.width / 4u) + e] = pack4(v[j], v[j + 1u], v[j + 2u], v[j + 3u], p.v_scale);"
                } else {
                    "let i = p.k_off + t * p.width + 2u * e;\n    \
                     kc[p.kc_off + slot * (p.width / 2u) + e] = pack(k[i], k[i + 1u]);\n    \
                     let j = p.v_off + t * p.width + 2u * e;\n    \
                     vc[p.vc_off + slot * (p.width / 2u) + e] = pack(v[j], v[j + 1u]);"
                };
                specialize(
                    KV_WRITE,
                    &[
                        ("CT", cache_type(cdt).into()),
                        ("CDT", cdt.to_string()),
                        ("BODY", body.into()),
                    ],
                )
            }
            Kernel::Attention { cdt, hd } => {
                let pair = |c: &str, off: &str, scale: &str| match cdt {
                    0 => format!(
                        "let b = p.{off} + row + 2u * i; return vec2<f32>({c}[b], {c}[b + 1u]);"
                    ),
                    1 => format!("return unpack2x16float({c}[p.{off} + row / 2u + i]);"),
                    3 | 4 => format!(
                        "let w = {c}[p.{off} + (row + 2u * i) / 4u]; \
                         let sh = ((row + 2u * i) & 3u) * 8u; \
                         return vec2<f32>(fp8_to_f32((w >> sh) & 0xffu), fp8_to_f32((w >> (sh + 8u)) & 0xffu)) * p.{scale};"
                    ),
                    _ => format!(
                        "let w = {c}[p.{off} + row / 2u + i]; \
                         return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));"
                    ),
                };
                specialize(
                    ATTENTION,
                    &[
                        ("CT", cache_type(cdt).into()),
                        ("CDT", cdt.to_string()),
                        ("HD", hd.to_string()),
                        ("KPAIR", pair("kc", "kc_off", "k_scale")),
                        ("VPAIR", pair("vc", "vc_off", "v_scale")),
                    ],
                )
            }
            Kernel::Sample => specialize(SAMPLE, &[]),
            Kernel::EditTokens => specialize(EDIT_TOKENS, &[]),
            Kernel::MaskRows => specialize(MASK_ROWS, &[]),
            Kernel::LogprobStats => specialize(LOGPROB_STATS, &[]),
            Kernel::GatedDeltaNet => specialize(GATED_DELTA_NET, &[]),
            Kernel::SigmoidMul => specialize(SIGMOID_MUL, &[]),
        }
    }
}

/// The WGSL element type a cache of dtype code `cdt` is bound as.
fn cache_type(cdt: u32) -> &'static str {
    if cdt == 0 { "f32" } else { "u32" }
}

/// True for the weight codes multiplied against Q8 activations
/// (`matmul_q.wgsl`); the float and scaled codes use `matmul_f.wgsl`.
pub fn uses_q8_acts(code: u32) -> bool {
    (3..=5).contains(&code)
}

/// The code kernels use for a weight or embedding dtype.
pub fn weight_code(dtype: DType) -> Result<u32> {
    Ok(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::Q8_0 => 3,
        DType::Q4_0 => 4,
        DType::Q4_1 => 5,
        // W8A8 FP8 multiplies f8_s32's blocks with rounded inputs.
        DType::F8_S32 | DType::F8A8_S32 => 6,
        DType::U4_S32 => 7,
        DType::F4_S16 => 8,
        DType::U8_S32 => 9,
        other => {
            return Err(CoreError::unsupported(format!(
                "{other} weights on the wgpu backend"
            )));
        }
    })
}

/// The code kernels use for a KV cache dtype.
pub fn cache_code(dtype: DType) -> Result<u32> {
    Ok(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::F8E4M3 => 3,
        DType::F8E5M2 => 4,
        other => {
            return Err(CoreError::unsupported(format!(
                "a {other} KV cache on the wgpu backend"
            )));
        }
    })
}

/// Workgroup counts for `workgroups` groups laid out in 2-D when one
/// dimension cannot hold them (kernels flatten with `flat_index`).
pub fn grid(workgroups: usize, max_per_dim: u32) -> Result<(u32, u32, u32)> {
    let max = max_per_dim.max(1) as usize;
    if workgroups <= max {
        return Ok((workgroups as u32, 1, 1));
    }
    let y = workgroups.div_ceil(max);
    if y > max {
        return Err(CoreError::unsupported(format!(
            "{workgroups} workgroups exceed one dispatch"
        )));
    }
    let x = workgroups.div_ceil(y);
    Ok((x as u32, y as u32, 1))
}

/// Workgroups of [`WG`] invocations covering `threads` invocations.
pub fn grid_threads(threads: usize, max_per_dim: u32) -> Result<(u32, u32, u32)> {
    grid(threads.div_ceil(WG as usize), max_per_dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_cover_the_work() {
        assert_eq!(grid(10, 65535).unwrap(), (10, 1, 1));
        let (x, y, _) = grid(200_000, 65535).unwrap();
        assert!(x as usize * y as usize >= 200_000 && x <= 65535);
        assert_eq!(grid_threads(65, 65535).unwrap(), (2, 1, 1));
        assert!(grid(1 << 40, 65535).is_err());
    }

    /// Every variant the backend can compile is valid WGSL (checked with naga,
    /// as wgpu does), so shader errors show up on machines without an adapter.
    #[test]
    fn every_kernel_variant_validates() {
        let mut all = vec![
            Kernel::RmsNorm { add: false },
            Kernel::RmsNorm { add: true },
            Kernel::Rope,
            Kernel::SiluMul,
            Kernel::Add,
            Kernel::Gather,
            Kernel::QuantAct,
            Kernel::RoundActE4m3,
            Kernel::Sample,
            Kernel::EditTokens,
            Kernel::MaskRows,
            Kernel::LogprobStats,
            Kernel::GatedDeltaNet,
            Kernel::SigmoidMul,
        ];
        for dt in 0..6 {
            all.push(Kernel::Embedding { dt });
        }
        for cdt in 0..5 {
            all.push(Kernel::KvWrite { cdt });
            for hd in [16, 64, 128] {
                all.push(Kernel::Attention { cdt, hd });
            }
        }
        for tm in 1..=8 {
            for bias in [false, true] {
                for wdt in 3..6 {
                    for aligned in [false, true] {
                        let pair = aligned && wdt == 3;
                        all.push(Kernel::MatmulQ {
                            tm,
                            tn: 4,
                            wdt,
                            aligned,
                            pair,
                            bias,
                        });
                    }
                }
                for wdt in [0, 1, 2, 6, 7, 8] {
                    for fast in [false, true] {
                        all.push(Kernel::MatmulF {
                            tm,
                            tn: 4,
                            wdt,
                            fast,
                            bias,
                        });
                    }
                }
            }
        }
        for k in all {
            let src = k.source();
            let module = naga::front::wgsl::parse_str(&src)
                .unwrap_or_else(|e| panic!("{k:?}: {}", e.emit_to_string(&src)));
            // unpack2x16float needs this capability, which wgpu grants on
            // Vulkan, Metal and DX12.
            naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::default()
                    | naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32,
            )
            .validate(&module)
            .unwrap_or_else(|e| panic!("{k:?}: {}", e.emit_to_string(&src)));
        }
    }

    #[test]
    fn placeholders_are_replaced() {
        let s = specialize("const A: u32 = {{A}}u;", &[("A", "7".into())]);
        assert!(s.ends_with("const A: u32 = 7u;"));
        assert!(s.contains("fn f32_to_f16_bits"));
    }
}
