#!/usr/bin/env python3
"""tests/fixtures/quant/moe-fp8-static: tiny-qwen3-moe as an llm-compressor FP8 checkpoint with
static input scales (the layout of neuralmagic/Mixtral-8x7B-Instruct-v0.1-FP8 and the
RedHatAI FP8 MoE checkpoints), and its references from a numpy float64 forward written here from
the Qwen3-MoE definition and checked against tiny-qwen3-moe's transformers reference.

The format: compressed-tensors `float-quantized`, tensor strategy. Every attention linear and
every expert's gate/up/down_proj stores an E4M3 `weight`, an f32 `weight_scale [1]` (amax / 448)
and an f32 `input_scale [1]`; the routers (`mlp.gate`, ignored by a `re:` pattern, as
llm-compressor writes it), the dense MLP of layer 1 (ignored by name: its 96 inputs split over two
tensor-parallel ranks would cut a block of 32, and float layers beside quantized ones are part of
the format), embeddings, norms and lm_head stay f32.

Input scales are calibrated on the first prompt as llm-compressor's min-max observer does, with
every token sent to every expert (its `calibrate_all_experts`, so no expert is left without a
scale): max |x| / 448 of each linear's input, times a factor so that the scales that vLLM and
SGLang (and Arbor) merge differ: Q/K/V and gate/up as make_quant_fixtures.CALIBRATED, down_proj
at half its range, and each expert e's further times (1 - 0.08 e).

- reference.json: the checkpoint served as stored (weight-only FP8: the weights q * scale, f32
  inputs);
- w8a8-reference.json: under `--quantization w8a8_fp8`: each linear's input x becomes
  e4m3(x * (1 / s)) * s (f32 arithmetic, saturating at 448) with s, as vLLM's fused layers and
  its FP8 MoE methods take them: the largest of Q/K/V's, o_proj's own; for a sparse layer's
  experts ONE scale for every expert's gate/up
  input, the largest of all its experts' gate_proj and up_proj scales (vLLM's
  `w13_input_scale.max()`), and one for every down_proj input, the largest of the experts'.

Both files hold, per prompt of tiny-qwen3-moe's reference, the last position's logits and 32
greedy tokens with each step's top-1 minus top-2 margin (make_gptq8_fixture.reference's layout),
`min_router_gap` (the smallest gap between the k-th chosen and the best unchosen router logit over
the prompt's forwards) and, in w8a8-reference.json, `closest_tie` (make_w8a8_fixture's).

It also writes tests/fixtures/quant/deepseek-v3-fp8-block (`deepseek_v3_block_fp8`): tiny-deepseek-v3
in DeepSeek-V3's published FP8 layout (`quant_method: fp8`, `weight_block_size: [128, 128]`, an E4M3
`weight` and an f32 `weight_scale_inv` per 128 x 128 block for every linear of the decoder layers:
the latent attention's q_a/q_b/kv_a/kv_b/o projections, the dense MLP, the experts and the shared
expert; routers, norms, embeddings and lm_head f32), with transformers' reference (DeepseekV3ForCausalLM)
of the weights dequantized as q * scale_inv, and per prompt `router_unstable_tokens`
(make_moe_fixtures.router_unstable); and its w8a8-reference.json (`w8a8_reference`): the same model
with the inputs of the products that keep FP8 weights under `--quantization w8a8_fp8` (latent
attention's q_a, q_b, kv_a and o projections, the dense MLP, the experts and the shared expert;
not kv_b_proj, whose per-head up-projections are float, as in vLLM's decode) rounded to E4M3 per
32, hooked into transformers' eager experts.

And tests/fixtures/quant/moe-gptq, moe-awq and moe-nvfp4 (`moe_weight_only`): tiny-qwen3-moe as GPTQ
4-bit (Qwen3-30B-A3B-GPTQ-Int4's layout), AutoAWQ 4-bit and ModelOpt NVFP4 (nvidia/Qwen3-30B-A3B-FP4's)
on every decoder linear, experts and dense MLP included, each with the numpy forward's reference of
the weights dequantized with the format's formula.

And tests/fixtures/quant/deepseek-v3-fp8-static (`deepseek_v3_fp8_static`): tiny-deepseek-v3 as
llm-compressor's FP8 with calibrated static input scales, with transformers' references weight-only
and under `--quantization w8a8_fp8` (`deepseek_static_reference`: the scales merged as vLLM fuses
the layers).

    python tools/reference/make_moe_quant_fixtures.py   (numpy, ml_dtypes, torch, transformers)
"""

import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
from make_gptq8_fixture import reference
from make_quant_fixtures import CALIBRATED, ct_config, fp8_tensor
from make_w8a8_fixture import closest_tie, e4m3, inputs, tie_distance
from safetensors_np import load_file, save_file

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
SRC = FIXTURES / "tiny-qwen3-moe"
OUT = FIXTURES / "quant" / "moe-fp8-static"
COPIED = ["generation_config.json", "special_tokens_map.json", "tokenizer.json",
          "tokenizer_config.json"]
EXPERT = ["gate_proj", "up_proj", "down_proj"]
# Latent attention's projections that keep their FP8 weights under w8a8_fp8 (kv_b_proj is cut into
# float per-head up-projections at load).
ROUNDED_ATTENTION = tuple(f"self_attn.{p}" for p in ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                     "o_proj"])
# The scale factors of a linear of each hook kind (make_quant_fixtures.CALIBRATED's).
FACTOR = {lin.split(".")[1]: f for group in CALIBRATED for lin, f in group}
# Closer to an E4M3 rounding midpoint than this (relative), an input may round either way
# (crates/models/tests/quantized.rs).
NEAR_TIE = 1e-6
# Greedy steps with a smaller top-2 margin are not compared (quantized.rs's EXACT.margin).
MIN_MARGIN = 1e-3
# The smallest router gap seen since the last reset.
router_gap = [np.inf]


def fp8_static_config(ignore: list) -> dict:
    """llm-compressor's FP8 with static input scales: compressed-tensors `float-quantized`, tensor
    strategy for weights and input activations, the layers `ignore` left float."""
    fp8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
    return dict(ct_config(fp8, fp8, "float-quantized"), ignore=ignore)


def write_folder(out: Path, src: Path, tensors: dict, qc: dict) -> None:
    """Rewrites the HF folder `out`: `tensors` as model.safetensors, `src`'s config.json with the
    quantization config `qc`, and `src`'s tokenizer and generation files."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in sorted(tensors.items())}, out / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc), indent=2) + "\n")
    for f in COPIED:
        shutil.copy(src / f, out / f)


def decoder_linear(name: str) -> bool:
    """Whether tensor `name` is the weight of a linear of a decoder layer (`*_proj`, and latent
    attention's `kv_a_proj_with_mqa`)."""
    return name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def sparse(cfg: dict, layer: int) -> bool:
    step = cfg.get("decoder_sparse_step", 1)
    return layer not in cfg.get("mlp_only_layers", []) and (layer + 1) % step == 0


def forward(w: dict, cfg: dict, ids: list, linear_input=None) -> np.ndarray:
    """Logits of every position of Qwen3-MoE in float64. `linear_input(kind, layer, expert, x)`,
    when given, maps the input of the linears of one kind ("qkv", "o", "gate_up", "down"; expert
    None outside the experts) to what they multiply."""
    li = linear_input or (lambda kind, layer, e, v: v)
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, top_k = cfg["rms_norm_eps"], cfg["num_experts_per_tok"]
    f = lambda n: w[n].astype(np.float64)
    t = len(ids)
    x = f("model.embed_tokens.weight")[ids]
    theta = cfg["rope_parameters"]["rope_theta"]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def norm(v, g):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * g

    def rope(v):  # [t, heads, hd], rotate-half
        a, b = v[..., : hd // 2], v[..., hd // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def mlp(p, y, layer, e):
        g = li("gate_up", layer, e, y)
        a = (g @ f(f"{p}.gate_proj.weight").T)
        a = a / (1 + np.exp(-a)) * (g @ f(f"{p}.up_proj.weight").T)
        return li("down", layer, e, a) @ f(f"{p}.down_proj.weight").T

    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        y = li("qkv", i, None, norm(x, f(f"{p}.input_layernorm.weight")))
        q = norm((y @ f(f"{p}.self_attn.q_proj.weight").T).reshape(t, nh, hd),
                 f(f"{p}.self_attn.q_norm.weight"))
        k = norm((y @ f(f"{p}.self_attn.k_proj.weight").T).reshape(t, nkv, hd),
                 f(f"{p}.self_attn.k_norm.weight"))
        v = (y @ f(f"{p}.self_attn.v_proj.weight").T).reshape(t, nkv, hd)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(t, nh * hd)
        x = x + li("o", i, None, o) @ f(f"{p}.self_attn.o_proj.weight").T
        y = norm(x, f(f"{p}.post_attention_layernorm.weight"))
        if not sparse(cfg, i):
            x = x + mlp(f"{p}.mlp", y, i, None)
            continue
        logits = y @ f(f"{p}.mlp.gate.weight").T
        out = np.zeros_like(x)
        for r in range(t):
            order = np.argsort(-logits[r], kind="stable")
            chosen = order[:top_k]
            if top_k < len(order):
                gap = logits[r, order[top_k - 1]] - logits[r, order[top_k]]
                router_gap[0] = min(router_gap[0], gap)
            pr = np.exp(logits[r] - logits[r].max())
            pr /= pr.sum()
            wts = pr[chosen]
            if cfg.get("norm_topk_prob", False):
                wts = wts / wts.sum()
            for e, wt in zip(chosen, wts):
                out[r] += wt * mlp(f"{p}.mlp.experts.{e}", y[r:r + 1], i, int(e))[0]
        x = x + out
    x = norm(x, f("model.norm.weight"))
    return x @ f("lm_head.weight").T


def linears(cfg: dict):
    """(prefix, hook kind, expert) of every quantized linear of the decoder layers."""
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for lin, kind in [("q_proj", "qkv"), ("k_proj", "qkv"), ("v_proj", "qkv"), ("o_proj", "o")]:
            yield f"{p}.self_attn.{lin}", kind, None
        if not sparse(cfg, i):
            continue  # left in float (see the module documentation)
        for e in range(cfg["num_experts"]):
            for lin in EXPERT:
                yield f"{p}.mlp.experts.{e}.{lin}", "down" if lin == "down_proj" else "gate_up", e


def calibrated_input_scales(w: dict, cfg: dict, ids: list) -> dict:
    """Each linear's static input scale: max |x| / 448 of its input over `ids`, every token
    through every expert, times its factors (see the module documentation)."""
    amax = {}

    def observe(kind, layer, e, x):
        key = (kind, layer, e)
        amax[key] = max(amax.get(key, 0.0), float(np.abs(x).max()))
        return x

    calibrating = dict(cfg, num_experts_per_tok=cfg["num_experts"], norm_topk_prob=False)
    forward(w, calibrating, ids, linear_input=observe)
    scales = {}
    for prefix, kind, e in linears(cfg):
        layer = int(prefix.split(".")[2])
        factor = FACTOR[prefix.rsplit(".", 1)[1]] * (1.0 if e is None else 1.0 - 0.08 * e)
        scales[prefix] = float(np.float32(amax[(kind, layer, e)] / 448.0 * factor))
    return scales


def merged_scales(scales: dict, cfg: dict) -> dict:
    """The scale each (kind, layer, expert) hook call rounds its input with under w8a8_fp8: the
    largest of the linears that share that input, over every expert of a sparse layer."""
    merged = {}
    for prefix, kind, e in linears(cfg):
        layer = int(prefix.split(".")[2])
        key = (kind, layer, "experts" if e is not None else None)
        merged[key] = max(merged.get(key, 0.0), scales[prefix])
    return merged


def round_static(x: np.ndarray, s: float) -> np.ndarray:
    """x rounded with the static scale s as W8A8 does: e4m3(x * (1 / s)) * s (f32 arithmetic,
    saturating at 448), recording the closest tie."""
    s = np.float32(s)
    scaled = (x.astype(np.float32) * (np.float32(1.0) / s)).astype(np.float32)
    closest_tie[0] = min(closest_tie[0], tie_distance(scaled))
    return (e4m3(scaled) * s).astype(np.float64)


def static_inputs(merged: dict):
    def rounded(kind, layer, e, x):
        key = (kind, layer, "experts" if e is not None else None)
        if key not in merged:
            return x  # a float layer
        return round_static(x, merged[key])

    return rounded


def write(out: Path, fmt: str, about: str, w: dict, cfg: dict, prompts: list, linear_input=None,
          name: str = "reference.json") -> None:
    rows = []
    fwd = lambda w, cfg, ids, linear_input=None: forward(w, cfg, ids, linear_input)
    for p in prompts:
        closest_tie[0], router_gap[0] = np.inf, np.inf
        rows += reference(w, cfg, [p], linear_input=linear_input, forward_fn=fwd)
        rows[-1]["min_router_gap"] = float(router_gap[0])
        if linear_input is not None:
            rows[-1]["closest_tie"] = closest_tie[0]
    ref = {"model": "tiny-qwen3-moe", "format": fmt, "reference": about, "prompts": rows}
    (out / name).write_text(json.dumps(ref) + "\n")
    print(fmt, name, "min margins", [round(p["min_margin"], 4) for p in rows],
          "router gaps", [f"{p['min_router_gap']:.1e}" for p in rows],
          "closest ties", [f"{p.get('closest_tie', np.inf):.1e}" for p in rows])


def clear_of_ties(w: dict, cfg: dict, prompts: list, scales: dict) -> dict:
    """`scales` times the first calibration slack of 1, 1.01, 1.02, ... under which the first
    prompt's W8A8 forwards keep every input at least NEAR_TIE (relative) from an E4M3 rounding
    midpoint and every greedy step's top-2 margin above MIN_MARGIN, so that one prompt is checked
    whole at the f32 tolerance (an input that close to a midpoint may round the other way in an
    f32 forward)."""
    for j in range(50):
        slack = {k: float(np.float32(v * (1 + 0.01 * j))) for k, v in scales.items()}
        closest_tie[0] = np.inf
        row = reference(w, cfg, prompts[:1], linear_input=static_inputs(merged_scales(slack, cfg)),
                        forward_fn=lambda w, cfg, ids, linear_input: forward(w, cfg, ids, linear_input))
        if closest_tie[0] >= NEAR_TIE and row[0]["min_margin"] >= MIN_MARGIN:
            print(f"calibration slack {1 + 0.01 * j:.2f}: closest tie {closest_tie[0]:.1e}")
            return slack
    raise SystemExit("no calibration slack up to 1.49 keeps the first prompt clear of ties")


def check_forward(w: dict, cfg: dict, ref: dict) -> None:
    """The numpy forward of the float model gives transformers' logits and greedy tokens."""
    for p in ref["prompts"]:
        ids = list(p["input_ids"])
        got = forward(w, cfg, ids)[-1]
        want = np.array(p["last_logits"])
        err = np.abs(got - want).max()
        assert err < 1e-4 * np.abs(want).max(), err
        seq = list(ids)
        for _ in range(len(p["greedy_ids"])):
            seq.append(int(np.argmax(forward(w, cfg, seq)[-1])))
        assert seq[len(ids):] == p["greedy_ids"], (seq[len(ids):], p["greedy_ids"])
    print("numpy Qwen3-MoE forward matches transformers' reference")


def main() -> None:
    cfg = json.loads((SRC / "config.json").read_text())
    cfg["num_experts"] = cfg.get("num_experts", cfg["num_local_experts"])
    src_ref = json.loads((SRC / "reference.json").read_text())
    prompts = src_ref["prompts"]
    sd = {}
    for f in sorted(SRC.glob("model-*.safetensors")):
        sd.update(load_file(f))
    check_forward(sd, cfg, src_ref)
    scales = calibrated_input_scales(sd, cfg, prompts[0]["input_ids"])
    tensors, deq = dict(sd), {k: v.astype(np.float64) for k, v in sd.items()}
    for prefix, _, _ in linears(cfg):
        parts, dq = fp8_tensor(sd[f"{prefix}.weight"].astype(np.float32), scales[prefix])
        del tensors[f"{prefix}.weight"]
        tensors.update({f"{prefix}.{part}": t for part, t in parts.items()})
        deq[f"{prefix}.weight"] = dq.astype(np.float64)
    scales = clear_of_ties(deq, cfg, prompts, scales)
    for prefix in scales:
        tensors[f"{prefix}.input_scale"] = np.array([scales[prefix]], np.float32)
    dense = [f"model.layers.{i}.mlp.{lin}" for i in range(cfg["num_hidden_layers"])
             if not sparse(cfg, i) for lin in EXPERT]
    write_folder(OUT, SRC, tensors, fp8_static_config(["lm_head", "re:.*mlp.gate$"] + dense))
    write(OUT, "moe-fp8-static",
          "numpy float64 forward of the checkpoint's weights (q * scale), f32 inputs",
          deq, cfg, prompts)
    write(OUT, "moe-fp8-static",
          "numpy float64 forward of the checkpoint's weights, inputs E4M3 with the merged static scales",
          deq, cfg, prompts, linear_input=static_inputs(merged_scales(scales, cfg)),
          name="w8a8-reference.json")


def deepseek_v3_block_fp8() -> None:
    """quant/deepseek-v3-fp8-block: tiny-deepseek-v3 in DeepSeek-V3's own FP8 layout, every linear
    of the decoder layers (latent attention, dense MLP, experts, shared expert) E4M3 with a
    `weight_scale_inv` per 128 x 128 block, the routers and their score-correction biases f32,
    and transformers' reference of the weights dequantized with the format's formula."""
    import make_moe_fixtures
    import torch
    from make_quant_fixtures import fp8_block
    from make_quant_fixtures import reference as transformers_reference

    torch.set_num_threads(1)
    src = FIXTURES / "tiny-deepseek-v3"
    out = FIXTURES / "quant" / "deepseek-v3-fp8-block"
    sd = load_file(src / "model.safetensors")
    tensors, deq = dict(sd), dict(sd)
    for name, w in sd.items():
        if decoder_linear(name):
            parts, dq = fp8_block(w.astype(np.float32))
            prefix = name[: -len(".weight")]
            tensors.update({f"{prefix}.{part}": t for part, t in parts.items()})
            deq[name] = dq.astype(np.float32)
    write_folder(out, src, tensors, {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    cfg = json.loads((src / "config.json").read_text())
    prompts = json.loads((src / "reference.json").read_text())["prompts"]
    with tempfile.TemporaryDirectory() as tmp:
        model = dequantized_model(src, deq, Path(tmp))
        ref = transformers_reference(cfg, deq, prompts, model=model)
        for p in ref["prompts"]:
            seq = p["input_ids"] + p["greedy_ids"]
            p["router_unstable_tokens"] = make_moe_fixtures.router_unstable(model, seq)
        w8a8 = w8a8_reference(model, cfg, deq, prompts)
    ref.update(model="tiny-deepseek-v3", format="deepseek-v3-fp8-block")
    (out / "reference.json").write_text(json.dumps(ref) + "\n")
    print("deepseek-v3-fp8-block min margins", [round(p["min_margin"], 4) for p in ref["prompts"]],
          "unstable router tokens", [p["router_unstable_tokens"] for p in ref["prompts"]])
    (out / "w8a8-reference.json").write_text(json.dumps(w8a8) + "\n")
    print("deepseek-v3-fp8-block w8a8 min margins",
          [round(p["min_margin"], 4) for p in w8a8["prompts"]],
          "closest ties", [f"{p['closest_tie']:.1e}" for p in w8a8["prompts"]])


def hooked_rows(model, cfg: dict, deq: dict, prompts: list, rounders: dict) -> list:
    """transformers' reference rows (make_quant_fixtures.reference, each with `closest_tie`) of
    `model` with `torch.nn.functional.linear` patched: while module `name` of `rounders` runs, each
    product's input x (numpy f32) becomes `rounders[name](x, weight)`, but for a weight whose inputs
    are not whole runs of 32 (the tiny q_b_proj's 24), which Arbor stores dequantized and multiplies
    with f32 inputs."""
    import torch
    from make_quant_fixtures import reference as transformers_reference

    linear, stack, hooks = torch.nn.functional.linear, [], []

    def rounded_linear(x, w, b=None):
        if stack and w.shape[1] % 32 == 0:
            x = torch.from_numpy(stack[-1](x.detach().numpy(), w).astype(np.float32))
        return linear(x, w, b)

    def scoped(rounder):
        def enter(*_):
            stack.append(rounder)

        def leave(*_):  # a forward hook's return value would replace the output
            stack.pop()

        return enter, leave

    for name, mod in model.named_modules():
        if name in rounders:
            enter, leave = scoped(rounders[name])
            hooks += [mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave)]
    torch.nn.functional.linear = rounded_linear
    try:
        rows = []
        for p in prompts:
            closest_tie[0] = np.inf
            rows += transformers_reference(cfg, deq, [p], model=model)["prompts"]
            rows[-1]["closest_tie"] = closest_tie[0]
    finally:
        torch.nn.functional.linear = linear
        for h in hooks:
            h.remove()
    assert not stack
    return rows


def w8a8_reference(model, cfg: dict, deq: dict, prompts: list) -> dict:
    """transformers' reference of a DeepSeek-V3 model under `--quantization w8a8_fp8` as Arbor
    runs it: the input of every product that keeps FP8 weights is rounded to E4M3 per run of 32
    (make_w8a8_fixture.inputs): latent attention's q_a, q_b, kv_a and o projections, the dense
    MLP's and shared expert's three linears, and every expert's gate/up and down products.
    kv_b_proj's per-head up-projections are float and are not rounded (`hooked_rows`)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts, DeepseekV3MLP

    rounders = {name: lambda x, w: inputs(x) for name, mod in model.named_modules()
                if isinstance(mod, (DeepseekV3Experts, DeepseekV3MLP))
                or name.endswith(ROUNDED_ATTENTION)}
    rows = hooked_rows(model, cfg, deq, prompts, rounders)
    return {"model": "tiny-deepseek-v3", "format": "deepseek-v3-fp8-block w8a8",
            "reference": "transformers (f32) on the dequantized weights, FP8 products' inputs E4M3 per 32",
            "prompts": rows}


def moe_weight_only() -> None:
    """quant/moe-fp8-block, moe-gptq, moe-awq and moe-nvfp4: tiny-qwen3-moe in the formats its
    published quantizations use (Qwen/Qwen3-30B-A3B-FP8: block FP8 with `weight_scale_inv` per
    128 x 128; Qwen/Qwen3-30B-A3B-GPTQ-Int4: GPTQ 4-bit symmetric; AutoAWQ 4-bit GEMM;
    nvidia/Qwen3-30B-A3B-FP4: ModelOpt NVFP4), INT4 in groups of 32 (16 for NVFP4),
    on every linear of the decoder layers, experts and the dense MLP included, the routers f32
    (loaded in f32 whatever the method); each reference is the numpy forward of the weights
    dequantized with the format's formula (make_quant_fixtures' writers check their packing);
    moe-fp8-block also has w8a8-reference.json, its inputs rounded per 32 as under
    `--quantization w8a8_fp8`."""
    from make_quant_fixtures import awq, fp8_block, gptq, nvfp4

    formats = {
        "moe-fp8-block": (fp8_block, "q * scale_inv per 128 x 128 block",
                          {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}),
        "moe-gptq": (lambda w: gptq(w, g=32, sym=True), "(q - z) * s",
                     {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                      "sym": True, "checkpoint_format": "gptq"}),
        "moe-awq": (lambda w: awq(w, g=32), "(q - z) * s",
                    {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                     "version": "gemm", "modules_to_not_convert": None}),
        "moe-nvfp4": (nvfp4, "e2m1 * e4m3 block scale * global scale",
                      {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                       "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}),
    }
    cfg = json.loads((SRC / "config.json").read_text())
    cfg["num_experts"] = cfg.get("num_experts", cfg["num_local_experts"])
    prompts = json.loads((SRC / "reference.json").read_text())["prompts"]
    sd = {}
    for f in sorted(SRC.glob("model-*.safetensors")):
        sd.update(load_file(f))
    for fmt, (quantize, formula, qc) in formats.items():
        out = FIXTURES / "quant" / fmt
        tensors, deq = dict(sd), {k: v.astype(np.float64) for k, v in sd.items()}
        for name, w in sd.items():
            if decoder_linear(name):
                parts, dq = quantize(w.astype(np.float32))
                prefix = name[: -len(".weight")]
                del tensors[name]
                tensors.update({f"{prefix}.{part}": t for part, t in parts.items()})
                deq[name] = dq.astype(np.float64)
        write_folder(out, SRC, tensors, qc)
        write(out, fmt, f"numpy float64 forward of the weights dequantized as {formula}",
              deq, cfg, prompts)
        if fmt == "moe-fp8-block":
            # Under --quantization w8a8_fp8 every decoder linear's input (each expert's
            # included) is rounded to E4M3 per run of 32 (make_w8a8_fixture.inputs).
            write(out, fmt, "numpy float64 forward of the dequantized weights, inputs E4M3 per 32",
                  deq, cfg, prompts, linear_input=lambda kind, layer, e, x: inputs(x),
                  name="w8a8-reference.json")


def deepseek_model(folder: Path):
    """transformers' DeepseekV3ForCausalLM of `folder` in f32 with eager attention and experts (a
    loop of `torch.nn.functional.linear` per expert, which the W8A8 references hook)."""
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.config._experts_implementation == "eager"
    return model.eval()


def dequantized_model(src: Path, deq: dict, tmp: Path):
    """`deepseek_model` of the folder `src` with its weights replaced by `deq`, written to `tmp`."""
    for f in ["config.json"] + COPIED:
        shutil.copy(src / f, tmp / f)
    save_file({k: np.ascontiguousarray(v) for k, v in deq.items()}, tmp / "model.safetensors")
    return deepseek_model(tmp)


def deepseek_calibration(model, ids: list) -> dict:
    """max |x| of each linear's input over `ids`, by module prefix, as llm-compressor's min-max
    observer with every token sent to every expert: an expert's gate/up see the whole block input,
    its down_proj its own activation of every token."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    amax, hooks = {}, []

    def observe(prefix):
        def hook(mod, args):
            x = args[0].detach()
            amax[prefix] = max(amax.get(prefix, 0.0), float(x.abs().max()))
            if isinstance(mod, DeepseekV3Experts):
                inter = mod.gate_up_proj.shape[1] // 2
                for e in range(mod.gate_up_proj.shape[0]):
                    gate, up = torch.nn.functional.linear(x, mod.gate_up_proj[e]).split(inter, -1)
                    act = torch.nn.functional.silu(gate) * up
                    key = f"{prefix}.{e}.down_proj"
                    amax[key] = max(amax.get(key, 0.0), float(act.abs().max()))
        return hook

    for name, mod in model.named_modules():
        if name.endswith(("_proj", "_proj_with_mqa")) or isinstance(mod, DeepseekV3Experts):
            hooks.append(mod.register_forward_pre_hook(observe(name)))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return amax


# Factors on the calibrated scales (make_quant_fixtures.CALIBRATED's idea): q_a_proj below
# kv_a_proj_with_mqa (they share an input; the merged scale is kv_a's), gate below up, down_proj at
# half its range, and expert e's further times (1 - 0.08 e).
DEEPSEEK_FACTOR = {"q_a_proj": 0.7, "gate_proj": 0.7, "down_proj": 0.5}


def deepseek_scales(sd: dict, amax: dict) -> dict:
    """The static input scale of every `*_proj` of the decoder layers."""
    scales = {}
    for name in sd:
        if not decoder_linear(name):
            continue
        prefix = name[: -len(".weight")]
        module, lin = prefix.rsplit(".", 1)
        factor = DEEPSEEK_FACTOR.get(lin, 1.0)
        if ".experts." in prefix:
            block, e = module.rsplit(".", 1)
            a = amax[f"{block}.{e}.down_proj"] if lin == "down_proj" else amax[block]
            factor *= 1.0 - 0.08 * int(e)
        else:
            a = amax[prefix]
        scales[prefix] = float(np.float32(a / 448.0 * factor))
    return scales


def deepseek_static_reference(model, cfg: dict, deq: dict, prompts: list, scales: dict) -> list:
    """transformers' reference under `--quantization w8a8_fp8` with static input scales, as Arbor
    runs it: q_a_proj and kv_a_proj_with_mqa with the larger of their scales, q_b_proj and o_proj
    their own; a dense or shared MLP's gate/up with the larger of theirs, down_proj its own; every
    expert's gate/up with the largest gate/up scale of the block's experts, its down input with the
    largest down scale; kv_b_proj's per-head up-projections float (`hooked_rows`)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    rounders = {}
    for name, mod in model.named_modules():
        if isinstance(mod, DeepseekV3Experts):
            own = [(k, v) for k, v in scales.items() if k.startswith(f"{name}.")]
            up = max(v for k, v in own if not k.endswith("down_proj"))
            down = max(v for k, v in own if k.endswith("down_proj"))
            inter = mod.down_proj.shape[2]
            scale_of = lambda w, up=up, down=down, inter=inter: down if w.shape[1] == inter else up
        elif name.endswith(("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")):
            attn = name.rsplit(".", 1)[0]
            merged = max(scales[f"{attn}.q_a_proj"], scales[f"{attn}.kv_a_proj_with_mqa"])
            scale_of = lambda w, s=merged: s
        elif name.endswith(("self_attn.q_b_proj", "self_attn.o_proj")):
            scale_of = lambda w, s=scales[name]: s
        elif name.endswith(("mlp.gate_proj", "mlp.up_proj", "shared_experts.gate_proj",
                            "shared_experts.up_proj")):
            mlp = name.rsplit(".", 1)[0]
            scale_of = lambda w, s=max(scales[f"{mlp}.gate_proj"], scales[f"{mlp}.up_proj"]): s
        elif name.endswith(("mlp.down_proj", "shared_experts.down_proj")):
            scale_of = lambda w, s=scales[name]: s
        else:
            continue
        rounders[name] = lambda x, w, scale_of=scale_of: round_static(x, scale_of(w))
    return hooked_rows(model, cfg, deq, prompts, rounders)


def deepseek_v3_fp8_static() -> None:
    """quant/deepseek-v3-fp8-static: tiny-deepseek-v3 as an llm-compressor FP8 checkpoint with
    static input scales (compressed-tensors, tensor strategy, `weight_scale [1]` and `input_scale
    [1]` on every `*_proj` of the decoder layers; routers f32), calibrated on the first prompt
    (`deepseek_calibration`, `DEEPSEEK_FACTOR`), then times the first slack of 1, 1.01, ... that
    leaves the first prompt's W8A8 forwards clear of E4M3 ties (NEAR_TIE) and greedy near-ties.
    reference.json: transformers on the dequantized weights; w8a8-reference.json:
    `deepseek_static_reference`."""
    import torch
    from make_quant_fixtures import reference as transformers_reference

    torch.set_num_threads(1)
    src = FIXTURES / "tiny-deepseek-v3"
    out = FIXTURES / "quant" / "deepseek-v3-fp8-static"
    sd = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    prompts = json.loads((src / "reference.json").read_text())["prompts"]
    calibrated = deepseek_scales(sd, deepseek_calibration(deepseek_model(src), prompts[0]["input_ids"]))
    tensors, deq = dict(sd), dict(sd)
    for prefix, scale in calibrated.items():
        parts, dq = fp8_tensor(sd[f"{prefix}.weight"].astype(np.float32), scale)
        del tensors[f"{prefix}.weight"]
        tensors.update({f"{prefix}.{part}": t for part, t in parts.items()})
        deq[f"{prefix}.weight"] = dq.astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        model = dequantized_model(src, deq, Path(tmp))
        for j in range(30):
            scales = {k: float(np.float32(v * (1 + 0.01 * j))) for k, v in calibrated.items()}
            first = deepseek_static_reference(model, cfg, deq, prompts[:1], scales)[0]
            if first["closest_tie"] >= NEAR_TIE and first["min_margin"] >= MIN_MARGIN:
                print(f"calibration slack {1 + 0.01 * j:.2f}: closest tie {first['closest_tie']:.1e}")
                break
        else:
            raise SystemExit("no calibration slack up to 1.29 keeps the first prompt clear of ties")
        ref = transformers_reference(cfg, deq, prompts, model=model)
        rows = deepseek_static_reference(model, cfg, deq, prompts, scales)
    for prefix, scale in scales.items():
        tensors[f"{prefix}.input_scale"] = np.array([scale], np.float32)
    write_folder(out, src, tensors, fp8_static_config(["lm_head", "re:.*mlp.gate$"]))
    ref.update(model="tiny-deepseek-v3", format="deepseek-v3-fp8-static")
    (out / "reference.json").write_text(json.dumps(ref) + "\n")
    w8a8 = {"model": "tiny-deepseek-v3", "format": "deepseek-v3-fp8-static w8a8",
            "reference": "transformers (f32) on the dequantized weights, FP8 products' inputs E4M3 "
                         "with the merged static scales", "prompts": rows}
    (out / "w8a8-reference.json").write_text(json.dumps(w8a8) + "\n")
    print("deepseek-v3-fp8-static min margins", [round(p["min_margin"], 4) for p in ref["prompts"]],
          "w8a8 min margins", [round(p["min_margin"], 4) for p in rows],
          "closest ties", [f"{p['closest_tie']:.1e}" for p in rows])


if __name__ == "__main__":
    main()
    deepseek_v3_block_fp8()
    moe_weight_only()
    deepseek_v3_fp8_static()
