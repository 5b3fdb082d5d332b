#!/usr/bin/env python3
"""Independent EAGLE3 draft-head reference for Arbor.

Builds a seeded EAGLE3 draft head for tests/fixtures/tiny-llama in the published SpecForge /
SGLang `LlamaForCausalLMEagle3` checkpoint layout (tensor names without a `model.` prefix:
`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, `embed_tokens`) under
tests/fixtures/eagle3-tiny-llama/ (config.json + model.safetensors), and writes reference.json:

* target features: the outputs of tiny-llama's decoder layers `eagle_aux_hidden_state_layer_ids`
  (forward hooks on transformers' `LlamaForCausalLM`, eager attention, float32), concatenated in
  that order, for two of the tiny-llama reference prompts;
* the draft prefill (input ids = the prompt shifted by one, features of positions 0..n-2);
* three greedy chain steps after it, each feeding the previous step's `aux` hidden state (width
  hidden_size, so no `fc`) and the previous draft token mapped to its target id.

The draft forward is this file's own float64 torch code, written from the published architecture
(SGLang python/sglang/srt/models/llama_eagle3.py), not from Arbor:

    h = fc(features)        (or the previous aux)   residual = h
    x = cat(input_layernorm(embed(ids)), hidden_norm(h))
    a = o_proj(causal_gqa_attention(rope(q(x)), rope(k(x)), v(x)))
    r2 = a + residual; m = down(silu(gate(post_attention_layernorm(r2))) * up(...))
    aux = m + r2; logits = lm_head(norm(aux)) over the draft vocab; target id = d + d2t[d]

    python tools/reference/make_eagle3_fixture.py           # (re)write tests/fixtures/eagle3-tiny-llama
    python tools/reference/make_eagle3_fixture.py --check   # rebuild in memory and compare

Needs torch, transformers 5.x, safetensors, numpy. See tools/reference/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections import Counter
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
OUT = FIXTURES / "eagle3-tiny-llama"

BASE_SEED = 9000
MAX_SEED_TRIES = 200
DRAFT_VOCAB = 128
INTERMEDIATE = 96
AUX_LAYERS = [0, 1, 2]
PROMPTS = [0, 1]  # indices into tiny-llama's reference.json prompts
CHAIN_STEPS = 3
MIN_MARGIN = 1e-2  # required top1-top2 gap of every draft argmax
HOT_FROM_USE = 64  # hot ids taken by frequency in tiny-llama's prompts + greedy outputs
# Standard deviations of the normal weights; norm weights are uniform in [0.8, 1.2].
STD = {"fc": 0.1, "attn": 0.15, "mlp": 0.15, "lm_head": 0.5}


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def versions() -> dict:
    return {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "safetensors_version": safetensors.__version__,
        "numpy_version": np.__version__,
    }


def target_config() -> dict:
    return json.loads((TARGET / "config.json").read_text(encoding="utf-8"))


def target_reference() -> dict:
    return json.loads((TARGET / "reference.json").read_text(encoding="utf-8"))


def head_config(tc: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": tc["hidden_size"],
        "target_hidden_size": tc["hidden_size"],
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 1,
        "num_attention_heads": tc["num_attention_heads"],
        "num_key_value_heads": tc["num_key_value_heads"],
        "head_dim": tc["head_dim"],
        "rms_norm_eps": tc["rms_norm_eps"],
        "rope_theta": tc["rope_theta"],
        "rope_scaling": tc["rope_scaling"],
        "max_position_embeddings": tc["max_position_embeddings"],
        "vocab_size": tc["vocab_size"],
        "draft_vocab_size": DRAFT_VOCAB,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS},
    }


def hot_ids(tc: dict, seed: int) -> list[int]:
    """128 target ids: the most used by tiny-llama's prompts and greedy outputs, then seeded others."""
    ref = target_reference()
    use = Counter()
    for p in ref["prompts"]:
        use.update(p["input_ids"])
        use.update(p["greedy_ids"])
    ranked = sorted(use.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = [t for t, _ in ranked[:HOT_FROM_USE]]
    g = torch.Generator().manual_seed(seed + 7)
    for t in torch.randperm(tc["vocab_size"], generator=g).tolist():
        if len(chosen) == DRAFT_VOCAB:
            break
        if t not in chosen:
            chosen.append(t)
    return sorted(chosen)


def make_weights(tc: dict, cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    h, th = cfg["hidden_size"], cfg["target_hidden_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter = cfg["intermediate_size"]
    shapes = {
        "fc.weight": ([h, 3 * th], "fc"),
        "midlayer.input_layernorm.weight": ([h], None),
        "midlayer.hidden_norm.weight": ([h], None),
        "midlayer.self_attn.q_proj.weight": ([nh * hd, 2 * h], "attn"),
        "midlayer.self_attn.k_proj.weight": ([nkv * hd, 2 * h], "attn"),
        "midlayer.self_attn.v_proj.weight": ([nkv * hd, 2 * h], "attn"),
        "midlayer.self_attn.o_proj.weight": ([h, nh * hd], "attn"),
        "midlayer.post_attention_layernorm.weight": ([h], None),
        "midlayer.mlp.gate_proj.weight": ([inter, h], "mlp"),
        "midlayer.mlp.up_proj.weight": ([inter, h], "mlp"),
        "midlayer.mlp.down_proj.weight": ([h, inter], "mlp"),
        "norm.weight": ([h], None),
        "lm_head.weight": ([cfg["draft_vocab_size"], h], "lm_head"),
    }
    g = torch.Generator().manual_seed(seed)
    w: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape, kind = shapes[name]
        if kind is None:
            w[name] = 0.8 + 0.4 * torch.rand(shape, generator=g, dtype=torch.float32)
        else:
            w[name] = STD[kind] * torch.randn(shape, generator=g, dtype=torch.float32)
    target = {}
    for f in sorted(TARGET.glob("*.safetensors")):
        target.update(load_file(str(f)))
    w["embed_tokens.weight"] = target["model.embed_tokens.weight"].clone().contiguous()
    hot = torch.tensor(hot_ids(tc, seed), dtype=torch.int64)
    w["d2t"] = hot - torch.arange(DRAFT_VOCAB, dtype=torch.int64)
    t2d = torch.zeros(tc["vocab_size"], dtype=torch.bool)
    t2d[hot] = True
    w["t2d"] = t2d
    return w


# ---------------------------------------------------------------------------------------------
# Target features (transformers) and the float64 draft forward (this file's own code).


def load_target():
    return AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def target_features(model, ids: list[int]) -> torch.Tensor:
    """[n, 3 * target_hidden] float32: outputs of the aux layers, concatenated in their order."""
    outs: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):

        def hook(_m, _inp, out, i=i):
            outs[i] = (out[0] if isinstance(out, tuple) else out).detach()

        hooks.append(layer.register_forward_hook(hook))
    try:
        res = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for hk in hooks:
            hk.remove()
    n_layers = len(model.model.layers)
    # Cross-checks of the hooks: hidden_states[i + 1] is layer i's output for i < L - 1, and the
    # last entry is the final-normed output of the last layer.
    for i in range(n_layers - 1):
        assert torch.equal(res.hidden_states[i + 1], outs[i]), i
    normed = model.model.norm(outs[n_layers - 1])
    assert torch.allclose(res.hidden_states[-1], normed, atol=1e-6)
    return torch.cat([outs[i][0] for i in AUX_LAYERS], dim=-1)


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


def draft_forward(w64: dict, cfg: dict, ids: list[int], h: torch.Tensor, pos: list[int]):
    """One sequence, causal over all its rows. `h` is the fused hidden [t, hidden]. -> (logits, aux)."""
    eps = cfg["rms_norm_eps"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t = len(ids)
    p = torch.tensor(pos)
    emb = w64["embed_tokens.weight"][torch.tensor(ids)]
    x = torch.cat(
        [rms(emb, w64["midlayer.input_layernorm.weight"], eps), rms(h, w64["midlayer.hidden_norm.weight"], eps)],
        dim=-1,
    )
    a = "midlayer.self_attn."
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
    attn = out.reshape(t, nh * hd) @ w64[a + "o_proj.weight"].T
    r2 = attn + h
    h2 = rms(r2, w64["midlayer.post_attention_layernorm.weight"], eps)
    m = "midlayer.mlp."
    gate = h2 @ w64[m + "gate_proj.weight"].T
    up = h2 @ w64[m + "up_proj.weight"].T
    mlp = (torch.nn.functional.silu(gate) * up) @ w64[m + "down_proj.weight"].T
    aux = mlp + r2
    logits = rms(aux, w64["norm.weight"], eps) @ w64["lm_head.weight"].T
    return logits, aux


def margin(row: torch.Tensor) -> float:
    top = torch.topk(row, 2).values
    return float(top[0] - top[1])


def f32list(t: torch.Tensor) -> list:
    return t.to(torch.float32).tolist()


def compute_reference(cfg: dict, w: dict[str, torch.Tensor], target) -> dict:
    w64 = {k: v.to(torch.float64) for k, v in w.items() if v.is_floating_point()}
    d2t = w["d2t"]
    tref = target_reference()
    # Our rope frequencies must be transformers' (float32) ones.
    hf = target.model.rotary_emb.inv_freq.to(torch.float64)
    assert torch.allclose(inv_freq(cfg), hf, rtol=1e-6, atol=0), (inv_freq(cfg), hf)
    seqs = []
    for pi in PROMPTS:
        prompt = tref["prompts"][pi]["input_ids"]
        n = len(prompt)
        feats32 = target_features(target, prompt)  # [n, 3 th] float32
        feats = feats32[: n - 1].to(torch.float64)
        ids = list(prompt[1:])
        pos = list(range(n - 1))
        hs = feats @ w64["fc.weight"].T
        logits, aux = draft_forward(w64, cfg, ids, hs, pos)
        draft = [int(r.argmax()) for r in logits]
        margins = [margin(r) for r in logits]
        seq = {
            "prompt_ids": prompt,
            "prefill": {
                "input_ids": list(ids),
                "positions": list(pos),
                "features": f32list(feats32[: n - 1]),
                "fused": f32list(hs),
                "logits": f32list(logits),
                "aux": f32list(aux),
                "draft_ids": draft,
                "target_ids": [d + int(d2t[d]) for d in draft],
                "min_margin": min(margins),
            },
            "chain": [],
        }
        prev_aux, prev_tok = aux[-1], draft[-1]
        for step in range(CHAIN_STEPS):
            tid = prev_tok + int(d2t[prev_tok])
            ids.append(tid)
            pos.append(n - 1 + step)
            hs = torch.cat([hs, prev_aux[None, :]], dim=0)
            logits, aux = draft_forward(w64, cfg, ids, hs, pos)
            row, a = logits[-1], aux[-1]
            d = int(row.argmax())
            seq["chain"].append(
                {
                    "input_id": tid,
                    "position": pos[-1],
                    "logits": f32list(row),
                    "aux": f32list(a),
                    "draft_id": d,
                    "target_id": d + int(d2t[d]),
                    "margin": margin(row),
                }
            )
            prev_aux, prev_tok = a, d
        seqs.append(seq)
    hot = (d2t + torch.arange(DRAFT_VOCAB)).tolist()
    return {
        "head": OUT.name,
        "target": TARGET.name,
        **versions(),
        "aux_layer_ids": AUX_LAYERS,
        "hidden_size": cfg["hidden_size"],
        "target_hidden_size": cfg["target_hidden_size"],
        "draft_vocab_size": cfg["draft_vocab_size"],
        "hot_ids": hot,
        "weight_std": STD,
        "sequences": seqs,
    }


def acceptable(ref: dict) -> str | None:
    worst = min(
        min(s["prefill"]["min_margin"] for s in ref["sequences"]),
        min(c["margin"] for s in ref["sequences"] for c in s["chain"]),
    )
    if worst < MIN_MARGIN:
        return f"top-2 margin {worst:.4f} < {MIN_MARGIN}"
    chain = [c["target_id"] for s in ref["sequences"] for c in s["chain"]]
    if len(set(chain)) < 3:
        return f"chain tokens {chain} have fewer than 3 distinct ids"
    prefill = [t for s in ref["sequences"] for t in s["prefill"]["draft_ids"]]
    if len(set(prefill)) < 8:
        return "prefill draft ids have fewer than 8 distinct values"
    return None


def build(seed: int, target) -> tuple[dict, dict, dict]:
    tc = target_config()
    cfg = head_config(tc)
    w = make_weights(tc, cfg, seed)
    ref = compute_reference(cfg, w, target)
    ref["seed"] = seed
    return cfg, w, ref


def write_all() -> None:
    t0 = time.time()
    target = load_target()
    for seed in range(BASE_SEED, BASE_SEED + MAX_SEED_TRIES):
        cfg, w, ref = build(seed, target)
        why = acceptable(ref)
        if why is None:
            break
        print(f"seed {seed}: {why}")
    else:
        sys.exit("no acceptable seed")
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    write_json(OUT / "config.json", cfg)
    save_file({k: w[k] for k in sorted(w)}, str(OUT / "model.safetensors"), metadata={"format": "pt"})
    write_json(OUT / "reference.json", ref)
    for f in OUT.iterdir():
        os.chmod(f, 0o644)
    summarize(ref)
    print(f"wrote {OUT} in {time.time() - t0:.1f}s")


def summarize(ref: dict) -> None:
    for s in ref["sequences"]:
        pf = s["prefill"]
        print(
            f"seed {ref['seed']} prompt of {len(s['prompt_ids'])}: prefill margin {pf['min_margin']:.3f}, "
            f"last draft {pf['target_ids'][-1]}, chain {[c['target_id'] for c in s['chain']]}, "
            f"max|logit| {max(abs(v) for r in pf['logits'] for v in r):.2f}"
        )


def check() -> None:
    """Rebuild from the committed seed and compare with the committed folder."""
    want = json.loads((OUT / "reference.json").read_text(encoding="utf-8"))
    target = load_target()
    cfg, w, ref = build(want["seed"], target)
    ok = True
    if json.loads((OUT / "config.json").read_text(encoding="utf-8")) != cfg:
        ok = False
        print("MISMATCH config.json")
    on_disk = load_file(str(OUT / "model.safetensors"))
    if sorted(on_disk) != sorted(w) or any(not torch.equal(on_disk[k], w[k]) for k in w):
        ok = False
        print("MISMATCH model.safetensors")
    # The reference recomputed from the committed weights.
    got = compute_reference(cfg, on_disk, target)
    worst = 0.0
    for sw, sg in zip(want["sequences"], got["sequences"], strict=True):
        if sw["prompt_ids"] != sg["prompt_ids"] or len(sw["prefill"]["input_ids"]) != len(sg["prompt_ids"]) - 1:
            ok = False
            print("MISMATCH prompt_ids")
        for key in ("input_ids", "draft_ids", "target_ids", "positions"):
            if sw["prefill"][key] != sg["prefill"][key]:
                ok = False
                print(f"MISMATCH prefill {key}")
        for key in ("features", "logits", "aux"):
            a, b = np.array(sw["prefill"][key]), np.array(sg["prefill"][key])
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1.0)))
        for cw, cg in zip(sw["chain"], sg["chain"], strict=True):
            for key in ("input_id", "position", "draft_id", "target_id"):
                if cw[key] != cg[key]:
                    ok = False
                    print(f"MISMATCH chain {key}")
            for key in ("logits", "aux"):
                a, b = np.array(cw[key]), np.array(cg[key])
                worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1.0)))
    if worst > 1e-6 or acceptable(got) is not None:
        ok = False
    print(f"eagle3-tiny-llama: ids ok={ok}, worst relative difference {worst:.2e}")
    if not ok:
        sys.exit("EAGLE3 reference check FAILED")
    print("EAGLE3 reference check passed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="rebuild in memory and compare with the committed folder")
    args = ap.parse_args()
    if args.check:
        check()
    else:
        write_all()


if __name__ == "__main__":
    main()
