#!/usr/bin/env python3
"""The default model (SmolLM2-135M-Instruct, the Q4_1 GGUF `arbor fetch-default` downloads) as a
bf16 Hugging Face folder and as each quantized HF format Arbor loads, for the real-weights check
(crates/models/tests/quantized_default.rs) and the quantization benchmarks (`arbor bench
one-batch`). Not committed: written under OUT (default /tmp/arbor-quant).

    /tmp/torchenv/bin/python tools/reference/make_default_quant.py [OUT [FORMAT ...]]

(only the formats named, when some are; bf16 always).

The GGUF is read by transformers (which dequantizes it and undoes llama.cpp's q/k permutation);
its weights are rounded to bf16 and saved with the tokenizer as OUT/bf16. Each format folder
quantizes those bf16 weights with the quantizers of make_quant_fixtures.py (the same tensor names,
dtypes and packing as the tiny fixtures); groups are 64 inputs (576 = 9 x 64; 128 does not divide
the hidden size). Needs torch, transformers, accelerate, gguf, safetensors, numpy, ml_dtypes.
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_quant_fixtures as q  # noqa: E402

GGUF_DIR = Path.home() / ".cache" / "arbor" / "models"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GROUP = 64

FORMATS = {
    "fp8-block": (q.fp8_block, q.FORMATS["fp8-block"][1]),
    "fp8-dynamic": (q.fp8_channel, q.FORMATS["fp8-dynamic"][1]),
    "w4a16": (lambda w: q.w4a16(w, GROUP), None),
    "awq": (lambda w: q.awq(w, GROUP), dict(q.FORMATS["awq"][1], group_size=GROUP)),
    "gptq": (lambda w: q.gptq(w, GROUP, sym=False), dict(q.FORMATS["gptq"][1], group_size=GROUP)),
}
if hasattr(q, "nvfp4"):
    FORMATS["nvfp4"] = (q.nvfp4, q.FORMATS["nvfp4"][1])
# Per-tensor E4M3 weights with static input scales (llm-compressor's FP8 scheme): each linear's
# input_scale is max |x| / 448 of its inputs over the calibration text (calibrate()).
FORMATS["fp8-static"] = (None, q.FORMATS["fp8-static"][1])
CORPUS = Path(__file__).resolve().parent / "corpus.txt"
# quantized_default.rs scores the first 256 tokens of corpus.txt; the rest calibrates.
SCORED = 256


def calibrate(model, tok) -> dict:
    """max |x| / 448 of every decoder linear's input over corpus.txt after its scored tokens."""
    ids = tok(CORPUS.read_text(), return_tensors="pt").input_ids[:, SCORED:]
    amax, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            def hook(_m, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return {k: float(np.float32(v / 448.0)) for k, v in amax.items()}


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/arbor-quant")
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(str(GGUF_DIR), gguf_file=GGUF, dtype=torch.float32)
    cfg = model.config.to_dict()
    for k in ("quantization_config", "_name_or_path"):
        cfg.pop(k, None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    sd = {k: v.to(torch.bfloat16).float().numpy() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    base = out / "bf16"
    if base.exists():
        shutil.rmtree(base)
    base.mkdir()
    tok.save_pretrained(str(base))
    save_file({k: v.astype(q.ml_dtypes.bfloat16) for k, v in sd.items()}, str(base / "model.safetensors"))
    (base / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    print("bf16", (base / "model.safetensors").stat().st_size)
    linears = list(q.linear_names(cfg))
    scales = calibrate(model, tok)
    only = sys.argv[2:]
    for name, (quantize, qc) in FORMATS.items():
        if only and name not in only:
            continue
        if name == "w4a16":
            qc = q.ct_config({"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP,
                              "symmetric": True, "dynamic": False}, None, "pack-quantized")
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(base, d)
        tensors = {k: v.astype(q.ml_dtypes.bfloat16) for k, v in sd.items()}
        for lin in linears:
            w = sd[f"{lin}.weight"]
            del tensors[f"{lin}.weight"]
            if name == "fp8-static":
                parts, _ = q.fp8_tensor(w, scales[lin])
            else:
                parts, _ = quantize(w)
            for part, t in parts.items():
                tensors[f"{lin}.{part}"] = t
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc), indent=2) + "\n")
        print(name, (d / "model.safetensors").stat().st_size)


if __name__ == "__main__":
    main()
