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

import time
from collections import Counter

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
)

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
    w = common.seeded_weights(shapes, STD, seed)
    target = target_weights()
    w["embed_tokens.weight"] = target["model.embed_tokens.weight"].clone().contiguous()
    hot = torch.tensor(hot_ids(tc, seed), dtype=torch.int64)
    w["d2t"] = hot - torch.arange(DRAFT_VOCAB, dtype=torch.int64)
    t2d = torch.zeros(tc["vocab_size"], dtype=torch.bool)
    t2d[hot] = True
    w["t2d"] = t2d
    return w


# ---------------------------------------------------------------------------------------------
# Target features (transformers) and the float64 draft forward (this file's own code).


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


def draft_forward(w64: dict, cfg: dict, ids: list[int], h: torch.Tensor, pos: list[int]):
    """One sequence, causal over all its rows. `h` is the fused hidden [t, hidden]. -> (logits, aux)."""
    eps = cfg["rms_norm_eps"]
    p = torch.tensor(pos)
    emb = w64["embed_tokens.weight"][torch.tensor(ids)]
    x = torch.cat(
        [rms(emb, w64["midlayer.input_layernorm.weight"], eps), rms(h, w64["midlayer.hidden_norm.weight"], eps)],
        dim=-1,
    )
    attn = attention(w64, "midlayer.self_attn.", x, p, cfg)
    r2 = attn + h
    h2 = rms(r2, w64["midlayer.post_attention_layernorm.weight"], eps)
    aux = mlp(w64, "midlayer.mlp.", h2) + r2
    logits = rms(aux, w64["norm.weight"], eps) @ w64["lm_head.weight"].T
    return logits, aux


def compute_reference(cfg: dict, w: dict[str, torch.Tensor], target) -> dict:
    w64 = {k: v.to(torch.float64) for k, v in w.items() if v.is_floating_point()}
    d2t = w["d2t"]
    tref = target_reference()
    common.check_inv_freq(cfg, target)
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
        # Each step feeds the previous aux and the previous draft token's target id.
        seq["chain"] = greedy_chain(
            lambda i, x, p: draft_forward(w64, cfg, i, x, p),
            ids,
            hs,
            pos,
            aux[-1],
            draft[-1],
            CHAIN_STEPS,
            "aux",
            lambda d: d + int(d2t[d]),
            lambda d: {"draft_id": d, "target_id": d + int(d2t[d])},
        )
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
    worst = common.worst_margin(ref)
    if worst < MIN_MARGIN:
        return f"top-2 margin {worst:.4f} < {MIN_MARGIN}"
    return common.too_few_distinct(ref, "target_id", "draft_ids", "prefill draft ids")


def build(seed: int, target) -> tuple[dict, dict, dict]:
    tc = target_config()
    cfg = head_config(tc)
    w = make_weights(tc, cfg, seed)
    ref = compute_reference(cfg, w, target)
    ref["seed"] = seed
    return cfg, w, ref


def write_all() -> None:
    t0 = time.time()
    target = common.load_target()
    cfg, w, ref = common.find_seed(build, acceptable, target, BASE_SEED, MAX_SEED_TRIES)
    common.write_head_folder(OUT, cfg, w, ref)
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
    want = common.read_json(OUT / "reference.json")
    target = common.load_target()
    cfg, w, ref = build(want["seed"], target)
    chk = common.Check()
    chk.same(common.read_json(OUT / "config.json"), cfg, "config.json")
    on_disk = chk.weights(OUT / "model.safetensors", w)
    # The reference recomputed from the committed weights.
    got = compute_reference(cfg, on_disk, target)
    chk.sequences(
        want,
        got,
        ("input_ids", "draft_ids", "target_ids", "positions"),
        ("features", "logits", "aux"),
        ("input_id", "position", "draft_id", "target_id"),
        ("logits", "aux"),
    )
    chk.finish(acceptable(got) is None, OUT.name, "EAGLE3")


if __name__ == "__main__":
    common.main(__doc__, check, write_all)
