#!/usr/bin/env python3
"""PyTorch `pytorch_model.bin` fixtures for Arbor's torch checkpoint reader (crates/models
src/torch_bin.rs), written by torch.save itself (the zip format of torch >= 1.6):

* tests/fixtures/torch-bin/mixed.bin: a state dict (OrderedDict) with f32, f16, bf16 and int64
  tensors, a transposed (non-contiguous) view, two views of one shared storage (one at an
  offset) and an nn.Parameter; mixed.json holds every tensor's dtype, shape and values as torch
  reads them (the reference).
* tests/fixtures/torch-bin/nested.bin: {"state_dict": {...}, "epoch": 2}, as training scripts save.
* tests/fixtures/eagle-tiny-llama-bin/: the EAGLE fixture head (tests/fixtures/eagle-tiny-llama)
  as its original checkpoints ship: config.json and pytorch_model.bin with the same tensors.
* tests/fixtures/tiny-llama-bin/: tests/fixtures/tiny-llama with its two safetensors shards
  re-saved as pytorch_model-0000{1,2}-of-00002.bin and pytorch_model.bin.index.json (the layout of
  older Hugging Face checkpoints); every other file (config, tokenizer, reference.json) copied, so
  the transformers parity test runs on it unchanged.

    python tools/reference/make_torch_bin_fixture.py           # (re)write the fixtures
    python tools/reference/make_torch_bin_fixture.py --check   # torch.load them and compare

torch.save output is not byte-stable across torch versions, so --check reloads the written
files with torch.load and compares tensors instead of bytes.
"""

import json
import shutil
import sys
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
OUT = ROOT / "torch-bin"
EAGLE = ROOT / "eagle-tiny-llama"
EAGLE_BIN = ROOT / "eagle-tiny-llama-bin"
LLAMA = ROOT / "tiny-llama"
LLAMA_BIN = ROOT / "tiny-llama-bin"
COPIED = ["config.json", "generation_config.json", "reference.json", "special_tokens_map.json",
          "tokenizer.json", "tokenizer_config.json"]


def llama_shards() -> dict:
    """tiny-llama's safetensors shards by file name, renamed to their torch names."""
    index = json.loads((LLAMA / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    return {f.replace("model-", "pytorch_model-").replace(".safetensors", ".bin"): f for f in files}


def mixed() -> "OrderedDict[str, torch.Tensor]":
    g = torch.Generator().manual_seed(7)
    base = torch.randn(10, generator=g)
    sd = OrderedDict()
    sd["a.f32"] = torch.randn(3, 4, generator=g)
    sd["b.f16"] = torch.randn(5, generator=g).half()
    sd["c.bf16"] = torch.randn(2, 3, generator=g).bfloat16()
    sd["d.i64"] = torch.arange(6, dtype=torch.int64).view(2, 3)
    sd["e.transposed"] = torch.randn(4, 3, generator=g).t()
    sd["f.view"] = base[2:8].view(2, 3)
    sd["g.shared"] = base
    sd["h.param"] = torch.nn.Parameter(torch.randn(2, 2, generator=g))
    assert not sd["e.transposed"].is_contiguous()
    assert sd["f.view"].storage_offset() == 2
    return sd


def describe(sd) -> dict:
    out = {}
    for k, v in sd.items():
        v = v.detach()
        out[k] = {
            "dtype": str(v.dtype).replace("torch.", ""),
            "shape": list(v.shape),
            "values": v.reshape(-1).tolist() if v.dtype == torch.int64 else v.float().reshape(-1).tolist(),
        }
    return out


def write_all() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    sd = mixed()
    torch.save(sd, OUT / "mixed.bin")
    (OUT / "mixed.json").write_text(json.dumps(describe(sd), indent=1) + "\n")
    torch.save({"state_dict": OrderedDict(w=torch.ones(2, 2)), "epoch": 2}, OUT / "nested.bin")
    EAGLE_BIN.mkdir(parents=True, exist_ok=True)
    shutil.copy(EAGLE / "config.json", EAGLE_BIN / "config.json")
    torch.save(OrderedDict(load_file(EAGLE / "model.safetensors")), EAGLE_BIN / "pytorch_model.bin")
    LLAMA_BIN.mkdir(parents=True, exist_ok=True)
    for f in COPIED:
        shutil.copy(LLAMA / f, LLAMA_BIN / f)
    weight_map = {}
    for bin_name, st_name in llama_shards().items():
        sd = OrderedDict(load_file(LLAMA / st_name))
        torch.save(sd, LLAMA_BIN / bin_name)
        weight_map.update({k: bin_name for k in sd})
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (LLAMA_BIN / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2) + "\n")
    print(f"wrote {OUT}, {EAGLE_BIN} and {LLAMA_BIN}")


def check() -> None:
    sd = torch.load(OUT / "mixed.bin", weights_only=True)
    want = json.loads((OUT / "mixed.json").read_text())
    assert describe(sd) == want, "mixed.bin does not hold mixed.json"
    assert describe(sd) == describe(mixed()), "mixed.bin is not this script's state dict"
    nested = torch.load(OUT / "nested.bin", weights_only=True)
    assert nested["epoch"] == 2 and torch.equal(nested["state_dict"]["w"], torch.ones(2, 2))
    eagle = torch.load(EAGLE_BIN / "pytorch_model.bin", weights_only=True)
    st = load_file(EAGLE / "model.safetensors")
    assert list(eagle) == list(st) and all(torch.equal(eagle[k], st[k]) for k in st)
    assert (EAGLE_BIN / "config.json").read_bytes() == (EAGLE / "config.json").read_bytes()
    for f in COPIED:
        assert (LLAMA_BIN / f).read_bytes() == (LLAMA / f).read_bytes(), f
    index = json.loads((LLAMA_BIN / "pytorch_model.bin.index.json").read_text())["weight_map"]
    for bin_name, st_name in llama_shards().items():
        got = torch.load(LLAMA_BIN / bin_name, weights_only=True)
        st = load_file(LLAMA / st_name)
        assert sorted(got) == sorted(st) and all(torch.equal(got[k], st[k]) for k in st), bin_name
        assert all(index[k] == bin_name for k in st), bin_name
    print("torch-bin fixtures: ok")


if __name__ == "__main__":
    check() if "--check" in sys.argv[1:] else write_all()
