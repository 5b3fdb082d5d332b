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
)

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
    return common.seeded_weights(shapes, STD, seed)


# ---------------------------------------------------------------------------------------------
# Target states (transformers) and the float64 draft forward (this file's own code).


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


def draft_forward(w64: dict, cfg: dict, ids: list[int], h: torch.Tensor, pos: list[int]):
    """One sequence, causal over all its rows. `h` is the input state [t, hidden]. -> (logits, state)."""
    eps = cfg["rms_norm_eps"]
    p = torch.tensor(pos)
    emb = w64["target.embed_tokens.weight"][torch.tensor(ids)]
    x = torch.cat([emb, h], dim=-1) @ w64["fc.weight"].T + w64["fc.bias"]
    for i in range(cfg["num_hidden_layers"]):
        pre = f"layers.{i}."
        a_in = x if i == 0 else rms(x, w64[pre + "input_layernorm.weight"], eps)
        x = x + attention(w64, pre + "self_attn.", a_in, p, cfg)
        h2 = rms(x, w64[pre + "post_attention_layernorm.weight"], eps)
        x = x + mlp(w64, pre + "mlp.", h2)
    logits = x @ w64["target.lm_head.weight"].T
    return logits, x


def compute_reference(cfg: dict, w: dict[str, torch.Tensor], target) -> dict:
    w64 = {k: v.to(torch.float64) for k, v in w.items()}
    tw = target_weights()
    w64["target.embed_tokens.weight"] = tw["model.embed_tokens.weight"].to(torch.float64)
    w64["target.lm_head.weight"] = tw["lm_head.weight"].to(torch.float64)
    tref = target_reference()
    common.check_inv_freq(cfg, target)
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
        # Each step feeds the previous output state and token.
        seq["chain"] = greedy_chain(
            lambda i, x, p: draft_forward(w64, cfg, i, x, p),
            ids,
            hs,
            pos,
            state[-1],
            chosen[-1],
            CHAIN_STEPS,
            "state",
            lambda t: t,
            lambda t: {"token_id": t},
        )
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
    worst = common.worst_margin(ref)
    if worst < MIN_MARGIN:
        return f"top-2 margin {worst:.4f} < {MIN_MARGIN}"
    return common.too_few_distinct(ref, "token_id", "token_ids", "prefill tokens")


def build(seed: int, target) -> tuple[dict, dict, dict]:
    cfg = head_config(target_config())
    w = make_weights(cfg, seed)
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
            f"last token {pf['token_ids'][-1]}, chain {[c['token_id'] for c in s['chain']]}, "
            f"max|logit| {max(abs(v) for r in pf['logits'] for v in r):.2f}, "
            f"max|state| {max(abs(v) for r in pf['state'] for v in r):.2f}"
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
        ("input_ids", "token_ids", "positions"),
        ("target_states", "logits", "state"),
        ("input_id", "position", "token_id"),
        ("logits", "state"),
    )
    chk.finish(acceptable(got) is None, OUT.name, "EAGLE")


if __name__ == "__main__":
    common.main(__doc__, check, write_all)
