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

import math
import shutil
import time

import draft_heads_common as common
import torch
from draft_heads_common import (
    FIXTURES,
    TARGET,
    attention,
    f32list,
    greedy_chain,
    margin,
    mlp,
    rms,
    target_config,
    target_reference,
    target_weights,
    versions,
    write_json,
)

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


def mtp_config(tc: dict) -> dict:
    cfg = dict(tc)
    cfg["num_nextn_predict_layers"] = 1
    return cfg


def mtp_index(cfg: dict, w: dict[str, torch.Tensor]) -> dict:
    idx = common.read_json(TARGET / "model.safetensors.index.json")
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
    return {prefix(cfg) + name: t for name, t in common.seeded_weights(shapes, STD, seed).items()}


# ---------------------------------------------------------------------------------------------
# Target states (transformers) and the float64 MTP forward (this file's own code).


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


def mtp_forward(w64: dict, cfg: dict, ids: list[int], h: torch.Tensor, pos: list[int], mask_pos0: bool = True):
    """One sequence, causal over all its rows; `h` [t, hidden] the states fed. -> (logits, state)."""
    eps = cfg["rms_norm_eps"]
    pre = prefix(cfg)
    p = torch.tensor(pos)
    emb = w64["model.embed_tokens.weight"][torch.tensor(ids)].clone()
    if mask_pos0:
        emb[p == 0] = 0
    cat = torch.cat([rms(emb, w64[pre + "enorm.weight"], eps), rms(h, w64[pre + "hnorm.weight"], eps)], dim=-1)
    x = cat @ w64[pre + "eh_proj.weight"].T
    n1 = rms(x, w64[pre + "input_layernorm.weight"], eps)
    attn = attention(w64, pre + "self_attn.", n1, p, cfg)
    r2 = attn + x
    n2 = rms(r2, w64[pre + "post_attention_layernorm.weight"], eps)
    state = mlp(w64, pre + "mlp.", n2) + r2
    # shared_head.head is absent from the checkpoint: the target's lm_head.
    logits = rms(state, w64[pre + "shared_head.norm.weight"], eps) @ w64["lm_head.weight"].T
    return logits, state


def compute_reference(cfg: dict, w: dict[str, torch.Tensor], target) -> dict:
    allw = {**target_weights(), **w}
    w64 = {k: v.to(torch.float64) for k, v in allw.items()}
    tref = target_reference()
    common.check_inv_freq(cfg, target)
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
        # Each step feeds the previous output state and token.
        seq["chain"] = greedy_chain(
            lambda i, x, p: mtp_forward(w64, cfg, i, x, p),
            ids,
            hs,
            pos,
            state[-1],
            tokens[-1],
            CHAIN_STEPS,
            "state",
            lambda t: t,
            lambda t: {"token_id": t},
        )
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
    worst = common.worst_margin(ref)
    if worst < MIN_MARGIN:
        return f"top-2 margin {worst:.4f} < {MIN_MARGIN}"
    if ref["position0_mask_effect"] < MIN_MASK_EFFECT:
        return f"position-0 masking moves logits by only {ref['position0_mask_effect']:.4f}"
    return common.too_few_distinct(ref, "token_id", "token_ids", "prefill tokens")


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
    common.save_weights(OUT / MTP_SHARD, w)


def write_all() -> None:
    t0 = time.time()
    # The base weights are tiny-llama's; write the folder once to load the target from it (it
    # must ignore the MTP layer's tensors), then per seed only the MTP shard changes.
    cfg = mtp_config(target_config())
    write_folder(cfg, make_weights(cfg, BASE_SEED))
    target = common.load_target(OUT)
    cfg, w, ref = common.find_seed(build, acceptable, target, BASE_SEED, MAX_SEED_TRIES)
    write_folder(cfg, w)
    common.finish_folder(OUT, ref)
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
    want = common.read_json(OUT / "reference.json")
    target = common.load_target(OUT)
    cfg, w, ref = build(want["seed"], target)
    chk = common.Check()
    chk.same(common.read_json(OUT / "config.json"), cfg, "config.json")
    chk.same(common.read_json(OUT / "model.safetensors.index.json"), mtp_index(cfg, w), "model.safetensors.index.json")
    for name in COPIED:
        chk.same((OUT / name).read_bytes(), (TARGET / name).read_bytes(), f"{name} (not tiny-llama's)")
    on_disk = chk.weights(OUT / MTP_SHARD, w)
    # The reference recomputed from the committed weights.
    got = compute_reference(cfg, on_disk, target)
    for sw, sg in zip(want["sequences"], got["sequences"], strict=True):
        chk.close(sw["target_hidden"], sg["target_hidden"])
    chk.sequences(
        want,
        got,
        ("input_ids", "token_ids", "positions"),
        ("logits", "state"),
        ("input_id", "position", "token_id"),
        ("logits", "state"),
    )
    chk.finish(acceptable(got) is None, OUT.name, "MTP")


if __name__ == "__main__":
    common.main(__doc__, check, write_all)
