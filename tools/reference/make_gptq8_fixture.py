#!/usr/bin/env python3
"""tests/fixtures/quant/gptq8 and gptq8-asym: tiny-llama quantized with 8-bit GPTQ, and their
reference logits from the numpy forward of make_kv_scales_fixture.py (float64, written from the
Llama definition and checked there against tiny-llama's transformers reference).

The format (AutoGPTQ / GPTQModel with `bits: 8`, `checkpoint_format: gptq`, `desc_act: false`):
I32 `qweight [k/4, n]` holds four inputs per word (input 4j + i of output c in bits 8i of word
[j, c]); I32 `qzeros [k/g, n/4]` four outputs per word in order (output 4j + i in bits 8i), each
stored as its zero point minus one; f16 `scales [k/g, n]`; I32 `g_idx [k]` (input c in group
c // g). A weight is (q - z) * s.

| folder | quantization |
|---|---|
| gptq8 | symmetric (`sym: true`): zero point 128, s = amax / 127 per group of 32, q = round(w / s) + 128 |
| gptq8-asym | asymmetric: s = (max - min) / 255, z = round(-min / s), q = round(w / s) + z, in 0..255 |

The seven linear layers of every decoder layer are quantized; embeddings, norms and lm_head stay
f32. reference.json has, per prompt of tiny-llama's reference, the last position's logits and 32
greedy tokens with each step's top-1 minus top-2 margin, as make_quant_fixtures.py writes them.

    python tools/reference/make_gptq8_fixture.py   (numpy, ml_dtypes)
"""

import json
import shutil
from pathlib import Path

import numpy as np
from make_kv_scales_fixture import forward
from safetensors_np import load_file, save_file

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
SRC = FIXTURES / "tiny-llama"
GROUP = 32
NEW_TOKENS = 32
COPIED = ["generation_config.json", "special_tokens_map.json", "tokenizer.json",
          "tokenizer_config.json"]
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def quantize(w: np.ndarray, sym: bool):
    """Per output row and group of GROUP inputs: q in 0..255, zero z, f16 scale s."""
    n, k = w.shape
    wg = w.reshape(n, k // GROUP, GROUP).astype(np.float64)
    if sym:
        amax = np.abs(wg).max(-1)
        s = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float16)
        sf = s.astype(np.float64)[..., None]
        z = np.full((n, k // GROUP), 128, np.int64)
        q = np.clip(np.rint(wg / sf), -128, 127).astype(np.int64) + 128
    else:
        lo, hi = np.minimum(wg.min(-1), 0.0), np.maximum(wg.max(-1), 0.0)
        s = np.where(hi > lo, (hi - lo) / 255.0, 1.0).astype(np.float16)
        sf = s.astype(np.float64)[..., None]
        z = np.clip(np.rint(-lo / s.astype(np.float64)), 0, 255).astype(np.int64)
        q = np.clip(np.rint(wg / sf) + z[..., None], 0, 255).astype(np.int64)
    return q.reshape(n, k), z, s


def gptq8(w: np.ndarray, sym: bool):
    n, k = w.shape
    q, z, s = quantize(w, sym)
    qt = q.T.reshape(k // 4, 4, n).astype(np.uint32)  # input 4j + i of output c at [j, i, c]
    qweight = np.zeros((k // 4, n), np.uint32)
    for i in range(4):
        qweight |= (qt[:, i, :] & 0xFF) << (8 * i)
    zt = (z.T - 1).astype(np.uint32).reshape(k // GROUP, n // 4, 4)  # stored zero - 1
    qzeros = np.zeros((k // GROUP, n // 4), np.uint32)
    for i in range(4):
        qzeros |= (zt[:, :, i] & 0xFF) << (8 * i)
    scales = s.T.copy()  # [k/g, n]
    g_idx = (np.arange(k) // GROUP).astype(np.int32)
    # Unpacked back the way AutoGPTQ's dequantization reads it.
    u = qweight
    iq = np.stack([(u >> (8 * i)) & 0xFF for i in range(4)], 1).reshape(k, n).astype(np.int64)
    uz = qzeros
    iz = np.stack([(uz >> (8 * i)) & 0xFF for i in range(4)], -1).reshape(k // GROUP, n)
    iz = ((iz + 1) & 0x1FF).astype(np.int64)
    assert (iq == q.T).all() and (iz == z.T).all()
    deq = ((iq - iz[g_idx]) * scales.astype(np.float64)[g_idx]).T
    parts = {"qweight": qweight.view(np.int32), "qzeros": qzeros.view(np.int32),
             "scales": scales, "g_idx": g_idx}
    return parts, deq


def reference(w: dict, cfg: dict, prompts: list, linear_input=None, forward_fn=forward) -> list:
    """Per prompt: the last position's logits and NEW_TOKENS greedy tokens with each step's top-1
    minus top-2 margin, from `forward_fn` (the Llama forward unless given)."""
    out = []
    for p in prompts:
        ids = list(p["input_ids"])
        last = forward_fn(w, cfg, ids, linear_input=linear_input)[-1]
        seq, margins = list(ids), []
        for _ in range(NEW_TOKENS):
            lg = forward_fn(w, cfg, seq, linear_input=linear_input)[-1]
            top = np.sort(lg)[-2:]
            margins.append(float(top[1] - top[0]))
            seq.append(int(np.argmax(lg)))
        out.append({"text": p["text"], "input_ids": ids,
                    "last_logits": [float(v) for v in last.astype(np.float32)],
                    "greedy_ids": seq[len(ids):], "margins": margins,
                    "min_margin": min(margins)})
    return out


def main() -> None:
    cfg = json.loads((SRC / "config.json").read_text())
    prompts = json.loads((SRC / "reference.json").read_text())["prompts"]
    sd = {}
    for f in sorted(SRC.glob("model-*.safetensors")):
        sd.update(load_file(f))
    for name, sym in [("gptq8", True), ("gptq8-asym", False)]:
        d = FIXTURES / "quant" / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir()
        tensors, deq = dict(sd), {k: v.astype(np.float64) for k, v in sd.items()}
        for layer in range(cfg["num_hidden_layers"]):
            for lin in LINEARS:
                p = f"model.layers.{layer}.{lin}"
                parts, dq = gptq8(sd[f"{p}.weight"].astype(np.float32), sym)
                del tensors[f"{p}.weight"]
                for part, t in parts.items():
                    tensors[f"{p}.{part}"] = t
                deq[f"{p}.weight"] = dq
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, d / "model.safetensors")
        qc = {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "desc_act": False,
              "sym": sym, "checkpoint_format": "gptq"}
        (d / "config.json").write_text(
            json.dumps(dict(cfg, quantization_config=qc, torch_dtype="float16"), indent=2) + "\n")
        for f in COPIED:
            shutil.copy(SRC / f, d / f)
        ref = {"model": "tiny-llama", "format": name, "reference": "numpy float64 forward",
               "prompts": reference(deq, cfg, prompts)}
        (d / "reference.json").write_text(json.dumps(ref) + "\n")
        print(name, "min margins", [round(p["min_margin"], 4) for p in ref["prompts"]],
              "bytes", (d / "model.safetensors").stat().st_size)


if __name__ == "__main__":
    main()
