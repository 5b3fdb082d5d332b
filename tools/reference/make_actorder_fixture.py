#!/usr/bin/env python3
"""tests/fixtures/quant/w4a16-actorder: the w4a16 fixture (compressed-tensors `pack-quantized`
symmetric int4, group 32) written the way llm-compressor writes act-order checkpoints
(`actorder: "group"`): every quantized linear layer gains `weight_g_idx` I32 `[k]`, the group
of each input, and its `weight_scale` columns are stored in that order.

Each layer's groups are renumbered by a random permutation `p` (seeded): input `c`, which the
plain layout puts in group `c // 32`, gets `weight_g_idx[c] = p[c // 32]`, and scale column
`p[j]` holds what column `j` held. The packed weights are unchanged. By the format's definition
(value = (u - 8) x weight_scale[r, weight_g_idx[c]]) every weight dequantizes to exactly what it
did in w4a16, which this script checks in numpy, so w4a16's reference.json (transformers on those
dequantized weights) is this fixture's reference too. A loader that ignored `weight_g_idx` would
read the permuted scales and miss the reference.

    python tools/reference/make_actorder_fixture.py   (numpy, ml_dtypes)
"""

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors_np import load_file, save_file

QUANT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "quant"
SRC = QUANT / "w4a16"
OUT = QUANT / "w4a16-actorder"
GROUP = 32


def unpack(words: np.ndarray, k: int) -> np.ndarray:
    """`weight_packed [n, k/8]` I32 -> stored nibbles u `[n, k]` (element c in bits 4 (c % 8))."""
    w = words.view(np.uint32)
    shifts = (4 * np.arange(8, dtype=np.uint32))[None, None, :]
    return ((w[:, :, None] >> shifts) & 0xF).reshape(w.shape[0], -1)[:, :k].astype(np.float32)


def dequant(parts: dict, prefix: str, g_idx: np.ndarray) -> np.ndarray:
    n, k = (int(x) for x in parts[f"{prefix}.weight_shape"])
    u = unpack(parts[f"{prefix}.weight_packed"], k)
    scale = parts[f"{prefix}.weight_scale"].astype(np.float32)
    return (u - 8.0) * scale[:, g_idx]


def main() -> None:
    src = load_file(SRC / "model.safetensors")
    out = dict(src)
    rng = np.random.default_rng(20261204)
    layers = sorted(name[: -len(".weight_packed")] for name in src if name.endswith(".weight_packed"))
    for prefix in layers:
        n, k = (int(x) for x in src[f"{prefix}.weight_shape"])
        groups = k // GROUP
        perm = rng.permutation(groups)
        while groups > 1 and np.all(perm == np.arange(groups)):
            perm = rng.permutation(groups)
        scale = src[f"{prefix}.weight_scale"]
        moved = np.empty_like(scale)
        moved[:, perm] = scale
        g_idx = perm[np.arange(k) // GROUP].astype(np.int32)
        out[f"{prefix}.weight_scale"] = moved
        out[f"{prefix}.weight_g_idx"] = g_idx
        plain = dequant(src, prefix, np.arange(k) // GROUP)
        ordered = dequant(out, prefix, g_idx)
        assert np.array_equal(plain, ordered), prefix
        if groups > 1:
            assert not np.array_equal(plain, dequant(out, prefix, np.arange(k) // GROUP)), prefix
    OUT.mkdir(parents=True, exist_ok=True)
    save_file(out, OUT / "model.safetensors")
    again = load_file(OUT / "model.safetensors")
    assert all(np.array_equal(again[x].view(np.uint8), np.ascontiguousarray(out[x]).view(np.uint8))
               for x in out), "round trip"
    cfg = json.loads((SRC / "config.json").read_text())
    for group in cfg["quantization_config"]["config_groups"].values():
        group["weights"]["actorder"] = "group"
    (OUT / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in SRC.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, OUT / f.name)
    print(f"{OUT}: {len(layers)} layers with weight_g_idx")


if __name__ == "__main__":
    main()
