#!/usr/bin/env python3
"""Independent MTP / NEXTN (next-n prediction layer) reference for Arbor.

Builds tests/fixtures/tiny-llama-mtp/: a copy of tests/fixtures/tiny-llama (its config with
`num_nextn_predict_layers: 1` added, tokenizer files copied, the two base shards byte for byte) plus
one extra shard `model-mtp.safetensors` holding a seeded MTP layer in the DeepSeek-V3 checkpoint
layout at `model.layers.{L}.` (L = num_hidden_layers = 3): `enorm`, `hnorm`, `eh_proj` [h, 2h], a
Llama decoder layer (`input_layernorm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`,
`mlp.{gate,up,down}_proj`) and `shared_head.norm`. `shared_head.head` and `embed_tokens` are absent,
so a loader must take the target's `lm_head.weight` and `model.embed_tokens.weight`.
`model.safetensors.index.json` maps the new tensors to the new shard.

reference.json holds, for two of tiny-llama's reference prompts:

* the target's final hidden states (after its final norm) at every position, from transformers'
  `LlamaForCausalLM` loaded from the new folder (`output_hidden_states[-1]`, cross-checked against
  a hook on `model.norm`);
* the MTP prefill: input ids = the prompt shifted by one, target states of positions 0..n-2, the
  logits and output state at every position and the greedy token;
* three greedy chain steps, each feeding the previous step's output state and chosen token.

The MTP forward is this file's own float64 torch code, written from the published architecture
(vLLM vllm/model_executor/models/deepseek_mtp.py `DeepSeekMultiTokenPredictorLayer`, SGLang
python/sglang/srt/models/deepseek_nextn.py), not from Arbor:

    e = embed(ids); e[positions == 0] = 0          (vLLM's masking; SGLang does not mask)
    x = eh_proj(cat([enorm(e), hnorm(h)], -1))     h = target final-normed state or previous state
    a = o_proj(causal_gqa_attention(rope(q(n1)), rope(k(n1)), v(n1)))   n1 = input_layernorm(x)
    r2 = a + x; m = down(silu(gate(post_attention_layernorm(r2))) * up(...))
    state = m + r2; logits = lm_head(shared_head.norm(state)) over the full vocabulary

    python tools/reference/make_mtp_fixture.py           # (re)write tests/fixtures/tiny-llama-mtp
    python tools/reference/make_mtp_fixture.py --check   # rebuild in memory and compare

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
OUT = FIXTURES / "tiny-llama-mtp"
MTP_SHARD = "model-mtp.safetensors"
# Copied byte for byte (config.json and the index are rewritten; reference.json is this script's).
COPIED = [
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
]

BASE_SEED = 11000
MAX_SEED_TRIES = 200
PROMPTS = [0, 1]  # indices into tiny-llama's reference.json prompts (5 and 24 tokens)
CHAIN_STEPS = 3
MIN_MARGIN = 1e-2  # required top1-top2 gap of every MTP argmax
MIN_MASK_EFFECT = 1e-1  # masking the embedding at position 0 must move those logits at least this much
# Standard deviations of the normal weights; norm weights are uniform in [0.8, 1.2].
STD = {"eh_proj": 0.1, "attn": 0.15, "mlp": 0.15}


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


def mtp_config(tc: dict) -> dict:
    cfg = dict(tc)
    cfg["num_nextn_predict_layers"] = 1
    return cfg


def mtp_index(cfg: dict, w: dict[str, torch.Tensor]) -> dict:
    idx = json.loads((TARGET / "model.safetensors.index.json").read_text(encoding="utf-8"))
    for name in w:
        assert name not in idx["weight_map"], name
        idx["weight_map"][name] = MTP_SHARD
    idx["weight_map"] = dict(sorted(idx["weight_map"].items()))
    idx["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in w.values())
    return idx


def prefix(cfg: dict) -> str:
    return f"model.layers.{cfg['num_hidden_layers']}."


def make_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    h = cfg["hidden_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter = cfg["intermediate_size"]
    shapes = {
        "enorm.weight": ([h], None),
        "hnorm.weight": ([h], None),
        "eh_proj.weight": ([h, 2 * h], "eh_proj"),
        "input_layernorm.weight": ([h], None),
        "self_attn.q_proj.weight": ([nh * hd, h], "attn"),
        "self_attn.k_proj.weight": ([nkv * hd, h], "attn"),
        "self_attn.v_proj.weight": ([nkv * hd, h], "attn"),
        "self_attn.o_proj.weight": ([h, nh * hd], "attn"),
        "post_attention_layernorm.weight": ([h], None),
        "mlp.gate_proj.weight": ([inter, h], "mlp"),
        "mlp.up_proj.weight": ([inter, h], "mlp"),
        "mlp.down_proj.weight": ([h, inter], "mlp"),
        "shared_head.norm.weight": ([h], None),
    }
    g = torch.Generator().manual_seed(seed)
    w: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape, kind = shapes[name]
        if kind is None:
            t = 0.8 + 0.4 * torch.rand(shape, generator=g, dtype=torch.float32)
        else:
            t = STD[kind] * torch.randn(shape, generator=g, dtype=torch.float32)
        w[prefix(cfg) + name] = t
    return w


# ---------------------------------------------------------------------------------------------
# Target states (transformers) and the float64 MTP forward (this file's own code).


def load_target(folder: Path):
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def target_states(model, ids: list[int]) -> torch.Tensor:
    """[n, hidden] float32: the target's final hidden states, after its final norm."""
    seen: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    try:
        res = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    assert len(res.hidden_states) == len(model.model.layers) + 1
    # transformers' last hidden_states entry is the final norm's output (not the last layer's raw output).
    assert len(seen) == 1 and torch.equal(res.hidden_states[-1], seen[0])
    # And the logits are lm_head of it.
    assert torch.allclose(model.lm_head(seen[0]), res.logits, atol=1e-5)
    return seen[0][0]


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


def mtp_forward(w64: dict, cfg: dict, ids: list[int], h: torch.Tensor, pos: list[int], mask_pos0: bool = True):
    """One sequence, causal over all its rows; `h` [t, hidden] the states fed. -> (logits, state)."""
    eps = cfg["rms_norm_eps"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    pre = prefix(cfg)
    t = len(ids)
    p = torch.tensor(pos)
    emb = w64["model.embed_tokens.weight"][torch.tensor(ids)].clone()
    if mask_pos0:
        emb[p == 0] = 0
    cat = torch.cat([rms(emb, w64[pre + "enorm.weight"], eps), rms(h, w64[pre + "hnorm.weight"], eps)], dim=-1)
    x = cat @ w64[pre + "eh_proj.weight"].T
    n1 = rms(x, w64[pre + "input_layernorm.weight"], eps)
    a = pre + "self_attn."
    q = n1 @ w64[a + "q_proj.weight"].T
    k = n1 @ w64[a + "k_proj.weight"].T
    v = n1 @ w64[a + "v_proj.weight"].T
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
    r2 = attn + x
    n2 = rms(r2, w64[pre + "post_attention_layernorm.weight"], eps)
    m = pre + "mlp."
    gate = n2 @ w64[m + "gate_proj.weight"].T
    up = n2 @ w64[m + "up_proj.weight"].T
    mlp = (torch.nn.functional.silu(gate) * up) @ w64[m + "down_proj.weight"].T
    state = mlp + r2
    # shared_head.head is absent from the checkpoint: the target's lm_head.
    logits = rms(state, w64[pre + "shared_head.norm.weight"], eps) @ w64["lm_head.weight"].T
    return logits, state


def margin(row: torch.Tensor) -> float:
    top = torch.topk(row, 2).values
    return float(top[0] - top[1])


def f32list(t: torch.Tensor) -> list:
    return t.to(torch.float32).tolist()


def base_weights() -> dict[str, torch.Tensor]:
    w = {}
    for f in sorted(TARGET.glob("*.safetensors")):
        w.update(load_file(str(f)))
    return w


def compute_reference(cfg: dict, w: dict[str, torch.Tensor], target) -> dict:
    allw = {**base_weights(), **w}
    w64 = {k: v.to(torch.float64) for k, v in allw.items()}
    tref = target_reference()
    # Our rope frequencies must be transformers' (float32) ones.
    hf = target.model.rotary_emb.inv_freq.to(torch.float64)
    assert torch.allclose(inv_freq(cfg), hf, rtol=1e-6, atol=0), (inv_freq(cfg), hf)
    seqs = []
    mask_effect = math.inf
    for pi in PROMPTS:
        prompt = tref["prompts"][pi]["input_ids"]
        n = len(prompt)
        states32 = target_states(target, prompt)  # [n, hidden] float32
        hs = states32[: n - 1].to(torch.float64)
        ids = list(prompt[1:])
        pos = list(range(n - 1))
        logits, state = mtp_forward(w64, cfg, ids, hs, pos)
        # The position-0 masking must matter for the test to check it.
        unmasked, _ = mtp_forward(w64, cfg, ids[:1], hs[:1], pos[:1], mask_pos0=False)
        mask_effect = min(mask_effect, float((unmasked[0] - logits[0]).abs().max()))
        tokens = [int(r.argmax()) for r in logits]
        margins = [margin(r) for r in logits]
        seq = {
            "prompt_ids": prompt,
            "target_hidden": f32list(states32),
            "prefill": {
                "input_ids": list(ids),
                "positions": list(pos),
                "logits": f32list(logits),
                "state": f32list(state),
                "token_ids": tokens,
                "min_margin": min(margins),
            },
            "chain": [],
        }
        prev_state, prev_tok = state[-1], tokens[-1]
        for step in range(CHAIN_STEPS):
            ids.append(prev_tok)
            pos.append(n - 1 + step)
            hs = torch.cat([hs, prev_state[None, :]], dim=0)
            logits, state = mtp_forward(w64, cfg, ids, hs, pos)
            row, s = logits[-1], state[-1]
            tok = int(row.argmax())
            seq["chain"].append(
                {
                    "input_id": prev_tok,
                    "position": pos[-1],
                    "logits": f32list(row),
                    "state": f32list(s),
                    "token_id": tok,
                    "margin": margin(row),
                }
            )
            prev_state, prev_tok = s, tok
        seqs.append(seq)
    return {
        "checkpoint": OUT.name,
        "target": TARGET.name,
        **versions(),
        "mtp_layer": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "vocab_size": cfg["vocab_size"],
        "weight_std": STD,
        "position0_mask_effect": mask_effect,
        "sequences": seqs,
    }


def acceptable(ref: dict) -> str | None:
    worst = min(
        min(s["prefill"]["min_margin"] for s in ref["sequences"]),
        min(c["margin"] for s in ref["sequences"] for c in s["chain"]),
    )
    if worst < MIN_MARGIN:
        return f"top-2 margin {worst:.4f} < {MIN_MARGIN}"
    if ref["position0_mask_effect"] < MIN_MASK_EFFECT:
        return f"position-0 masking moves logits by only {ref['position0_mask_effect']:.4f}"
    chain = [c["token_id"] for s in ref["sequences"] for c in s["chain"]]
    if len(set(chain)) < 3:
        return f"chain tokens {chain} have fewer than 3 distinct ids"
    prefill = [t for s in ref["sequences"] for t in s["prefill"]["token_ids"]]
    if len(set(prefill)) < 8:
        return "prefill tokens have fewer than 8 distinct values"
    return None


def build(seed: int, target) -> tuple[dict, dict, dict]:
    cfg = mtp_config(target_config())
    w = make_weights(cfg, seed)
    ref = compute_reference(cfg, w, target)
    ref["seed"] = seed
    return cfg, w, ref


def write_folder(cfg: dict, w: dict) -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    for name in COPIED:
        shutil.copyfile(TARGET / name, OUT / name)
    write_json(OUT / "config.json", cfg)
    write_json(OUT / "model.safetensors.index.json", mtp_index(cfg, w))
    save_file({k: w[k] for k in sorted(w)}, str(OUT / MTP_SHARD), metadata={"format": "pt"})


def write_all() -> None:
    t0 = time.time()
    # The base weights are tiny-llama's; write the folder once to load the target from it (it
    # must ignore the MTP layer's tensors), then per seed only the MTP shard changes.
    cfg = mtp_config(target_config())
    write_folder(cfg, make_weights(cfg, BASE_SEED))
    target = load_target(OUT)
    for seed in range(BASE_SEED, BASE_SEED + MAX_SEED_TRIES):
        cfg, w, ref = build(seed, target)
        why = acceptable(ref)
        if why is None:
            break
        print(f"seed {seed}: {why}")
    else:
        sys.exit("no acceptable seed")
    write_folder(cfg, w)
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
            f"last token {pf['token_ids'][-1]}, chain {[c['token_id'] for c in s['chain']]}, "
            f"max|logit| {max(abs(v) for r in pf['logits'] for v in r):.2f}, "
            f"position-0 mask effect {ref['position0_mask_effect']:.3f}"
        )


def check() -> None:
    """Rebuild from the committed seed and compare with the committed folder."""
    want = json.loads((OUT / "reference.json").read_text(encoding="utf-8"))
    target = load_target(OUT)
    cfg, w, ref = build(want["seed"], target)
    ok = True
    if json.loads((OUT / "config.json").read_text(encoding="utf-8")) != cfg:
        ok = False
        print("MISMATCH config.json")
    if json.loads((OUT / "model.safetensors.index.json").read_text(encoding="utf-8")) != mtp_index(cfg, w):
        ok = False
        print("MISMATCH model.safetensors.index.json")
    for name in COPIED:
        if (OUT / name).read_bytes() != (TARGET / name).read_bytes():
            ok = False
            print(f"MISMATCH {name} (not tiny-llama's)")
    on_disk = load_file(str(OUT / MTP_SHARD))
    if sorted(on_disk) != sorted(w) or any(not torch.equal(on_disk[k], w[k]) for k in w):
        ok = False
        print(f"MISMATCH {MTP_SHARD}")
    # The reference recomputed from the committed weights.
    got = compute_reference(cfg, on_disk, target)
    worst = 0.0
    for sw, sg in zip(want["sequences"], got["sequences"], strict=True):
        if sw["prompt_ids"] != sg["prompt_ids"]:
            ok = False
            print("MISMATCH prompt_ids")
        for key in ("input_ids", "token_ids", "positions"):
            if sw["prefill"][key] != sg["prefill"][key]:
                ok = False
                print(f"MISMATCH prefill {key}")
        pairs = [(sw["target_hidden"], sg["target_hidden"])]
        pairs += [(sw["prefill"][k], sg["prefill"][k]) for k in ("logits", "state")]
        for cw, cg in zip(sw["chain"], sg["chain"], strict=True):
            for key in ("input_id", "position", "token_id"):
                if cw[key] != cg[key]:
                    ok = False
                    print(f"MISMATCH chain {key}")
            pairs += [(cw[k], cg[k]) for k in ("logits", "state")]
        for a, b in pairs:
            a, b = np.array(a), np.array(b)
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1.0)))
    if worst > 1e-6 or acceptable(got) is not None:
        ok = False
    print(f"tiny-llama-mtp: ids ok={ok}, worst relative difference {worst:.2e}")
    if not ok:
        sys.exit("MTP reference check FAILED")
    print("MTP reference check passed")


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
