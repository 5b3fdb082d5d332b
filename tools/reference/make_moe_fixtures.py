#!/usr/bin/env python3
"""Mixture-of-experts reference fixtures for Arbor (Qwen3-MoE, Qwen2-MoE, Mixtral).

Builds tiny seeded MoE models with Hugging Face transformers on the CPU and saves each one as a
Hugging Face folder under tests/fixtures/<name>/ in the published checkpoint layout (per-expert
tensors, `mlp.experts.{e}.{gate,up,down}_proj` for Qwen, `block_sparse_moe.experts.{e}.w1/w2/w3`
for Mixtral), exactly as `save_pretrained` writes them (transformers 5 holds the experts fused in
memory and converts on save and load). The reference (token ids, last-position logits, 32 greedy
tokens, single and left-padded batch) comes from the SAVED folder reloaded with
AutoModelForCausalLM, with make_fixtures.py's tokenizer, prompts and checks.

Seeds are searched as make_fixtures.py does, with one more condition: at every MoE layer, for
every token of every prompt and its greedy continuation, the router logit of the k-th chosen
expert exceeds the best unchosen one by more than MIN_ROUTER_GAP, so an f32 implementation that
differs from torch by rounding routes every token to the same experts.

    python tools/reference/make_moe_fixtures.py           # (re)write tests/fixtures/tiny-*-moe, tiny-mixtral
    python tools/reference/make_moe_fixtures.py --check   # reload the committed folders and compare

See tools/reference/README.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import make_fixtures as base
import numpy as np
import safetensors
import torch
import transformers
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

MIN_ROUTER_GAP = 1e-3
QWEN_TOKENIZER = {
    "tokenizer_family": "qwen2",
    "merges_style": "pairs",
    "tokenizer_config": {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": base.CHATML_QWEN_TEMPLATE,
        "tokenizer_class": "Qwen2Tokenizer",
        "errors": "replace",
        "split_special_tokens": False,
    },
    "generation_config": {"bos_token_id": base.ENDOFTEXT, "eos_token_id": base.IM_END, "pad_token_id": base.ENDOFTEXT},
}

DEEPSEEK_ROPE_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}

SPECS = [
    {
        "name": "tiny-qwen3-moe",
        "architecture": "Qwen3MoeForCausalLM",
        "seed": 5000,
        "model_cls": Qwen3MoeForCausalLM,
        "config": lambda: Qwen3MoeConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,  # the dense MLP of mlp_only_layers
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=None,
            bos_token_id=base.ENDOFTEXT,
            eos_token_id=base.IM_END,
        ),
        "config_spelling": "v5",
        "shards": 2,
        **QWEN_TOKENIZER,
    },
    {
        "name": "tiny-qwen2-moe",
        "architecture": "Qwen2MoeForCausalLM",
        "seed": 6000,
        "model_cls": Qwen2MoeForCausalLM,
        "config": lambda: Qwen2MoeConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=None,
            bos_token_id=base.ENDOFTEXT,
            eos_token_id=base.IM_END,
        ),
        "config_spelling": "v4",
        "shards": 1,
        **QWEN_TOKENIZER,
    },
    {
        "name": "tiny-deepseek-v2",
        "architecture": "DeepseekV2ForCausalLM",
        "seed": 8000,
        "model_cls": DeepseekV2ForCausalLM,
        "router_check": "perturb",
        "config": lambda: DeepseekV2Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters=dict(DEEPSEEK_ROPE_YARN),
            tie_word_embeddings=False,
            bos_token_id=base.ENDOFTEXT,
            eos_token_id=base.IM_END,
        ),
        "config_spelling": "v5",
        "shards": 1,
        **QWEN_TOKENIZER,
    },
    {
        "name": "tiny-deepseek-v3",
        "architecture": "DeepseekV3ForCausalLM",
        "seed": 9000,
        "model_cls": DeepseekV3ForCausalLM,
        "router_check": "perturb",
        "config": lambda: DeepseekV3Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            bos_token_id=base.ENDOFTEXT,
            eos_token_id=base.IM_END,
        ),
        "config_spelling": "v5",
        "shards": 1,
        **QWEN_TOKENIZER,
    },
    {
        "name": "tiny-mixtral",
        "architecture": "MixtralForCausalLM",
        "seed": 7000,
        "model_cls": MixtralForCausalLM,
        "config": lambda: MixtralConfig(
            vocab_size=base.TOKENIZER_VOCAB,
            hidden_size=64,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            sliding_window=None,
            tie_word_embeddings=False,
            bos_token_id=base.ENDOFTEXT,
            eos_token_id=base.IM_END,
        ),
        "config_spelling": "v5",
        "shards": 1,
        "tokenizer_family": "gpt2",
        "merges_style": "strings",
        "tokenizer_config": {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "chat_template": base.CHATML_BOS_TEMPLATE,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
        "generation_config": {"bos_token_id": base.ENDOFTEXT, "eos_token_id": base.IM_END},
    },
]


def init_weights(model: torch.nn.Module, seed: int, tokenizer_vocab: int) -> None:
    """make_fixtures' init, plus the fused 3-D expert tensors transformers 5 holds in memory and
    DeepSeek-V3's router bias (a buffer)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                lo, hi = (0.5, 1.5) if ("q_norm" in name or "k_norm" in name) else (0.8, 1.2)
                p.copy_(lo + (hi - lo) * torch.rand(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * base.BIAS_STD)
            elif "embed_tokens" in name or name == "lm_head.weight":
                w = torch.randn(p.shape, generator=g) * base.EMBED_STD
                w[tokenizer_vocab:] *= base.PAD_ROW_STD / base.EMBED_STD
                p.copy_(w)
            elif p.dim() in (2, 3):
                p.copy_(torch.randn(p.shape, generator=g) * base.LINEAR_STD)
            else:
                raise ValueError(f"unhandled parameter {name} {tuple(p.shape)}")


def published_state(model) -> dict:
    """The tensors `save_pretrained` writes (per-expert names), read back from a scratch folder."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        state = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            state.update(load_file(str(f)))
    return {k: v.contiguous().clone() for k, v in state.items()}


def save_folder(spec: dict, seed: int, base_tok, out: Path) -> None:
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
    state = published_state(model)
    assert any(".experts.0." in k for k in state), "expected per-expert tensors"
    assert not any(k.endswith("gate_up_proj") for k in state), "fused experts were written"
    names = sorted(state)
    n = spec["shards"]
    if n == 1:
        base.save_tensors({k: state[k] for k in names}, out / "model.safetensors")
    else:
        groups = [names[i::n] for i in range(n)]
        weight_map = {}
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            base.save_tensors({k: state[k] for k in group}, out / fname)
            weight_map.update({k: fname for k in group})
        total = sum(v.numel() * v.element_size() for v in state.values())
        base.write_json(
            out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
    (out / "tokenizer.json").write_text(
        base.family_tokenizer_json(base_tok, spec["tokenizer_family"], spec["merges_style"]), encoding="utf-8"
    )
    tcfg = {
        "added_tokens_decoder": base.added_tokens_decoder(),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        **spec["tokenizer_config"],
    }
    base.write_json(out / "tokenizer_config.json", tcfg)
    special = {k: tcfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if tcfg.get(k) is not None}
    base.write_json(out / "special_tokens_map.json", special)
    gen = {"transformers_version": transformers.__version__, **spec["generation_config"]}
    base.write_json(out / "generation_config.json", gen)


def load_folder(d: Path):
    """Reload; every stored tensor must reach the model unchanged (compared through a re-save)."""
    tok = AutoTokenizer.from_pretrained(str(d))
    model, info = AutoModelForCausalLM.from_pretrained(
        str(d), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    model.eval()
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), (d.name, key, info[key])
    again = published_state(model)
    stored = {}
    for f in sorted(d.glob("*.safetensors")):
        with safetensors.safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                stored[k] = sf.get_tensor(k)
    assert set(stored) == set(again), (d.name, set(stored) ^ set(again))
    for k, t in stored.items():
        assert t.dtype == torch.float32 and torch.equal(t, again[k]), (d.name, k)
    return tok, model


def router_gaps(model, ids: list[int]) -> float:
    """Smallest gap, over tokens and MoE layers, between the k-th chosen router logit and the best
    unchosen one."""
    gaps = []
    hooks = []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or isinstance(gate, torch.nn.Linear) and not hasattr(gate, "top_k"):
            continue
        k = model.config.num_experts_per_tok

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


def router_unstable(model, ids: list[int], trials: int = 4) -> int:
    """Tokens, over MoE layers, whose chosen experts change when the router's input is perturbed by
    1e-4 of its largest value (any scoring: the gate's own forward decides)."""
    inputs = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, o: inputs.append((m, i[0].detach().clone())))
        for layer in model.model.layers
        if hasattr(getattr(layer.mlp, "gate", None), "top_k")
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    assert inputs, "no router was hooked"
    g = torch.Generator().manual_seed(0)
    bad = 0
    with torch.no_grad():
        for gate, x in inputs:
            x = x.reshape(-1, x.shape[-1])
            want = torch.sort(gate(x)[2], dim=-1).values
            for _ in range(trials):
                noise = torch.randn(x.shape, generator=g) * 1e-4 * float(x.abs().max())
                got = torch.sort(gate(x + noise)[2], dim=-1).values
                bad += int((got != want).any(dim=-1).sum())
    return bad


def compute_reference(spec: dict, d: Path, seed: int):
    base.load_folder = load_folder  # make_fixtures' reference, with the MoE-aware reload
    ref, rope = base.compute_reference(spec, d, seed)
    _, model = load_folder(d)
    for p in ref["prompts"]:
        seq = p["input_ids"] + p["greedy_ids"]
        if spec.get("router_check") == "perturb":
            p["router_unstable_tokens"] = router_unstable(model, seq)
        else:
            p["min_router_gap"] = router_gaps(model, seq)
    ref["num_experts"] = getattr(model.config, "num_experts", None) or model.config.num_local_experts
    ref["num_experts_per_tok"] = model.config.num_experts_per_tok
    return ref, rope


def acceptable(ref: dict) -> str | None:
    why = base.acceptable(ref)
    if why:
        return why
    if any(p.get("router_unstable_tokens", 0) for p in ref["prompts"]):
        return "a perturbed router input changes the chosen experts"
    gaps = [p["min_router_gap"] for p in ref["prompts"] if "min_router_gap" in p]
    if gaps and min(gaps) <= MIN_ROUTER_GAP:
        return f"router gap {min(gaps):.2e} <= {MIN_ROUTER_GAP}"
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
        base.summarize(ref, d)
        gaps = [p["min_router_gap"] for p in ref["prompts"] if "min_router_gap" in p]
        if gaps:
            print(f"{'':13s} min router gap {min(gaps):.4f}")
    print(f"done in {time.time() - t0:.1f}s")


def check_all(only: list[str] | None, specs: list[dict] | None = None, compute=None) -> None:
    """Reloads the committed folders of `specs` (these SPECS by default) and compares their
    reference with a fresh one from `compute` (this compute_reference by default)."""
    ok = True
    for spec in specs or SPECS:
        if only and spec["name"] not in only:
            continue
        d = base.FIXTURES / spec["name"]
        want = json.loads((d / "reference.json").read_text(encoding="utf-8"))
        got, _ = (compute or compute_reference)(spec, d, want["seed"])
        worst = 0.0
        for pw, pg in zip(want["prompts"], got["prompts"]):
            for key in ("input_ids", "greedy_ids"):
                if pw[key] != pg[key]:
                    ok = False
                    print(f"MISMATCH {spec['name']} {key}")
            a, b = np.array(pw["last_logits"]), np.array(pg["last_logits"])
            worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))
        ok &= worst <= 1e-4
        print(f"{spec['name']:15s} greedy/ids ok, last_logits rel err {worst:.2e}")
    if not ok:
        sys.exit("reference check FAILED")
    print("reference check passed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    (check_all if args.check else build_all)(args.only)


if __name__ == "__main__":
    main()
