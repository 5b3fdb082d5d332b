#!/usr/bin/env python3
"""Hybrid-model reference fixtures for Arbor: Qwen3.5 (dense and MoE, ConditionalGeneration
checkpoints with a tiny vision tower) and Qwen3-Next (fused in_proj_qkvz / in_proj_ba).

Each model interleaves Gated DeltaNet recurrent layers ("linear_attention") with gated full
attention ("full_attention"). The models are built with transformers on the CPU from fixed seeds,
saved in the published checkpoint layout (save_pretrained), reloaded from the saved folder, and
their reference written to tests/fixtures/<name>/reference.json as make_fixtures.py does (token
ids, last-position logits, 32 greedy tokens, single and left-padded batch), on make_fixtures.py's
prompts plus one prompt of several GDN chunks (transformers' chunked gated delta rule runs in
chunks of 64 tokens; the long prompt has over 200).

    python tools/reference/make_hybrid_fixtures.py           # (re)write tests/fixtures/tiny-qwen3*-hybrid*
    python tools/reference/make_hybrid_fixtures.py --check   # reload the committed folders and compare

See tools/reference/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import make_fixtures as base
import make_moe_fixtures as moe
import numpy as np
import safetensors
import torch
from transformers import (
    AutoTokenizer,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

LONG_PROMPT = " ".join(
    (base.CORPUS.read_text(encoding="utf-8").split())[:170]
)  # ~250 tokens: four GDN chunks of 64

TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=64,
    num_position_embeddings=16,
)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)

SPECS = [
    {
        "name": "tiny-qwen3.5",
        "architecture": "Qwen3_5ForConditionalGeneration",
        "config": lambda: Qwen3_5Config(text_config=dict(TEXT), vision_config=dict(VISION), tie_word_embeddings=False),
        "model_cls": Qwen3_5ForConditionalGeneration,
        "seed": 5005,
        "shards": 1,
        **moe.QWEN_TOKENIZER,
    },
    {
        "name": "tiny-qwen3.5-moe",
        "architecture": "Qwen3_5MoeForConditionalGeneration",
        "config": lambda: Qwen3_5MoeConfig(
            text_config={**TEXT, **EXPERTS}, vision_config=dict(VISION), tie_word_embeddings=False
        ),
        "model_cls": Qwen3_5MoeForConditionalGeneration,
        "seed": 5105,
        "shards": 1,
        "router_check": "gap",
        **moe.QWEN_TOKENIZER,
    },
    {
        "name": "tiny-qwen3-next",
        "architecture": "Qwen3NextForCausalLM",
        "config": lambda: Qwen3NextConfig(**TEXT, **EXPERTS, decoder_sparse_step=1, norm_topk_prob=True),
        "model_cls": Qwen3NextForCausalLM,
        "seed": 5205,
        "shards": 1,
        "router_check": "gap",
        **moe.QWEN_TOKENIZER,
    },
]
for s in SPECS:
    s["config_spelling"] = "v5"


def init_weights(model: torch.nn.Module, seed: int, tokenizer_vocab: int) -> None:
    """make_fixtures' scales; the recurrent layers' decay A = exp(A_log) in [0.5, 8]."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("A_log"):
                p.copy_(torch.log(0.5 + 7.5 * torch.rand(p.shape, generator=g)))
            elif name.endswith("norm.weight") and ".visual." not in name:
                # Zero-centred (1 + w) norms, and the gated norm's plain weight near 1.
                if "linear_attn.norm" in name:
                    p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=g))
                else:
                    p.copy_(-0.2 + 0.4 * torch.rand(p.shape, generator=g))
            elif "embed_tokens" in name or name == "lm_head.weight":
                w = torch.randn(p.shape, generator=g) * base.EMBED_STD
                w[tokenizer_vocab:] *= base.PAD_ROW_STD / base.EMBED_STD
                p.copy_(w)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * base.LINEAR_STD)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * base.BIAS_STD)


def save_folder(spec: dict, seed: int, base_tok, out: Path) -> None:
    """make_moe_fixtures' save (published layout, tokenizer files) without its expert check."""
    import shutil

    import transformers

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config = spec["config"]()
    config.architectures = [spec["architecture"]]
    torch.manual_seed(seed)
    model = spec["model_cls"](config).eval()
    init_weights(model, seed, base.TOKENIZER_VOCAB)
    cfg = json.loads(config.to_json_string(use_diff=True))
    base.write_json(out / "config.json", base.spell_config(cfg, spec["config_spelling"]))
    state = moe.published_state(model)
    base.save_tensors({k: state[k] for k in sorted(state)}, out / "model.safetensors")
    (out / "tokenizer.json").write_text(
        base.family_tokenizer_json(base_tok, spec["tokenizer_family"], spec["merges_style"]), encoding="utf-8"
    )
    tcfg = {
        "added_tokens_decoder": base.added_tokens_decoder(),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        **spec["tokenizer_config"],
    }
    base.write_json(out / "tokenizer_config.json", tcfg)
    special = {k: tcfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if tcfg.get(k) is not None}
    base.write_json(out / "special_tokens_map.json", special)
    gen = {"transformers_version": transformers.__version__, **spec["generation_config"]}
    base.write_json(out / "generation_config.json", gen)


def load_folder(d: Path):
    """Reload with the architecture's own class; every stored tensor must reach the model
    unchanged (compared through a re-save)."""
    spec = next(s for s in SPECS if s["name"] == d.name)
    tok = AutoTokenizer.from_pretrained(str(d))
    model, info = spec["model_cls"].from_pretrained(
        str(d), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    model.eval()
    if not hasattr(model.config, "vocab_size"):
        # make_fixtures reads the vocabulary from the top-level config.
        object.__setattr__(model.config, "vocab_size", model.config.get_text_config().vocab_size)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), (d.name, key, info[key])
    again = moe.published_state(model)
    stored = {}
    for f in sorted(d.glob("*.safetensors")):
        with safetensors.safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                stored[k] = sf.get_tensor(k)
    assert set(stored) == set(again), (d.name, set(stored) ^ set(again))
    for k, t in stored.items():
        assert t.dtype == torch.float32 and torch.equal(t, again[k]), (d.name, k)
    return tok, model


def text_layers(model):
    inner = model.model
    return (inner.language_model if hasattr(inner, "language_model") else inner).layers


def router_gaps(model, ids: list[int]) -> float:
    gaps = []
    hooks = []
    k = model.config.get_text_config().num_experts_per_tok
    for layer in text_layers(model):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue

        def hook(_m, _i, out, k=k):
            logits = out[0] if isinstance(out, tuple) else out
            top = torch.topk(logits.float(), k + 1, dim=-1).values
            gaps.append(float((top[:, k - 1] - top[:, k]).min()))

        hooks.append(gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    assert gaps, "no router was hooked"
    return min(gaps)


def compute_reference(spec: dict, d: Path, seed: int):
    base.load_folder = load_folder
    base.check_config = lambda spec, model: {}
    ref, rope = base.compute_reference(spec, d, seed)
    tok, model = load_folder(d)
    ref["prompts"].append(long_prompt_reference(tok, model))
    text = model.config.get_text_config()
    ref["layer_types"] = list(text.layer_types)
    if spec.get("router_check"):
        for p in ref["prompts"]:
            p["min_router_gap"] = router_gaps(model, p["input_ids"] + p["greedy_ids"])
    return ref, rope


def long_prompt_reference(tok, model) -> dict:
    """make_fixtures' single-prompt reference for LONG_PROMPT (the batch check there takes its
    three prompts only)."""
    ids = tok(LONG_PROMPT)["input_ids"]
    assert len(ids) > 3 * 64, len(ids)
    x = torch.tensor([ids])
    with torch.no_grad():
        last = model(x).logits[0, -1].float()
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=base.NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=base.ENDOFTEXT,
            output_logits=True,
            return_dict_in_generate=True,
        )
    gen = out.sequences[0, len(ids) :].tolist()
    step_logits = torch.stack([s[0] for s in out.logits]).float()
    top2 = torch.topk(step_logits, 2, dim=-1).values
    assert torch.equal(torch.argmax(step_logits, -1), torch.tensor(gen))
    assert base.greedy_manual(model, ids, base.NEW_TOKENS) == gen
    return {
        "text": LONG_PROMPT,
        "input_ids": ids,
        "last_logits": [float(v) for v in last.numpy().astype(np.float32)],
        "greedy_ids": gen,
        "greedy_text": tok.decode(gen, skip_special_tokens=False),
        "min_margin": float((top2[:, 0] - top2[:, 1]).min()),
    }


# The long prompt makes thousands of routing decisions: its smallest router gap must stay well
# above f32 rounding (1e-6 of the logits), the short prompts' above make_moe_fixtures' 1e-3.
LONG_MIN_ROUTER_GAP = 1e-4


def acceptable(ref: dict) -> str | None:
    why = base.acceptable(ref)
    if why:
        return why
    *short, long = ref["prompts"]
    gaps = [p["min_router_gap"] for p in short if "min_router_gap" in p]
    if gaps and min(gaps) <= moe.MIN_ROUTER_GAP:
        return f"router gap {min(gaps):.2e} <= {moe.MIN_ROUTER_GAP}"
    if long.get("min_router_gap", 1.0) <= LONG_MIN_ROUTER_GAP:
        return f"long prompt's router gap {long['min_router_gap']:.2e} <= {LONG_MIN_ROUTER_GAP}"
    return None


def build_all(only: list[str] | None) -> None:
    t0 = time.time()
    tok = base.train_base_tokenizer()
    for spec in SPECS:
        if only and spec["name"] not in only:
            continue
        d = base.FIXTURES / spec["name"]
        for attempt in range(base.MAX_SEED_TRIES):
            seed = spec["seed"] + attempt
            save_folder(spec, seed, tok, d)
            ref, _ = compute_reference(spec, d, seed)
            why = acceptable(ref)
            if why is None:
                break
            print(f"  {spec['name']}: seed {seed} rejected ({why})")
        else:
            sys.exit(f"{spec['name']}: no acceptable seed in {base.MAX_SEED_TRIES} tries")
        base.write_json(d / "reference.json", ref)
        print(
            f"{spec['name']:18s} seed {ref['seed']} prompts {[len(p['input_ids']) for p in ref['prompts']]} "
            f"min margin {min(p['min_margin'] for p in ref['prompts']):.4f}"
        )
    print(f"done in {time.time() - t0:.1f}s")


def check_all(only: list[str] | None) -> None:
    moe.check_all(only, SPECS, compute_reference)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    (check_all if args.check else build_all)(args.only)


if __name__ == "__main__":
    main()
