#!/usr/bin/env python3
"""Qwen3.5 / Qwen3-Next MTP (NEXTN) references for Arbor.

Builds, for each hybrid target below, tests/fixtures/<target>-mtp/: the target folder (its weights
byte for byte, tokenizer files copied, its config with `mtp_num_hidden_layers: 1` added where the
published checkpoints keep it: in `text_config` for Qwen3.5's ConditionalGeneration layout, at the
top for Qwen3-Next) plus `model-mtp.safetensors` holding a seeded MTP module in the published
layout: `mtp.fc.weight` [h, 2h], `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
`mtp.norm.weight` (zero-centred (1 + w) norms) and one gated full-attention decoder layer at
`mtp.layers.0.*` (dense for Qwen3.5; routed experts under their per-expert checkpoint names and a
gated shared expert for Qwen3-Next). `model.safetensors.index.json` maps both shards. The embedding
and the LM head are the target's (the published checkpoints have none under `mtp.`).

The MTP forward follows SGLang's `Qwen3_5ForCausalLMMTP` / `Qwen3NextForCausalLMMTP`
(python/sglang/srt/models/qwen3_5_mtp.py), in float64, with transformers' own one-layer text model
(`Qwen3_5TextModel` / `Qwen3NextModel`, eager attention) as the block:

    e = embed(ids)                                    (no position-0 masking, as SGLang)
    x = fc(cat([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)], -1))
    state = text_model(inputs_embeds=x)               (one full_attention layer, then mtp.norm)
    logits = lm_head(state)                           state feeds the next draft step

where `h` is the target's final hidden state after its final norm (a hook on the text model's
`norm`) or the previous step's state. reference.json has make_mtp_fixture.py's layout (target
states, a prefill over each prompt shifted by one, three greedy chain steps). Seeds are searched
until every MTP argmax has a top-2 gap of 1e-2 and, for the MoE layer, every router's k-th and
(k+1)-th logits differ by 1e-3.

    python tools/reference/make_hybrid_mtp_fixture.py           # (re)write the folders
    python tools/reference/make_hybrid_mtp_fixture.py --check   # rebuild in memory and compare

Needs torch, transformers 5.x, safetensors, numpy. See tools/reference/README.md.
"""

from __future__ import annotations

import copy
import json
import shutil
import time

import draft_heads_common as common
import torch
from draft_heads_common import FIXTURES, f32list, greedy_chain, margin, versions, write_json
from safetensors.torch import load_file
from transformers import AutoConfig

MTP_SHARD = "model-mtp.safetensors"
COPIED = [
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
]
BASE_SEED = 13000
MAX_SEED_TRIES = 200
PROMPTS = [0, 1]
CHAIN_STEPS = 3
MIN_MARGIN = 1e-2
MIN_ROUTER_GAP = 1e-3
# target folder, base seed offset
TARGETS = [("tiny-qwen3.5", 0), ("tiny-qwen3-next", 500)]


def text_config_dict(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def one_layer_model(target_dir, seed: int | None):
    """transformers' text model of the target's config with one full_attention layer, in float64;
    seeded random weights when `seed` is given."""
    full = AutoConfig.from_pretrained(str(target_dir))
    text = copy.deepcopy(getattr(full, "text_config", full))
    text.num_hidden_layers = 1
    text.layer_types = ["full_attention"]
    if hasattr(text, "full_attention_interval"):
        text.full_attention_interval = 1
    text._attn_implementation = "eager"
    text._experts_implementation = "eager"  # float64: grouped_mm takes no doubles
    if text.model_type == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextModel as Text
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel as Text
    torch.manual_seed(0)
    model = Text(text).eval()
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                if name.endswith("norm.weight"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))  # zero-centred (1 + w)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model.double(), text


def published(state: dict, inter: int | None) -> dict:
    """The layer's tensors under the checkpoint's per-expert names (transformers 5 fuses
    `experts.gate_up_proj` [E, 2I, H] = [gate; up] and `experts.down_proj` [E, H, I] in memory)."""
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = v[e, :inter].contiguous().clone()
                out[f"{pre}{e}.up_proj.weight"] = v[e, inter:].contiguous().clone()
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e].contiguous().clone()
        else:
            out[k] = v.detach().contiguous().clone()
    return out


def fused(model, w: dict) -> dict:
    """`w`'s `mtp.*` tensors as the one-layer text model's state dict."""
    sd = {}
    for k, v in model.state_dict().items():
        if k == "embed_tokens.weight":
            sd[k] = torch.zeros_like(v)  # the block runs from inputs_embeds
        elif k.endswith("mlp.experts.gate_up_proj"):
            pre = "mtp." + k[: -len("gate_up_proj")]
            n = v.shape[0]
            sd[k] = torch.stack(
                [torch.cat([w[f"{pre}{e}.gate_proj.weight"], w[f"{pre}{e}.up_proj.weight"]]) for e in range(n)]
            )
        elif k.endswith("mlp.experts.down_proj"):
            pre = "mtp." + k[: -len("down_proj")]
            sd[k] = torch.stack([w[f"{pre}{e}.down_proj.weight"] for e in range(v.shape[0])])
        else:
            sd[k] = w["mtp." + k]
    return {k: v.double() for k, v in sd.items()}


def make_weights(target_dir, seed: int) -> dict:
    cfg = text_config_dict(json.loads((target_dir / "config.json").read_text(encoding="utf-8")))
    h = cfg["hidden_size"]
    model, _ = one_layer_model(target_dir, seed)
    inter = cfg.get("moe_intermediate_size")
    w = {
        "mtp." + k: v.float()
        for k, v in published(model.state_dict(), inter).items()
        if k != "embed_tokens.weight"
    }
    g = torch.Generator().manual_seed(seed + 1)
    w["mtp.pre_fc_norm_embedding.weight"] = 0.1 * torch.randn([h], generator=g)
    w["mtp.pre_fc_norm_hidden.weight"] = 0.1 * torch.randn([h], generator=g)
    w["mtp.fc.weight"] = 0.1 * torch.randn([h, 2 * h], generator=g)
    return w


def gemma_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


class Mtp:
    """The MTP forward in float64 (see the module doc)."""

    def __init__(self, target_dir, w: dict, target) -> None:
        self.model, text = one_layer_model(target_dir, None)
        self.model.load_state_dict(fused(self.model, w), strict=True)
        self.eps = text.rms_norm_eps
        self.ne = w["mtp.pre_fc_norm_embedding.weight"].double()
        self.nh = w["mtp.pre_fc_norm_hidden.weight"].double()
        self.fc = w["mtp.fc.weight"].double()
        self.embed = target.get_input_embeddings().weight.detach().double()
        self.head = target.get_output_embeddings().weight.detach().double()
        self.top_k = getattr(text, "num_experts_per_tok", 0)
        self.router_inputs: list[torch.Tensor] = []
        gate = dict(self.model.named_modules()).get("layers.0.mlp.gate")
        self.gate = gate
        if gate is not None:
            gate.register_forward_hook(lambda _m, i, _o: self.router_inputs.append(i[0].detach().clone()))

    @torch.no_grad()
    def __call__(self, ids: list[int], hs: torch.Tensor, pos: list[int]):
        e = self.embed[torch.tensor(ids)]
        x = torch.cat([gemma_rms(e, self.ne, self.eps), gemma_rms(hs.double(), self.nh, self.eps)], dim=-1) @ self.fc.T
        out = self.model(inputs_embeds=x[None], position_ids=torch.tensor(pos)[None], use_cache=False)
        state = out.last_hidden_state[0]
        return state @ self.head.T, state

    def router_gap(self) -> float | None:
        """The smallest gap between a router's k-th and (k+1)-th logits (None without experts)."""
        if self.gate is None:
            return None
        gap = float("inf")
        for x in self.router_inputs:
            logits = x.reshape(-1, x.shape[-1]) @ self.gate.weight.T
            top = torch.sort(logits, dim=-1, descending=True).values
            gap = min(gap, float((top[:, self.top_k - 1] - top[:, self.top_k]).min()))
        return gap


@torch.no_grad()
def target_states(model, ids: list[int]) -> torch.Tensor:
    mods = dict(model.named_modules())
    norm = mods.get("model.language_model.norm") or mods["model.norm"]
    seen: list[torch.Tensor] = []
    hook = norm.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    try:
        model(torch.tensor([ids]))
    finally:
        hook.remove()
    return seen[0][0]


def compute_reference(target_dir, out_dir, w: dict, target) -> dict:
    tref = json.loads((target_dir / "reference.json").read_text(encoding="utf-8"))
    mtp = Mtp(target_dir, w, target)
    seqs = []
    for pi in PROMPTS:
        prompt = tref["prompts"][pi]["input_ids"]
        n = len(prompt)
        states32 = target_states(target, prompt)
        hs = states32[: n - 1].double()
        ids, pos = list(prompt[1:]), list(range(n - 1))
        logits, state = mtp(ids, hs, pos)
        tokens = [int(r.argmax()) for r in logits]
        seq = {
            "prompt_ids": prompt,
            "target_hidden": f32list(states32),
            "prefill": {
                "input_ids": list(ids),
                "positions": list(pos),
                "logits": f32list(logits),
                "state": f32list(state),
                "token_ids": tokens,
                "min_margin": min(margin(r) for r in logits),
            },
        }
        seq["chain"] = greedy_chain(
            mtp, ids, hs, pos, state[-1], tokens[-1], CHAIN_STEPS, "state", lambda t: t, lambda t: {"token_id": t}
        )
        seqs.append(seq)
    cfg = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    text = text_config_dict(cfg)
    return {
        "checkpoint": out_dir.name,
        "target": target_dir.name,
        **versions(),
        "hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
        "router_gap": mtp.router_gap(),
        "sequences": seqs,
    }


def acceptable(ref: dict) -> str | None:
    worst = common.worst_margin(ref)
    if worst < MIN_MARGIN:
        return f"top-2 margin {worst:.4f} < {MIN_MARGIN}"
    if ref["router_gap"] is not None and ref["router_gap"] < MIN_ROUTER_GAP:
        return f"router gap {ref['router_gap']:.2e} < {MIN_ROUTER_GAP}"
    return common.too_few_distinct(ref, "token_id", "token_ids", "prefill tokens")


def mtp_config(target_dir) -> dict:
    cfg = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    text_config_dict(cfg)["mtp_num_hidden_layers"] = 1
    return cfg


def mtp_index(target_dir, w: dict) -> dict:
    base = load_file(str(target_dir / "model.safetensors"))
    weight_map = {k: "model.safetensors" for k in base}
    weight_map.update({k: MTP_SHARD for k in w})
    total = sum(t.numel() * t.element_size() for t in list(base.values()) + list(w.values()))
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def build_for(target_dir, out_dir):
    def build(seed: int, target):
        w = make_weights(target_dir, seed)
        ref = compute_reference(target_dir, out_dir, w, target)
        ref["seed"] = seed
        return mtp_config(target_dir), w, ref

    return build


def write_all() -> None:
    for name, offset in TARGETS:
        t0 = time.time()
        target_dir, out = FIXTURES / name, FIXTURES / f"{name}-mtp"
        target = common.load_target(target_dir)
        cfg, w, ref = common.find_seed(build_for(target_dir, out), acceptable, target, BASE_SEED + offset, MAX_SEED_TRIES)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for f in COPIED:
            shutil.copyfile(target_dir / f, out / f)
        write_json(out / "config.json", cfg)
        write_json(out / "model.safetensors.index.json", mtp_index(target_dir, w))
        common.save_weights(out / MTP_SHARD, w)
        common.finish_folder(out, ref)
        for s in ref["sequences"]:
            pf = s["prefill"]
            print(
                f"{name}: seed {ref['seed']} prompt of {len(s['prompt_ids'])}: prefill margin "
                f"{pf['min_margin']:.3f}, chain {[c['token_id'] for c in s['chain']]}"
            )
        print(f"wrote {out} in {time.time() - t0:.1f}s")


def check() -> None:
    for name, _ in TARGETS:
        target_dir, out = FIXTURES / name, FIXTURES / f"{name}-mtp"
        want = common.read_json(out / "reference.json")
        target = common.load_target(target_dir)
        cfg, w, ref = build_for(target_dir, out)(want["seed"], target)
        chk = common.Check()
        chk.same(common.read_json(out / "config.json"), cfg, "config.json")
        for f in COPIED:
            chk.same((out / f).read_bytes(), (target_dir / f).read_bytes(), f"{f} (not {name}'s)")
        chk.weights(out / MTP_SHARD, w)
        chk.sequences(
            want,
            ref,
            ("input_ids", "token_ids", "positions"),
            ("logits", "state"),
            ("input_id", "position", "token_id"),
            ("logits", "state"),
        )
        chk.finish(acceptable(ref) is None, out.name, f"{name} MTP")


if __name__ == "__main__":
    common.main(__doc__, check, write_all)
