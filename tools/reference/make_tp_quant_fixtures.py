#!/usr/bin/env python3
"""tests/fixtures/quant/tp-fp8 and tp-gptq8: pre-quantized checkpoints whose every linear splits
over two tensor-parallel ranks into whole blocks of 32 inputs, for Arbor's tensor-parallel loading
of quantized checkpoints (crates/models/src/shard.rs), with reference logits from the numpy
forward of make_kv_scales_fixture.py (float64, written from the Llama definition and checked there
against tiny-llama's transformers reference).

The model is tiny-llama with its MLP widened from 160 to 192 (gate/up gain 32 rows, down_proj 32
columns, drawn with each matrix's own standard deviation), so that down_proj's share at
--tp-size 2 is 96 inputs (tiny-llama's 80 would cut a block of 32). The seven linears of every
decoder layer are quantized; embeddings, norms and lm_head stay f32.

| folder | format |
|---|---|
| tp-fp8 | compressed-tensors `float-quantized`: E4M3 `weight`, bf16 `weight_scale [n, 1]` (channel strategy), static f32 `input_scale [1]` calibrated as make_quant_fixtures.py's fp8-static |
| tp-gptq8 | 8-bit GPTQ, symmetric, group 32 (make_gptq8_fixture.py's layout: I32 `qweight [k/4, n]`, `qzeros`, f16 `scales`, `g_idx`) |

Each folder's reference.json holds, per prompt of tiny-llama's reference, the last position's
logits and 32 greedy tokens with their margins (weights dequantized with the format's formula,
f32 inputs); tp-fp8's w8a8-reference.json is its reference under `--quantization w8a8_fp8`, each
linear's input rounded with its static scale (make_w8a8_fixture.py's arithmetic).

    python tools/reference/make_tp_quant_fixtures.py   (numpy, ml_dtypes)
"""

import json
import shutil

import ml_dtypes
import numpy as np
from make_gptq8_fixture import COPIED, LINEARS, gptq8, reference
from make_kv_scales_fixture import observed_input_amax
from make_w8a8_fixture import FIXTURES, SRC, closest_tie, e4m3, load, static_inputs, write
from safetensors_np import save_file

WIDE = 192
OUT = FIXTURES / "quant"


def widened(sd: dict, cfg: dict) -> dict:
    """tiny-llama's weights with the MLP widened to WIDE."""
    rng = np.random.default_rng(192)
    w = dict(sd)
    extra = WIDE - cfg["intermediate_size"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp"
        for lin in ("gate_proj", "up_proj"):
            m = sd[f"{p}.{lin}.weight"].astype(np.float32)
            rows = rng.normal(0, m.std(), (extra, m.shape[1])).astype(np.float32)
            w[f"{p}.{lin}.weight"] = np.concatenate([m, rows], 0)
        m = sd[f"{p}.down_proj.weight"].astype(np.float32)
        cols = rng.normal(0, m.std(), (m.shape[0], extra)).astype(np.float32)
        w[f"{p}.down_proj.weight"] = np.concatenate([m, cols], 1)
    return w


def fp8_channel(w: np.ndarray):
    s = (np.abs(w).max(axis=1, keepdims=True) / 448.0).astype(ml_dtypes.bfloat16)
    q = e4m3((w / s.astype(np.float32)).astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
    return {"weight": q, "weight_scale": s}, q.astype(np.float64) * s.astype(np.float64)


def save(name: str, cfg: dict, qc: dict, tensors: dict, deq: dict, prompts: list) -> None:
    d = OUT / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc), indent=2) + "\n")
    for f in COPIED:
        shutil.copy(SRC / f, d / f)
    ref = {"model": "tiny-llama (MLP 192)", "format": name, "reference": "numpy float64 forward",
           "prompts": reference(deq, cfg, prompts)}
    (d / "reference.json").write_text(json.dumps(ref) + "\n")
    print(name, "min margins", [round(p["min_margin"], 4) for p in ref["prompts"]])


def main() -> None:
    cfg = json.loads((SRC / "config.json").read_text())
    prompts = json.loads((SRC / "reference.json").read_text())["prompts"]
    sd = widened(load(SRC), cfg)
    cfg = dict(cfg, intermediate_size=WIDE)
    # max |x| / 448 of each linear-input call over the first prompt (forward's hook order).
    scales = [float(np.float32(a / 448.0))
              for a in observed_input_amax(sd, cfg, prompts[0]["input_ids"])]
    slot = {"self_attn.q_proj": 0, "self_attn.k_proj": 0, "self_attn.v_proj": 0,
            "self_attn.o_proj": 1, "mlp.gate_proj": 2, "mlp.up_proj": 2, "mlp.down_proj": 3}
    fp8, fp8_deq = dict(sd), {k: v.astype(np.float64) for k, v in sd.items()}
    gq, gq_deq = dict(sd), dict(fp8_deq)
    for layer in range(cfg["num_hidden_layers"]):
        for lin in LINEARS:
            p = f"model.layers.{layer}.{lin}"
            w = sd[f"{p}.weight"].astype(np.float32)
            del fp8[f"{p}.weight"], gq[f"{p}.weight"]
            parts, fp8_deq[f"{p}.weight"] = fp8_channel(w)
            parts["input_scale"] = np.array([scales[4 * layer + slot[lin]]], np.float32)
            fp8.update({f"{p}.{k}": v for k, v in parts.items()})
            parts, gq_deq[f"{p}.weight"] = gptq8(w, True)
            gq.update({f"{p}.{k}": v for k, v in parts.items()})
    scheme = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
              "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
            "dynamic": False}
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "quantization_status": "compressed", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme,
                                        "input_activations": acts}}}
    save("tp-fp8", dict(cfg, torch_dtype="bfloat16"), ct, fp8, fp8_deq, prompts)
    closest_tie[0] = np.inf
    write(OUT / "tp-fp8" / "w8a8-reference.json", "tp-fp8 w8a8",
          "numpy float64 forward of the checkpoint's weights, inputs E4M3 with the static scales",
          fp8_deq, cfg, prompts, linear_input=static_inputs(scales))
    gptq = {"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": False, "sym": True,
            "checkpoint_format": "gptq"}
    save("tp-gptq8", dict(cfg, torch_dtype="float16"), gptq, gq, gq_deq, prompts)


if __name__ == "__main__":
    main()
