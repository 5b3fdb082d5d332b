//! `compressed-tensors`: checkpoints written by llm-compressor.
//!
//! `config_groups` assign a scheme to the linear layers their `targets`
//! match (`Linear` for all, `re:` patterns from the start of the name, or
//! exact names); `ignore` lists the layers left in float. Two schemes:
//! - 8-bit `float` weights (`float-quantized`, the FP8 and FP8_DYNAMIC
//!   presets): `weight` E4M3 and `weight_scale` per `tensor` (`[1]`),
//!   `channel` (`[n, 1]`), `group` (`[n, k/g]`) or `block` (`[ceil(n/bn),
//!   ceil(k/bk)]` for `block_structure [bn, bk]`).
//! - 4-bit `int` weights (`pack-quantized`, the W4A16 and W4A16_ASYM
//!   presets): `weight_packed` I32 `[n, k/8]` (element `c` of a row in bits
//!   `4 (c % 8)` of word `c / 8`, stored as `q + 8`), `weight_scale` per
//!   `group` or `channel`, and for asymmetric schemes `weight_zero_point`
//!   I32 `[ceil(n/8), groups]` (the zero of output `r` in bits `4 (r % 8)`
//!   of word `r / 8`, stored as `z + 8`); value = `(u − uz) × scale`, with
//!   `uz = 8` when symmetric. Act-order checkpoints (`actorder: "group"`)
//!   add `weight_g_idx` I32 `[k]`: input `c` takes the scale and zero of
//!   group `weight_g_idx[c]` instead of `c / group_size`.

use super::common::{
    Excluded, IntWeight, ScaleMap, anchored, bad_shape, floats, group_index, ints,
    static_input_scale, store_float, string, tensor, uint,
};
use super::fp8::{channel_or_tensor_scales, store_f8};
use crate::DType;
use arbor_engine_core::quant::{fetch, in_tensor, load_unquantized};
use arbor_engine_core::{
    BackendCapabilities, CoreError, HostTensor, LinearSpec, QuantInit, QuantMethod, Result,
    WeightSource,
};
use std::sync::Arc;

/// How a group's weights are quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Fp8,
    Int4,
}

/// How a group's scales are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    Tensor,
    Channel,
    Group(usize),
    Block(usize, usize),
}

struct Scheme {
    targets_all: bool,
    exact: Vec<String>,
    patterns: Vec<regex::Regex>,
    kind: Kind,
    strategy: Strategy,
    /// False: int4 weights carry a `weight_zero_point`.
    symmetric: bool,
}

impl Scheme {
    fn matches(&self, prefix: &str) -> bool {
        self.targets_all
            || self.exact.iter().any(|e| e == prefix)
            || self.patterns.iter().any(|r| r.is_match(prefix))
    }
}

/// The `compressed-tensors` method.
pub struct CompressedTensors {
    /// False when built without a checkpoint config (every load fails).
    configured: bool,
    base: Option<Arc<dyn QuantMethod>>,
    schemes: Vec<Scheme>,
    ignore: Excluded,
}

fn parse_scheme(name: &str, g: &serde_json::Value, format: Option<&str>) -> Result<Scheme> {
    let at = |m: String| CoreError::load(format!("config_groups.{name}: {m}"));
    let w = g
        .get("weights")
        .ok_or_else(|| at("weights is missing".into()))?;
    let bits = uint(Some(w), "num_bits", 0).map_err(|e| at(e.to_string()))?;
    let ty = string(Some(w), "type").unwrap_or("int");
    let format = string(Some(g), "format").or(format).unwrap_or("");
    let kind = match (ty, bits) {
        ("float", 8) => Kind::Fp8,
        ("int", 4) if format == "pack-quantized" => Kind::Int4,
        _ => {
            return Err(at(format!(
                "{ty} weights of {bits} bits in format \"{format}\" are not supported \
                 (supported: 8-bit float, 4-bit int pack-quantized)"
            )));
        }
    };
    let symmetric = w.get("symmetric").and_then(|v| v.as_bool()).unwrap_or(true);
    let strategy = match string(Some(w), "strategy").unwrap_or("tensor") {
        "tensor" => Strategy::Tensor,
        "channel" => Strategy::Channel,
        "group" => {
            let gs = uint(Some(w), "group_size", 0).map_err(|e| at(e.to_string()))?;
            if gs == 0 {
                return Err(at("strategy \"group\" needs a positive group_size".into()));
            }
            Strategy::Group(gs)
        }
        "block" => {
            let dims: Option<Vec<usize>> =
                w.get("block_structure")
                    .and_then(|v| v.as_array())
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x.as_u64().map(|u| u as usize))
                            .collect()
                    });
            match dims.as_deref() {
                Some([bn, bk]) if *bn > 0 && *bk > 0 => Strategy::Block(*bn, *bk),
                _ => {
                    return Err(at(
                        "strategy \"block\" needs block_structure [rows, cols]".into()
                    ));
                }
            }
        }
        s => return Err(at(format!("weight strategy \"{s}\" is not supported"))),
    };
    let mut scheme = Scheme {
        targets_all: false,
        exact: Vec::new(),
        patterns: Vec::new(),
        kind,
        strategy,
        symmetric,
    };
    for t in g
        .get("targets")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
    {
        let Some(t) = t.as_str() else { continue };
        if t == "Linear" {
            scheme.targets_all = true;
        } else if let Some(p) = t.strip_prefix("re:") {
            scheme
                .patterns
                .push(anchored(p, &format!("config_groups.{name}.targets"))?);
        } else {
            scheme.exact.push(t.to_string());
        }
    }
    Ok(scheme)
}

impl CompressedTensors {
    pub fn new(init: &QuantInit) -> Result<Self> {
        let Some(qc) = init.checkpoint.as_ref() else {
            return Ok(Self {
                configured: false,
                base: init.base.clone(),
                schemes: Vec::new(),
                ignore: Excluded::default(),
            });
        };
        let format = string(Some(qc), "format");
        let groups = qc
            .get("config_groups")
            .and_then(|v| v.as_object())
            .ok_or_else(|| CoreError::load("config_groups is missing"))?;
        let mut schemes = Vec::new();
        for (name, g) in groups {
            schemes.push(parse_scheme(name, g, format)?);
        }
        Ok(Self {
            configured: true,
            base: init.base.clone(),
            schemes,
            ignore: Excluded::ignore_list(qc)?,
        })
    }

    fn scales(
        &self,
        src: &dyn WeightSource,
        prefix: &str,
        s: Strategy,
        n: usize,
        k: usize,
    ) -> Result<ScaleMap> {
        let name = format!("{prefix}.weight_scale");
        let map = match s {
            Strategy::Tensor | Strategy::Channel => return channel_or_tensor_scales(src, &name, n),
            Strategy::Group(g) => {
                if !k.is_multiple_of(g) {
                    return Err(in_tensor(
                        src,
                        &name,
                        CoreError::load(format!("group_size {g} does not divide the {k} inputs")),
                    ));
                }
                let t = tensor(src, &name)?;
                if t.shape != [n, k / g] {
                    return Err(bad_shape(
                        src,
                        &name,
                        &t.shape,
                        &format!("[{n}, {}]", k / g),
                    ));
                }
                ScaleMap::Groups {
                    s: floats(src, &name, &t)?,
                    g,
                    groups: k / g,
                }
            }
            Strategy::Block(bn, bk) => {
                let t = tensor(src, &name)?;
                let want = [n.div_ceil(bn), k.div_ceil(bk)];
                if t.shape != want {
                    return Err(bad_shape(src, &name, &t.shape, &format!("{want:?}")));
                }
                ScaleMap::Blocks {
                    s: floats(src, &name, &t)?,
                    bn,
                    bk,
                    cols: want[1],
                }
            }
        };
        map.check(src, &name)?;
        Ok(map)
    }

    fn load_int4(
        &self,
        src: &dyn WeightSource,
        spec: &LinearSpec<'_>,
        scheme: &Scheme,
        caps: &BackendCapabilities,
    ) -> Result<HostTensor<'static>> {
        let strategy = scheme.strategy;
        let (n, k) = (spec.out_features, spec.in_features);
        let name = format!("{}.weight_packed", spec.prefix);
        let t = tensor(src, &name)?;
        if t.shape != [n, k.div_ceil(8)] {
            return Err(bad_shape(
                src,
                &name,
                &t.shape,
                &format!("[{n}, {}]", k.div_ceil(8)),
            ));
        }
        let words = ints(src, &name, &t)?;
        let scales = self.scales(src, spec.prefix, strategy, n, k)?;
        let kw = k.div_ceil(8);
        let q = |r: usize, c: usize| ((words[r * kw + c / 8] as u32 >> (4 * (c % 8))) & 0xf) as u8;
        // Zero points: 8 (the offset of the signed values) when symmetric,
        // else `weight_zero_point`, packed eight outputs a word along dim 0.
        let (zg, groups) = match strategy {
            Strategy::Group(g) => (g, k / g),
            _ => (k.max(1), 1),
        };
        // Act-order checkpoints (`actorder: group`) assign inputs to groups
        // by `weight_g_idx`; input `c` then takes the scale and zero of its
        // group, found through the group's first input in the plain layout.
        let gidx = match strategy {
            Strategy::Group(_) => {
                group_index(src, &format!("{}.weight_g_idx", spec.prefix), k, groups)?
            }
            _ => None,
        };
        let col = |c: usize| gidx.as_ref().map_or(c, |v| v[c] * zg);
        let zp: Vec<i32> = if scheme.symmetric {
            Vec::new()
        } else {
            let zname = format!("{}.weight_zero_point", spec.prefix);
            let zt = tensor(src, &zname)?;
            if zt.shape != [n.div_ceil(8), groups] {
                return Err(bad_shape(
                    src,
                    &zname,
                    &zt.shape,
                    &format!("[{}, {groups}]", n.div_ceil(8)),
                ));
            }
            ints(src, &zname, &zt)?
        };
        let zero = |r: usize, c: usize| {
            if zp.is_empty() {
                8u16
            } else {
                ((zp[(r / 8) * groups + col(c) / zg] as u32 >> (4 * (r % 8))) & 0xf) as u16
            }
        };
        let scale = |r: usize, c: usize| scales.at(r, col(c));
        IntWeight {
            n,
            k,
            bits: 4,
            q: &q,
            zero: &zero,
            scale: &scale,
        }
        .store(caps)
    }
}

impl QuantMethod for CompressedTensors {
    fn name(&self) -> &str {
        "compressed-tensors"
    }

    fn prepare<'a>(&self, t: HostTensor<'a>, caps: &BackendCapabilities) -> Result<HostTensor<'a>> {
        store_float(&self.base, t, caps)
    }

    fn load_linear<'a>(
        &self,
        src: &'a dyn WeightSource,
        spec: &LinearSpec<'_>,
        caps: &BackendCapabilities,
    ) -> Result<HostTensor<'a>> {
        let (n, k) = (spec.out_features, spec.in_features);
        if !self.configured {
            return Err(super::int4::unconfigured(self.name(), src));
        }
        let scheme = (!self.ignore.contains(spec.prefix))
            .then(|| self.schemes.iter().find(|s| s.matches(spec.prefix)))
            .flatten();
        let Some(scheme) = scheme else {
            return load_unquantized(src, spec, |t| self.prepare(t, caps));
        };
        match scheme.kind {
            Kind::Int4 => self.load_int4(src, spec, scheme, caps),
            Kind::Fp8 => {
                let name = format!("{}.weight", spec.prefix);
                let t = fetch(src, &name, &[n, k])?;
                if t.dtype != DType::F8E4M3 {
                    return Err(in_tensor(
                        src,
                        &name,
                        CoreError::load(format!(
                            "has dtype {}; its config group quantizes it to f8_e4m3",
                            t.dtype
                        )),
                    ));
                }
                let scales = self.scales(src, spec.prefix, scheme.strategy, n, k)?;
                static_input_scale(src, spec.prefix)?;
                store_f8(src, &name, &t.data, n, k, &scales, caps)
            }
        }
    }
}
