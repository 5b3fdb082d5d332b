#!/usr/bin/env python3
"""Independent EAGLE (EAGLE-1 / EAGLE-2 layout) draft-head reference for Arbor.

Builds a seeded EAGLE draft head for tests/fixtures/tiny-llama in the published checkpoint layout
of SafeAILab/EAGLE `eagle/model/cnets1.py` as SGLang loads it (`LlamaForCausalLMEagle`,
python/sglang/srt/models/llama_eagle.py): tensor names without a `model.` prefix, `fc.weight`
[h, 2h] + `fc.bias` [h], `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.post_attention_layernorm.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`; no
`input_layernorm` in layer 0, no final norm, and neither `embed_tokens.weight` nor `lm_head.weight`
(the target's are used). It goes under tests/fixtures/eagle-tiny-llama/ (config.json +
model.safetensors), with reference.json:

* target states: tiny-llama's final normed hidden state at every position (transformers'
  `LlamaForCausalLM`, eager attention, float32, `output_hidden_states[-1]`, cross-checked against
  the final norm applied to the last decoder layer's output), for two of the tiny-llama reference
  prompts;
* the draft prefill (input ids = the prompt shifted by one, states of positions 0..n-2);
* three greedy chain steps after it, each feeding the previous step's output state and token.

The draft forward is this file's own float64 torch code, written from the published architecture
(cnets1.py `Model.forward` / `LlamaDecoderLayer`, SGLang llama_eagle.py), not from Arbor:

    x = fc(cat(embed(ids), h))          h: the target's final normed state, or the previous state
    for layer i: a_in = x if i == 0 else input_layernorm_i(x)     (layer 0 has no input norm)
                 x = x + o_proj(causal_gqa_attention(rope(q(a_in)), rope(k(a_in)), v(a_in)))
                 x = x + down(silu(gate(post_attention_layernorm(x))) * up(...))
    state = x; logits = target_lm_head(state)     (no final norm: state goes straight to the head)

    python tools/reference/make_eagle_fixture.py           # (re)write tests/fixtures/eagle-tiny-llama
    python tools/reference/make_eagle_fixture.py --check   # rebuild in memory and compare

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
OUT = FIXTURES / "eagle-tiny-llama"

BASE_SEED = 9500
MAX_SEED_TRIES = 200
INTERMEDIATE = 96
NUM_LAYERS = 1
PROMPTS = [0, 1]  # indices into tiny-llama's reference.json prompts (5 and 24 tokens)
CHAIN_STEPS = 3
MIN_MARGIN = 1e-2  # required top1-top2 gap of every draft argmax
# Standard deviations of the normal weights; norm weights are uniform in [0.8, 1.2].
STD = {"fc": 0.1, "fc_bias": 0.05, "attn": 0.15, "mlp": 0.15}


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


def target_weights() -> dict[str, torch.Tensor]:
    w = {}
    for f in sorted(TARGET.glob("*.safetensors")):
        w.update(load_file(str(f)))
    return w


def head_config(tc: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": tc["hidden_size"],
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": tc["num_attention_heads"],
        "num_key_value_heads": tc["num_key_value_heads"],
        "head_dim": tc["head_dim"],
        "rms_norm_eps": tc["rms_norm_eps"],
        "rope_theta": tc["rope_theta"],
        "rope_scaling": tc["rope_scaling"],
        "max_position_embeddings": tc["max_position_embeddings"],
        "vocab_size": tc["vocab_size"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bias": True,
        "torch_dtype": "float32",
    }


def make_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    h = cfg["hidden_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter = cfg["intermediate_size"]
    shapes = {"fc.weight": ([h, 2 * h], "fc"), "fc.bias": ([h], "fc_bias")}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        if i > 0:
            shapes[p + "input_layernorm.weight"] = ([h], None)
        shapes.update(
            {
                p + "self_attn.q_proj.weight": ([nh * hd, h], "attn"),
                p + "self_attn.k_proj.weight": ([nkv * hd, h], "attn"),
                p + "self_attn.v_proj.weight": ([nkv * hd, h], "attn"),
                p + "self_attn.o_proj.weight": ([h, nh * hd], "attn"),
                p + "post_attention_layernorm.weight": ([h], None),
                p + "mlp.gate_proj.weight": ([inter, h], "mlp"),
                p + "mlp.up_proj.weight": ([inter, h], "mlp"),
                p + "mlp.down_proj.weight": ([h, inter], "mlp"),
            }
        )
    g = torch.Generator().manual_seed(seed)
    w: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape, kind = shapes[name]
        if kind is None:
            w[name] = 0.8 + 0.4 * torch.rand(shape, generator=g, dtype=torch.float32)
        else:
            w[name] = STD[kind] * torch.randn(shape, generator=g, dtype=torch.float32)
    return w


# ---------------------------------------------------------------------------------------------
# Target states (transformers) and the float64 draft forward (this file's own code).


def load_target():
    return AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def target_states(model, ids: list[int]) -> torch.Tensor:
    """[n, hidden] float32: the final normed hidden state (what the target's LM head reads)."""
    outs: dict[str, torch.Tensor] = {}
    last = model.model.layers[-1]

    def hook(_m, _inp, out):
        outs["last"] = (out[0] if isinstance(out, tuple) else out).detach()

    hk = last.register_forward_hook(hook)
    try:
        res = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hk.remove()
    state = res.hidden_states[-1][0]
    # Cross-checks: it is the final norm of the last layer's output, and the target's logits are
    # lm_head(state) (so the draft's logits are in the same space).
    assert torch.allclose(state, model.model.norm(outs["last"])[0], atol=1e-6)
    assert torch.allclose(res.logits[0], model.lm_head(state), atol=1e-5)
    return state


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
    """One sequence, causal over all its rows. `h` is the input state [t, hidden]. -> (logits, state)."""
    eps = cfg["rms_norm_eps"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t = len(ids)
    p = torch.tensor(pos)
    emb = w64["target.embed_tokens.weight"][torch.tensor(ids)]
    x = torch.cat([emb, h], dim=-1) @ w64["fc.weight"].T + w64["fc.bias"]
    freq = inv_freq(cfg)
    group = nh // nkv
    for i in range(cfg["num_hidden_layers"]):
        pre = f"layers.{i}."
        a_in = x if i == 0 else rms(x, w64[pre + "input_layernorm.weight"], eps)
        a = pre + "self_attn."
        q = rope(a_in @ w64[a + "q_proj.weight"].T, p, freq, nh, hd).view(t, nh, hd)
        k = rope(a_in @ w64[a + "k_proj.weight"].T, p, freq, nkv, hd).view(t, nkv, hd)
        v = (a_in @ w64[a + "v_proj.weight"].T).view(t, nkv, hd)
        out = torch.zeros(t, nh, hd, dtype=torch.float64)
        for head in range(nh):
            kh, vh = k[:, head // group], v[:, head // group]
            s = (q[:, head] @ kh.T) / math.sqrt(hd)
            # Causal by position (rows are one sequence in position order).
            s = s.masked_fill(p[None, :] > p[:, None], float("-inf"))
            out[:, head] = torch.softmax(s, dim=-1) @ vh
        x = x + out.reshape(t, nh * hd) @ w64[a + "o_proj.weight"].T
        m = pre + "mlp."
        h2 = rms(x, w64[pre + "post_attention_layernorm.weight"], eps)
        x = x + (torch.nn.functional.silu(h2 @ w64[m + "gate_proj.weight"].T) * (h2 @ w64[m + "up_proj.weight"].T)) @ w64[
            m + "down_proj.weight"
        ].T
    logits = x @ w64["target.lm_head.weight"].T
    return logits, x


def margin(row: torch.Tensor) -> float:
    top = torch.topk(row, 2).values
    return float(top[0] - top[1])


def f32list(t: torch.Tensor) -> list:
    return t.to(torch.float32).tolist()


def compute_reference(cfg: dict, w: dict[str, torch.Tensor], target) -> dict:
    w64 = {k: v.to(torch.float64) for k, v in w.items()}
    tw = target_weights()
    w64["target.embed_tokens.weight"] = tw["model.embed_tokens.weight"].to(torch.float64)
    w64["target.lm_head.weight"] = tw["lm_head.weight"].to(torch.float64)
    tref = target_reference()
    # Our rope frequencies must be transformers' (float32) ones.
    hf = target.model.rotary_emb.inv_freq.to(torch.float64)
    assert torch.allclose(inv_freq(cfg), hf, rtol=1e-6, atol=0), (inv_freq(cfg), hf)
    seqs = []
    for pi in PROMPTS:
        prompt = tref["prompts"][pi]["input_ids"]
        n = len(prompt)
        states32 = target_states(target, prompt)  # [n, hidden] float32
        hs = states32[: n - 1].to(torch.float64)
        ids = list(prompt[1:])
        pos = list(range(n - 1))
        logits, state = draft_forward(w64, cfg, ids, hs, pos)
        chosen = [int(r.argmax()) for r in logits]
        margins = [margin(r) for r in logits]
        seq = {
            "prompt_ids": prompt,
            "prefill": {
                "input_ids": list(ids),
                "positions": list(pos),
                "target_states": f32list(states32[: n - 1]),
                "logits": f32list(logits),
                "state": f32list(state),
                "token_ids": chosen,
                "min_margin": min(margins),
            },
            "chain": [],
        }
        prev_state, prev_tok = state[-1], chosen[-1]
        for step in range(CHAIN_STEPS):
            ids.append(prev_tok)
            pos.append(n - 1 + step)
            hs = torch.cat([hs, prev_state[None, :]], dim=0)
            logits, state = draft_forward(w64, cfg, ids, hs, pos)
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
        "head": OUT.name,
        "target": TARGET.name,
        **versions(),
        "target_layer": target.config.num_hidden_layers,
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
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
    chain = [c["token_id"] for s in ref["sequences"] for c in s["chain"]]
    if len(set(chain)) < 3:
        return f"chain tokens {chain} have fewer than 3 distinct ids"
    prefill = [t for s in ref["sequences"] for t in s["prefill"]["token_ids"]]
    if len(set(prefill)) < 8:
        return "prefill tokens have fewer than 8 distinct values"
    return None


def build(seed: int, target) -> tuple[dict, dict, dict]:
    cfg = head_config(target_config())
    w = make_weights(cfg, seed)
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
            f"last token {pf['token_ids'][-1]}, chain {[c['token_id'] for c in s['chain']]}, "
            f"max|logit| {max(abs(v) for r in pf['logits'] for v in r):.2f}, "
            f"max|state| {max(abs(v) for r in pf['state'] for v in r):.2f}"
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
        for key in ("input_ids", "token_ids", "positions"):
            if sw["prefill"][key] != sg["prefill"][key]:
                ok = False
                print(f"MISMATCH prefill {key}")
        for key in ("target_states", "logits", "state"):
            a, b = np.array(sw["prefill"][key]), np.array(sg["prefill"][key])
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1.0)))
        for cw, cg in zip(sw["chain"], sg["chain"], strict=True):
            for key in ("input_id", "position", "token_id"):
                if cw[key] != cg[key]:
                    ok = False
                    print(f"MISMATCH chain {key}")
            for key in ("logits", "state"):
                a, b = np.array(cw[key]), np.array(cg[key])
                worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1.0)))
    if worst > 1e-6 or acceptable(got) is not None:
        ok = False
    print(f"eagle-tiny-llama: ids ok={ok}, worst relative difference {worst:.2e}")
    if not ok:
        sys.exit("EAGLE reference check FAILED")
    print("EAGLE reference check passed")


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
