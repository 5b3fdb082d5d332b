#!/usr/bin/env python3
"""Quantized checkpoints of tests/fixtures/tiny-llama in the published HF formats, with reference
logits, for Arbor's quantization methods (crates/quant/src/methods).

Each folder under tests/fixtures/quant/ holds config.json (tiny-llama's, plus the format's
`quantization_config`), model.safetensors with that format's exact tensor names, dtypes and
packing, the tokenizer files, and reference.json. The seven linear layers of every decoder layer
are quantized; embeddings, norms and lm_head stay f32 (lm_head is listed as ignored).

| folder | format |
|---|---|
| fp8-block | `quant_method: fp8`, `weight_block_size: [128, 128]`, E4M3 `weight` + f32 `weight_scale_inv` (DeepSeek-V3, Qwen3-FP8); 160-wide layers leave partial blocks |
| fp8-dynamic | compressed-tensors `float-quantized`, channel strategy: E4M3 `weight` + bf16 `weight_scale [n, 1]`, dynamic per-token activations (llm-compressor FP8_DYNAMIC) |
| fp8-static | compressed-tensors `float-quantized`, tensor strategy: `weight_scale [1]` and static `input_scale [1]` (llm-compressor FP8), calibrated on the first prompt (`calibrated_input_scales`) |
| w4a16 | compressed-tensors `pack-quantized` symmetric int4, group 32: I32 `weight_packed [n, k/8]`, bf16 `weight_scale [n, k/32]`, `weight_shape` |
| w4a16-asym | the same, asymmetric: I32 `weight_zero_point [n/8, k/32]` (zero + 8, packed along the outputs) |
| awq | AutoAWQ GEMM, group 32, zero points: I32 `qweight [k, n/8]` and `qzeros [k/32, n/8]` in AWQ's nibble order, f16 `scales` |
| gptq | GPTQ (checkpoint_format gptq: zeros stored minus one), asymmetric, group 32, `desc_act: false`, I32 `qweight [k/8, n]`, `qzeros`, f16 `scales`, `g_idx` |
| nvfp4 | ModelOpt NVFP4: U8 `weight [n, k/2]` (two E2M1 codes a byte), E4M3 `weight_scale [n, k/16]`, f32 `weight_scale_2` (global) and `input_scale` |
| gptq-actorder | GPTQ symmetric with `desc_act: true`: `g_idx` assigns inputs to groups in a permuted order |

reference.json: for each prompt of tiny-llama's reference, the last-position logits and 32 greedy
tokens (with each step's top-1 minus top-2 logit margin, so a test can stop at a near-tie) of transformers' LlamaForCausalLM (f32, eager attention) run on the weights dequantized in
numpy with each format's published formula (e4m3 x scale; (q - z) x s), after unpacking the
packed tensors the way vLLM's reference unpackers do (checked to round-trip); for the
compressed-tensors folders the weights are also decompressed by the compressed-tensors library
itself and must agree (to its bf16 rounding). `fp8-online.json`
is the same for tiny-llama quantized at load by `--quantization fp8` (one E4M3 scale per output
channel, amax / 448, round to nearest even).

    /tmp/torchenv/bin/python tools/reference/make_quant_fixtures.py [FOLDER ...]

(only the folders named, when some are; fp8-online.json only when none are). A folder is
rewritten whole: run make_w8a8_fixture.py after it for fp8-dynamic's and fp8-static's W8A8
references.

Needs torch, transformers, safetensors, numpy, ml_dtypes and compressed-tensors (0.20).
"""

import json
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
SRC = ROOT / "tiny-llama"
OUT = ROOT / "quant"
COPIED = ["generation_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
NEW_TOKENS = 32
F8 = ml_dtypes.float8_e4m3fn
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ pack order: nibble i holds column order[i]
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]  # vLLM's unpack order


def source_weights() -> dict:
    sd = {}
    for f in sorted(SRC.glob("model-*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def linear_names(cfg: dict):
    for i in range(cfg["num_hidden_layers"]):
        for lin in LINEARS:
            yield f"model.layers.{i}.{lin}"


# ---------------------------------------------------------------- FP8

def e4m3(x: np.ndarray) -> np.ndarray:
    """Round to E4M3 (nearest even), saturating at +-448."""
    return np.clip(x, -448.0, 448.0).astype(F8)


def e4m3_bytes(q: np.ndarray) -> np.ndarray:
    return q.view(np.uint8)


def from_e4m3(q: np.ndarray) -> np.ndarray:
    return q.astype(np.float32)


def fp8_block(w: np.ndarray, bn=128, bk=128):
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    s = np.zeros((rows, cols), np.float32)
    q = np.zeros((n, k), F8)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s[i, j] = max(np.abs(blk).max() / 448.0, 1e-12)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = e4m3(blk / s[i, j])
    deq = from_e4m3(q) * np.repeat(np.repeat(s, bn, 0), bk, 1)[:n, :k]
    return {"weight": q, "weight_scale_inv": s}, deq


def bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16)


def fp8_channel(w: np.ndarray):
    s = bf16(np.abs(w).max(axis=1, keepdims=True) / 448.0)
    q = e4m3(w / s.astype(np.float32))
    parts, deq = {"weight": q, "weight_scale": s}, from_e4m3(q) * s.astype(np.float32)
    check_ct(parts, {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
             deq, False)
    return parts, deq


def fp8_tensor(w: np.ndarray, input_scale: float):
    s = np.array([np.abs(w).max() / 448.0], np.float32)
    q = e4m3(w / s[0])
    # The static activation scale calibrated for this layer (calibrated_input_scales).
    return {"weight": q, "weight_scale": s, "input_scale": np.array([input_scale], np.float32)}, from_e4m3(q) * s[0]


# The linears each hook call of make_kv_scales_fixture.forward's `linear_input` feeds, in its
# order per layer, and the factor on each one's calibrated scale: k and v below q and gate below
# up, as two observers of one input may disagree (vLLM and SGLang give a fused projection the
# largest of its shards' scales, and so does Arbor), and down_proj's at half its observed range.
CALIBRATED = [(("self_attn.q_proj", 1.0), ("self_attn.k_proj", 0.75), ("self_attn.v_proj", 0.5)),
              (("self_attn.o_proj", 1.0),),
              (("mlp.gate_proj", 0.7), ("mlp.up_proj", 1.0)),
              (("mlp.down_proj", 0.5),)]


def calibrated_input_scales(sd: dict, cfg: dict, prompts: list) -> dict:
    """Static input scales as llm-compressor's min-max observer calibrates them: max |x| / 448 of
    each linear's input over a calibration sample (here the first prompt, so the longer prompts'
    inputs may pass it and saturate), times the factors above."""
    from make_kv_scales_fixture import observed_input_amax

    amax = observed_input_amax(sd, cfg, prompts[0]["input_ids"])
    scales = {}
    for i, a in enumerate(amax):
        layer, slot = divmod(i, 4)
        for lin, factor in CALIBRATED[slot]:
            scales[f"model.layers.{layer}.{lin}"] = float(np.float32(a / 448.0 * factor))
    return scales


def fp8_rows_online(w: np.ndarray) -> np.ndarray:
    """What --quantization fp8 stores: per output channel amax/448 in f32, x / s rounded to E4M3."""
    amax = np.abs(w).max(axis=1, keepdims=True).astype(np.float32)
    s = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    q = e4m3((w / s).astype(np.float32))
    return from_e4m3(q) * s


# ---------------------------------------------------------------- INT4

def groups_asym(w: np.ndarray, g: int, scale_dtype):
    """Per output row and group of g inputs: AutoAWQ's min/max rule. Returns q [n, k] in 0..15,
    zeros [n, k/g], scales [n, k/g] (in scale_dtype)."""
    n, k = w.shape
    wg = w.reshape(n, k // g, g)
    hi, lo = wg.max(-1), wg.min(-1)
    s = ((hi - lo).clip(min=1e-5) / 15).astype(scale_dtype)
    sf = s.astype(np.float32)
    z = np.clip(np.round(-lo / sf), 0, 15).astype(np.int32)
    q = np.clip(np.round(wg / sf[..., None]) + z[..., None], 0, 15).astype(np.int32).reshape(n, k)
    return q, z, s


def groups_sym(w: np.ndarray, g: int, scale_dtype):
    """Symmetric int4: scale amax/7, q in -8..7 (returned offset by +8, zero 8)."""
    n, k = w.shape
    wg = w.reshape(n, k // g, g)
    s = (np.abs(wg).max(-1).clip(min=1e-5) / 7).astype(scale_dtype)
    sf = s.astype(np.float32)
    q = np.clip(np.round(wg / sf[..., None]), -8, 7).astype(np.int32).reshape(n, k) + 8
    return q, np.full(s.shape, 8, np.int32), s


def pack_rows_seq(v: np.ndarray) -> np.ndarray:
    """Pack 8 consecutive values of the last axis per int32, value i in bits 4i."""
    r, c = v.shape
    v = v.reshape(r, c // 8, 8).astype(np.uint32)
    out = np.zeros((r, c // 8), np.uint32)
    for i in range(8):
        out |= (v[:, :, i] & 0xF) << (4 * i)
    return out.view(np.int32)


def unpack_rows_seq(p: np.ndarray) -> np.ndarray:
    u = p.view(np.uint32)
    return np.stack([(u >> (4 * i)) & 0xF for i in range(8)], -1).reshape(u.shape[0], -1).astype(np.int32)


def awq_pack(v: np.ndarray) -> np.ndarray:
    """AutoAWQ's WQLinear_GEMM packing of v [rows, cols] along cols."""
    r, c = v.shape
    out = np.zeros((r, c // 8), np.uint32)
    for col in range(c // 8):
        for i in range(8):
            out[:, col] |= (v[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) & 0xF) << (4 * i)
    return out.view(np.int32)


def awq_unpack(p: np.ndarray) -> np.ndarray:
    """vLLM's awq dequantize: shift out the nibbles, then undo the order."""
    u = p.view(np.uint32)
    nib = np.stack([(u >> (4 * i)) & 0xF for i in range(8)], -1)  # [r, c/8, 8] in nibble order
    return nib[:, :, AWQ_REVERSE].reshape(u.shape[0], -1).astype(np.int32)


def awq(w: np.ndarray, g=32):
    q, z, s = groups_asym(w, g, np.float16)  # [n, k], [n, k/g]
    qweight = awq_pack(q.T)  # [k, n/8]
    qzeros = awq_pack(z.T)  # [k/g, n/8]
    scales = s.T.copy()  # [k/g, n]
    iq, iz = awq_unpack(qweight), awq_unpack(qzeros)
    assert (iq == q.T).all() and (iz == z.T).all()
    gi = np.arange(w.shape[1]) // g
    deq = ((iq - iz[gi]) * scales.astype(np.float32)[gi]).T
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales}, deq


def gptq(w: np.ndarray, g=32, sym=False, act_order=False, rng=None):
    n, k = w.shape
    if act_order:
        # Inputs quantized in a permuted order: group of input c is its rank in perm // g.
        perm = rng.permutation(k)
        g_idx = np.empty(k, np.int32)
        g_idx[perm] = np.arange(k) // g
        wp = w[:, perm]
        q_p, z, s = (groups_sym if sym else groups_asym)(wp, g, np.float16)
        q = np.empty_like(q_p)
        q[:, perm] = q_p
    else:
        g_idx = (np.arange(k) // g).astype(np.int32)
        q, z, s = (groups_sym if sym else groups_asym)(w, g, np.float16)
    qt = q.T.reshape(k // 8, 8, n).astype(np.uint32)  # input 8j + i of output c at [j, i, c]
    qweight = np.zeros((k // 8, n), np.uint32)
    for i in range(8):
        qweight |= (qt[:, i, :] & 0xF) << (4 * i)
    qweight = qweight.view(np.int32)
    qzeros = pack_rows_seq((z.T - 1) & 0xF)  # [k/g, n/8], the original format's zero - 1
    scales = s.T.copy()  # [k/g, n]
    # Reference unpack (AutoGPTQ's dequant): qweight along k, zeros + 1.
    u = qweight.view(np.uint32)
    iq = np.stack([(u >> (4 * i)) & 0xF for i in range(8)], 1).reshape(k, n).astype(np.int32)
    iz = ((unpack_rows_seq(qzeros) + 1) & 0x1F).astype(np.int32)
    assert (iq == q.T).all() and (iz == z.T).all()
    deq = ((iq - iz[g_idx]) * scales.astype(np.float32)[g_idx]).T
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}, deq


def to_torch(v: np.ndarray) -> torch.Tensor:
    if v.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(v.view(np.int16).copy()).view(torch.bfloat16)
    if v.dtype == F8:
        return torch.from_numpy(v.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(v))


def ct_decompressed(parts: dict, weights: dict, packed: bool) -> np.ndarray:
    """The weight compressed-tensors itself decompresses from `parts` (an independent check of
    the layout; it dequantizes in the scale's dtype, so it matches to bf16 rounding)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    sd = {k: to_torch(v) for k, v in parts.items()}
    if packed:
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        out = PackedQuantizationCompressor.decompress(sd, scheme)
    else:
        from compressed_tensors.quantization.lifecycle.forward import dequantize
        out = {"weight": dequantize(x_q=sd["weight"], scale=sd["weight_scale"], args=scheme.weights)}
    return out["weight"].float().numpy()


def check_ct(parts: dict, weights: dict, deq: np.ndarray, packed: bool) -> None:
    lib = ct_decompressed(parts, weights, packed)
    rel = np.abs(lib - deq).max() / np.abs(deq).max()
    assert lib.shape == deq.shape and rel < 1e-2, (lib.shape, deq.shape, rel)


W4A16_WEIGHTS = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                 "symmetric": True, "dynamic": False}
W4A16_ASYM_WEIGHTS = dict(W4A16_WEIGHTS, symmetric=False)


def w4a16_asym(w: np.ndarray, g=32):
    """compressed-tensors W4A16_ASYM: zero points packed along the output dim."""
    q, z, s = groups_asym(w, g, ml_dtypes.bfloat16)
    n, k = w.shape
    packed = pack_rows_seq(q)  # [n, k/8]; q is the signed value + 8
    zp = pack_rows_seq(z.T.copy()).T.copy()  # [n/8, k/g], zero + 8 packed along n
    deq = (q - np.repeat(z, g, 1)) * np.repeat(s.astype(np.float32), g, 1)
    parts = {"weight_packed": packed, "weight_scale": s, "weight_zero_point": zp,
             "weight_shape": np.array([n, k], np.int32)}
    check_ct(parts, W4A16_ASYM_WEIGHTS, deq, True)
    return parts, deq


def w4a16(w: np.ndarray, g=32):
    q, _, s = groups_sym(w, g, ml_dtypes.bfloat16)
    n, k = w.shape
    packed = pack_rows_seq(q)  # [n, k/8], stored as q + 8
    iq = unpack_rows_seq(packed) - 8
    deq = iq * np.repeat(s.astype(np.float32), g, 1)
    parts = {"weight_packed": packed, "weight_scale": s, "weight_shape": np.array([n, k], np.int32)}
    if g == 32:
        check_ct(parts, W4A16_WEIGHTS, deq, True)
    return parts, deq


# ---------------------------------------------------------------- NVFP4

F4 = ml_dtypes.float4_e2m1fn


def nvfp4(w: np.ndarray):
    """ModelOpt NVFP4: global scale amax / (6 * 448), E4M3 block scales per 16 inputs, E2M1 codes
    packed two a byte (element 2i in the low nibble)."""
    n, k = w.shape
    g2 = np.float32(np.abs(w).max() / (6.0 * 448.0))
    wg = w.reshape(n, k // 16, 16)
    bs = e4m3(np.abs(wg).max(-1) / 6.0 / g2)  # [n, k/16] E4M3
    eff = (from_e4m3(bs) * g2).astype(np.float32)  # f32(block scale) x global, the dequant scale
    safe = np.where(eff > 0, eff, 1.0).astype(np.float32)
    codes = np.clip(wg / safe[..., None], -6.0, 6.0).astype(F4).reshape(n, k)
    nib = codes.view(np.uint8) & 0xF
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    # Reference unpack (vLLM's break_fp4_bytes): low nibble first.
    lo, hi = packed & 0xF, packed >> 4
    un = np.stack([lo, hi], -1).reshape(n, k)
    assert (un == nib).all()
    vals = un.view(F4).astype(np.float32)
    deq = (vals.reshape(n, k // 16, 16) * eff[..., None]).reshape(n, k)
    return {"weight": packed, "weight_scale": bs, "weight_scale_2": np.array(g2, np.float32),
            "input_scale": np.array(0.05, np.float32)}, deq


# ---------------------------------------------------------------- configs

def ct_config(weights: dict, acts, fmt: str) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ["lm_head"],
    }


FORMATS = {
    "fp8-block": (fp8_block, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128]}),
    "fp8-dynamic": (fp8_channel, ct_config(
        {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
        {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True},
        "float-quantized")),
    "fp8-static": (None, ct_config(
        {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False},
        {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False},
        "float-quantized")),
    "w4a16": (w4a16, ct_config(W4A16_WEIGHTS, None, "pack-quantized")),
    "w4a16-asym": (w4a16_asym, ct_config(W4A16_ASYM_WEIGHTS, None, "pack-quantized")),
    "awq": (awq, {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                  "version": "gemm", "modules_to_not_convert": None}),
    "gptq": (lambda w: gptq(w, sym=False), {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                            "desc_act": False, "sym": False,
                                            "checkpoint_format": "gptq"}),
    "nvfp4": (nvfp4, {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                      "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}),
    "gptq-actorder": (None, {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                             "sym": True, "checkpoint_format": "gptq"}),
}


def reference(cfg: dict, deq: dict, prompts: list, model=None) -> dict:
    """transformers' last logits and greedy tokens (with margins) per prompt: of `model` when
    given, else of LlamaForCausalLM with the weights `deq`."""
    torch.manual_seed(0)
    if model is None:
        conf = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("quantization_config",)})
        model = LlamaForCausalLM(conf).eval()
        sd = {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in deq.items()}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    out = []
    for p in prompts:
        ids = p["input_ids"]
        seq = list(ids)
        margins = []
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1].float()
            for _ in range(NEW_TOKENS):
                lg = model(torch.tensor([seq])).logits[0, -1]
                top2 = torch.topk(lg, 2).values
                margins.append(float(top2[0] - top2[1]))
                seq.append(int(torch.argmax(lg)))
        out.append({"text": p["text"], "input_ids": ids,
                    "last_logits": [float(v) for v in last.numpy().astype(np.float32)],
                    "greedy_ids": seq[len(ids):], "margins": margins,
                    "min_margin": min(margins)})
    return {"model": "tiny-llama", "prompts": out, "torch_version": torch.__version__}


def main() -> None:
    torch.set_num_threads(1)
    cfg = json.loads((SRC / "config.json").read_text())
    prompts = json.loads((SRC / "reference.json").read_text())["prompts"]
    sd = source_weights()
    input_scales = calibrated_input_scales(sd, cfg, prompts)
    OUT.mkdir(exist_ok=True)
    only = sys.argv[1:]
    for name, (quantize, qc) in FORMATS.items():
        if only and name not in only:
            continue
        rng = np.random.default_rng(5)
        d = OUT / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir()
        tensors, deq = {}, {}
        for k, v in sd.items():
            tensors[k], deq[k] = v, v
        for lin in linear_names(cfg):
            w = sd[f"{lin}.weight"].astype(np.float32)
            del tensors[f"{lin}.weight"]
            if name == "gptq-actorder":
                parts, dq = gptq(w, sym=True, act_order=True, rng=rng)
            elif name == "fp8-static":
                parts, dq = fp8_tensor(w, input_scales[lin])
            else:
                parts, dq = quantize(w)
            for part, t in parts.items():
                tensors[f"{lin}.{part}"] = t
            deq[f"{lin}.weight"] = dq.astype(np.float32)
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(d / "model.safetensors"))
        qcfg = dict(cfg, quantization_config=qc, torch_dtype="bfloat16")
        (d / "config.json").write_text(json.dumps(qcfg, indent=2) + "\n")
        for f in COPIED:
            shutil.copy(SRC / f, d / f)
        ref = reference(cfg, deq, prompts)
        ref["format"] = name
        (d / "reference.json").write_text(json.dumps(ref) + "\n")
        print(name, "min margins", [round(p["min_margin"], 4) for p in ref["prompts"]],
              "bytes", (d / "model.safetensors").stat().st_size)
    if only:
        return
    deq = dict(sd)
    for lin in linear_names(cfg):
        deq[f"{lin}.weight"] = fp8_rows_online(sd[f"{lin}.weight"].astype(np.float32))
    ref = reference(cfg, deq, prompts)
    ref["format"] = "fp8-online"
    (OUT / "fp8-online.json").write_text(json.dumps(ref) + "\n")
    print("fp8-online min margins", [round(p["min_margin"], 4) for p in ref["prompts"]])


if __name__ == "__main__":
    main()
