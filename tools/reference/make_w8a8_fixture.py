#!/usr/bin/env python3
"""tests/fixtures/quant/w8a8-online.json: the reference of tiny-llama served with
`--quantization w8a8_fp8` (W8A8 FP8), fp8-dynamic/w8a8-reference.json: that of the
compressed-tensors FP8 checkpoint fp8-dynamic (its E4M3 weights times their per-channel scales)
served with `--quantization w8a8_fp8`, and fp8-static/w8a8-reference.json: that of the checkpoint
with static input scales, whose inputs are rounded with those scales instead (each input of a
layer group, Q/K/V or gate/up, with the largest of the group's); all from the numpy float64
forward of make_kv_scales_fixture.py (written from the Llama definition and checked there against
tiny-llama's transformers reference).

W8A8 FP8 as Arbor defines it, for the seven linears of every decoder layer (lm_head, embeddings
and norms stay f32):
- the weight is quantized at load as `--quantization fp8` does: one scale per output channel,
  s = amax / 448 in f32, q = e4m3(w / s) (nearest even), the weight being q * s;
- the input is quantized before the product: each run of 32 inputs of a row becomes
  e4m3(x * (448 / amax)) with the scale amax / 448 (f32 arithmetic, as the kernels do; a run of
  zeros stays zero), the linear multiplying code * scale.
The rest of the forward is float64. reference.json's layout is make_quant_fixtures.py's: per
prompt of tiny-llama's reference, the last position's logits and 32 greedy tokens with each
step's top-1 minus top-2 margin; and `closest_tie`, the smallest relative distance of an input
(times 448 / amax) from a midpoint between two E4M3 values over the prompt's forwards: an
input within about 1e-6 of one may round the other way in an f32 forward.

    python tools/reference/make_w8a8_fixture.py   (numpy, ml_dtypes)
"""

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from make_gptq8_fixture import LINEARS, reference
from safetensors_np import load_file

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
SRC = FIXTURES / "tiny-llama"
OUT = FIXTURES / "quant" / "w8a8-online.json"
CT = FIXTURES / "quant" / "fp8-dynamic"
STATIC = FIXTURES / "quant" / "fp8-static"
F8 = ml_dtypes.float8_e4m3fn
E4M3_MAX = np.float32(448.0)


def e4m3(x: np.ndarray) -> np.ndarray:
    """x (f32) rounded to the nearest E4M3 value (ties to even), saturating at +-448, as f32."""
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(F8).astype(np.float32)


def weight_rows(w: np.ndarray) -> np.ndarray:
    """What --quantization fp8 (and w8a8_fp8) stores: per output channel amax/448 in f32."""
    amax = np.abs(w).max(axis=1, keepdims=True).astype(np.float32)
    s = np.where(amax > 0, amax / E4M3_MAX, np.float32(1.0)).astype(np.float32)
    return (e4m3((w / s).astype(np.float32)) * s).astype(np.float64)


# The smallest relative distance of a scaled input from a midpoint between two E4M3 values seen
# since the last reset: an input that close may round the other way in another f32 forward.
closest_tie = [np.inf]


def tie_distance(v: np.ndarray) -> float:
    a = np.abs(v.astype(np.float64)).ravel()
    a = a[(a > 0) & (a < E4M3_MAX)]  # larger ones saturate to 448
    if a.size == 0:
        return np.inf
    # Steps of 2^(e - 3) for normals (2^-6 and up), 2^-9 below.
    step = 2.0 ** (np.floor(np.log2(np.maximum(a, 2.0 ** -6))) - 3)
    frac = a / step
    return float((np.abs(frac - np.floor(frac) - 0.5) * step / a).min())


def inputs(x: np.ndarray) -> np.ndarray:
    """Each run of 32 inputs of a row (f32) as E4M3 codes times the run's scale amax / 448."""
    shape = x.shape
    runs = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(runs).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, E4M3_MAX / amax, np.float32(0.0)).astype(np.float32)
    scale = (amax / E4M3_MAX).astype(np.float32)
    scaled = (runs * inv).astype(np.float32)
    closest_tie[0] = min(closest_tie[0], tie_distance(scaled))
    return (e4m3(scaled) * scale).astype(np.float64).reshape(shape)


def static_inputs(scales: list):
    """The `linear_input` of make_kv_scales_fixture.forward for static input scales: its calls
    feed, per layer, Q/K/V, o_proj, gate/up and down_proj; `scales` holds each call's scale (the
    largest of the layers it feeds, as vLLM and SGLang fuse them). Each input becomes
    e4m3(x * (1 / s)) * s (f32 arithmetic, saturating at 448)."""
    calls = [0]

    def rounded(x: np.ndarray) -> np.ndarray:
        s = np.float32(scales[calls[0] % len(scales)])
        calls[0] += 1
        scaled = (x.astype(np.float32) * (np.float32(1.0) / s)).astype(np.float32)
        closest_tie[0] = min(closest_tie[0], tie_distance(scaled))
        return (e4m3(scaled) * s).astype(np.float64)

    return rounded


def load(folder: Path) -> dict:
    w = {}
    for f in sorted(folder.glob("*.safetensors")):
        w.update(load_file(f))
    return w


def write(out: Path, name: str, about: str, w: dict, cfg: dict, prompts: list,
          linear_input=inputs) -> None:
    """reference.json's prompts, each with `closest_tie`: the smallest relative distance of any
    of its scaled inputs (last logits and greedy steps) from an E4M3 rounding midpoint."""
    rows = []
    for p in prompts:
        closest_tie[0] = np.inf
        rows += reference(w, cfg, [p], linear_input=linear_input)
        rows[-1]["closest_tie"] = closest_tie[0]
    ref = {"model": "tiny-llama", "format": name, "reference": about, "prompts": rows}
    out.write_text(json.dumps(ref) + "\n")
    print(name, "min margins", [round(p["min_margin"], 4) for p in rows],
          "closest ties", [f"{p['closest_tie']:.1e}" for p in rows])


def main() -> None:
    cfg = json.loads((SRC / "config.json").read_text())
    prompts = json.loads((SRC / "reference.json").read_text())["prompts"]
    w = {k: v.astype(np.float64) for k, v in load(SRC).items()}
    for layer in range(cfg["num_hidden_layers"]):
        for lin in LINEARS:
            name = f"model.layers.{layer}.{lin}.weight"
            w[name] = weight_rows(w[name].astype(np.float32))
    write(OUT, "w8a8-online", "numpy float64 forward, E4M3 weights per channel and inputs per 32",
          w, cfg, prompts)
    # The compressed-tensors FP8 checkpoint (E4M3 weights, bf16 scales per channel) under
    # --quantization w8a8_fp8: its weights dequantized with the format's formula (q * scale).
    ct = load(CT)
    w = {k: v.astype(np.float64) for k, v in ct.items() if not k.endswith("_scale")}
    for layer in range(cfg["num_hidden_layers"]):
        for lin in LINEARS:
            p = f"model.layers.{layer}.{lin}"
            q = ct[f"{p}.weight"].astype(np.float32)
            s = ct[f"{p}.weight_scale"].astype(np.float32).reshape(-1, 1)
            w[f"{p}.weight"] = (q * s).astype(np.float64)
    write(CT / "w8a8-reference.json", "fp8-dynamic w8a8",
          "numpy float64 forward of the checkpoint's weights, inputs E4M3 per 32", w, cfg, prompts)
    # The compressed-tensors FP8 checkpoint with static input scales (E4M3 weights, one f32
    # scale per tensor, a calibrated input_scale per layer) under --quantization w8a8_fp8.
    st = load(STATIC)
    w = {k: v.astype(np.float64) for k, v in st.items() if not k.endswith("_scale")}
    scales = []
    for layer in range(cfg["num_hidden_layers"]):
        for lin in LINEARS:
            p = f"model.layers.{layer}.{lin}"
            q = st[f"{p}.weight"].astype(np.float32)
            w[f"{p}.weight"] = (q * st[f"{p}.weight_scale"].astype(np.float32)[0]).astype(np.float64)
        s = lambda lin: float(st[f"model.layers.{layer}.{lin}.input_scale"][0])
        scales += [max(s("self_attn.q_proj"), s("self_attn.k_proj"), s("self_attn.v_proj")),
                   s("self_attn.o_proj"), max(s("mlp.gate_proj"), s("mlp.up_proj")),
                   s("mlp.down_proj")]
    write(STATIC / "w8a8-reference.json", "fp8-static w8a8",
          "numpy float64 forward of the checkpoint's weights, inputs E4M3 with the static scales",
          w, cfg, prompts, linear_input=static_inputs(scales))


if __name__ == "__main__":
    main()
