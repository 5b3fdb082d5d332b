"""What the draft-head fixture scripts share (make_eagle3_fixture.py, make_eagle_fixture.py,
make_mtp_fixture.py): the determinism setup (single-threaded CPU torch, offline transformers; done
on import, before torch loads), tiny-llama's config, reference, weights and transformers model,
JSON and safetensors writing, the float64 pieces of a Llama decoder layer (rotary frequencies,
RMSNorm, rope, causal GQA self-attention, the SwiGLU MLP), the greedy chain after a prefill, the
seed search, and the `--check` comparison.

Each script keeps its own head: its config and weights, its draft forward (built from these
pieces), its reference layout and its acceptance rules.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import warnings
from pathlib import Path

# Single-threaded CPU math so that reruns produce the same bytes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

warnings.filterwarnings("ignore")
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
FIXTURES = REPO / "tests" / "fixtures"
TARGET = FIXTURES / "tiny-llama"


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def read_json(path: Path):
    return json.loads(path.read_text(encoding="utf-8"))


def save_weights(path: Path, w: dict[str, torch.Tensor]) -> None:
    save_file({k: w[k] for k in sorted(w)}, str(path), metadata={"format": "pt"})


def versions() -> dict:
    return {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "safetensors_version": safetensors.__version__,
        "numpy_version": np.__version__,
    }


def target_config() -> dict:
    return read_json(TARGET / "config.json")


def target_reference() -> dict:
    return read_json(TARGET / "reference.json")


def target_weights() -> dict[str, torch.Tensor]:
    w = {}
    for f in sorted(TARGET.glob("*.safetensors")):
        w.update(load_file(str(f)))
    return w


def load_target(folder: Path = TARGET):
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


def seeded_weights(shapes: dict, std: dict, seed: int) -> dict[str, torch.Tensor]:
    """Float32 tensors by name in sorted order from one generator: `(shape, kind)` normal with
    standard deviation `std[kind]`, or uniform in [0.8, 1.2] (norm weights) when `kind` is None."""
    g = torch.Generator().manual_seed(seed)
    w: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape, kind = shapes[name]
        if kind is None:
            w[name] = 0.8 + 0.4 * torch.rand(shape, generator=g, dtype=torch.float32)
        else:
            w[name] = std[kind] * torch.randn(shape, generator=g, dtype=torch.float32)
    return w


# ---------------------------------------------------------------------------------------------
# Float64 pieces of a Llama decoder layer (this code's own, not Arbor's).


def inv_freq(cfg: dict) -> torch.Tensor:
    """Rotary inverse frequencies (float64), Llama-3 scaling when configured."""
    hd, base = cfg["head_dim"], cfg["rope_theta"]
    f = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rs = cfg.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wl = 2 * math.pi / f
        scaled = torch.where(wl > old / lo, f / factor, f)
        s = (old / wl - lo) / (hi - lo)
        smooth = (1 - s) * scaled / factor + s * scaled
        medium = (wl >= old / hi) & (wl <= old / lo)
        f = torch.where(medium, smooth, scaled)
    else:
        assert kind == "default", kind
    return f


def check_inv_freq(cfg: dict, target) -> None:
    """Our rope frequencies must be transformers' (float32) ones."""
    hf = target.model.rotary_emb.inv_freq.to(torch.float64)
    assert torch.allclose(inv_freq(cfg), hf, rtol=1e-6, atol=0), (inv_freq(cfg), hf)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor, heads: int, hd: int) -> torch.Tensor:
    t = x.shape[0]
    x = x.view(t, heads, hd)
    ang = pos[:, None].to(torch.float64) * freq[None, :]  # [t, hd/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    rot = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return (x * cos + rot * sin).reshape(t, heads * hd)


def attention(w64: dict, a: str, x: torch.Tensor, p: torch.Tensor, cfg: dict) -> torch.Tensor:
    """`o_proj(causal_gqa_attention(rope(q(x)), rope(k(x)), v(x)))` with the weights
    `{a}{q,k,v,o}_proj.weight`; one sequence, causal by position `p`."""
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t = x.shape[0]
    q = x @ w64[a + "q_proj.weight"].T
    k = x @ w64[a + "k_proj.weight"].T
    v = x @ w64[a + "v_proj.weight"].T
    freq = inv_freq(cfg)
    q = rope(q, p, freq, nh, hd).view(t, nh, hd)
    k = rope(k, p, freq, nkv, hd).view(t, nkv, hd)
    v = v.view(t, nkv, hd)
    group = nh // nkv
    out = torch.zeros(t, nh, hd, dtype=torch.float64)
    for head in range(nh):
        kh, vh = k[:, head // group], v[:, head // group]
        s = (q[:, head] @ kh.T) / math.sqrt(hd)
        # Causal by position (rows are one sequence in position order).
        mask = p[None, :] > p[:, None]
        s = s.masked_fill(mask, float("-inf"))
        out[:, head] = torch.softmax(s, dim=-1) @ vh
    return out.reshape(t, nh * hd) @ w64[a + "o_proj.weight"].T


def mlp(w64: dict, m: str, x: torch.Tensor) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))` with the weights `{m}{gate,up,down}_proj.weight`."""
    gate = x @ w64[m + "gate_proj.weight"].T
    up = x @ w64[m + "up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w64[m + "down_proj.weight"].T


def margin(row: torch.Tensor) -> float:
    top = torch.topk(row, 2).values
    return float(top[0] - top[1])


def f32list(t: torch.Tensor) -> list:
    return t.to(torch.float32).tolist()


def greedy_chain(forward, ids: list, hs: torch.Tensor, pos: list, state, tok: int, steps: int, state_key: str, to_input, fields) -> list:
    """`steps` greedy steps after a prefill of `n = len(ids) + 1` prompt tokens: each appends
    `to_input(tok)` (the previous choice) to `ids`, the previous output `state` to `hs` and the
    next position to `pos`, reruns `forward(ids, hs, pos) -> (logits, states)` and records the
    last row (`input_id`, `position`, `logits`, `state_key`, `margin` and `fields(choice)`)."""
    n = len(ids) + 1
    chain = []
    for step in range(steps):
        inp = to_input(tok)
        ids.append(inp)
        pos.append(n - 1 + step)
        hs = torch.cat([hs, state[None, :]], dim=0)
        logits, states = forward(ids, hs, pos)
        row, s = logits[-1], states[-1]
        choice = int(row.argmax())
        chain.append(
            {
                "input_id": inp,
                "position": pos[-1],
                "logits": f32list(row),
                state_key: f32list(s),
                **fields(choice),
                "margin": margin(row),
            }
        )
        state, tok = s, choice
    return chain


def worst_margin(ref: dict) -> float:
    return min(
        min(s["prefill"]["min_margin"] for s in ref["sequences"]),
        min(c["margin"] for s in ref["sequences"] for c in s["chain"]),
    )


def too_few_distinct(ref: dict, chain_key: str, prefill_key: str, prefill_what: str) -> str | None:
    """Why the chain (fewer than 3 distinct `chain_key`) or the prefill (fewer than 8 distinct
    `prefill_key`) is too uniform to test with, or None."""
    chain = [c[chain_key] for s in ref["sequences"] for c in s["chain"]]
    if len(set(chain)) < 3:
        return f"chain tokens {chain} have fewer than 3 distinct ids"
    prefill = [t for s in ref["sequences"] for t in s["prefill"][prefill_key]]
    if len(set(prefill)) < 8:
        return f"{prefill_what} have fewer than 8 distinct values"
    return None


def find_seed(build, acceptable, target, base_seed: int, tries: int):
    """The first seed from `base_seed` whose `build(seed, target) -> (cfg, w, ref)` is acceptable."""
    for seed in range(base_seed, base_seed + tries):
        cfg, w, ref = build(seed, target)
        why = acceptable(ref)
        if why is None:
            return cfg, w, ref
        print(f"seed {seed}: {why}")
    sys.exit("no acceptable seed")


def write_head_folder(out: Path, cfg: dict, w: dict[str, torch.Tensor], ref: dict) -> None:
    """A fresh `out` holding config.json, model.safetensors and reference.json."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_json(out / "config.json", cfg)
    save_weights(out / "model.safetensors", w)
    finish_folder(out, ref)


def finish_folder(out: Path, ref: dict) -> None:
    """Writes reference.json and makes every file of `out` world-readable."""
    write_json(out / "reference.json", ref)
    for f in out.iterdir():
        os.chmod(f, 0o644)


class Check:
    """The `--check` verdict: id mismatches (printed) and the worst relative float difference."""

    def __init__(self) -> None:
        self.ok = True
        self.worst = 0.0

    def fail(self, what: str) -> None:
        self.ok = False
        print(f"MISMATCH {what}")

    def same(self, a, b, what: str) -> None:
        if a != b:
            self.fail(what)

    def close(self, a, b) -> None:
        a, b = np.array(a), np.array(b)
        self.worst = max(self.worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1.0)))

    def weights(self, path: Path, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Compares the tensors at `path` with `w`; returns those on disk."""
        on_disk = load_file(str(path))
        if sorted(on_disk) != sorted(w) or any(not torch.equal(on_disk[k], w[k]) for k in w):
            self.fail(path.name)
        return on_disk

    def sequences(self, want: dict, got: dict, prefill_ids, prefill_floats, chain_ids, chain_floats) -> None:
        for sw, sg in zip(want["sequences"], got["sequences"], strict=True):
            if sw["prompt_ids"] != sg["prompt_ids"] or len(sw["prefill"]["input_ids"]) != len(sg["prompt_ids"]) - 1:
                self.fail("prompt_ids")
            for key in prefill_ids:
                self.same(sw["prefill"][key], sg["prefill"][key], f"prefill {key}")
            for key in prefill_floats:
                self.close(sw["prefill"][key], sg["prefill"][key])
            for cw, cg in zip(sw["chain"], sg["chain"], strict=True):
                for key in chain_ids:
                    self.same(cw[key], cg[key], f"chain {key}")
                for key in chain_floats:
                    self.close(cw[key], cg[key])

    def finish(self, got_acceptable: bool, name: str, label: str) -> None:
        if self.worst > 1e-6 or not got_acceptable:
            self.ok = False
        print(f"{name}: ids ok={self.ok}, worst relative difference {self.worst:.2e}")
        if not self.ok:
            sys.exit(f"{label} reference check FAILED")
        print(f"{label} reference check passed")


def main(doc: str, check, write_all) -> None:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="rebuild in memory and compare with the committed folder")
    args = ap.parse_args()
    if args.check:
        check()
    else:
        write_all()
