#!/usr/bin/env python3
"""DeepSeek-V3 MTP / NEXTN reference for Arbor.

Builds tests/fixtures/tiny-deepseek-v3-mtp/: tests/fixtures/tiny-deepseek-v3 (its shard copied byte
for byte, its config with `num_nextn_predict_layers: 1`) plus `model-mtp.safetensors` holding a
seeded next-n layer at `model.layers.3.` (3 = num_hidden_layers) in DeepSeek-V3's checkpoint layout:
`enorm`, `hnorm`, `eh_proj` [h, 2h], one DeepSeek-V3 decoder layer (latent attention: `q_a_proj`,
`q_a_layernorm`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`; a MoE
block: `mlp.gate` with its `e_score_correction_bias`, `mlp.experts.{e}.{gate,up,down}_proj`,
`mlp.shared_experts.*`) and `shared_head.norm`; `shared_head.head` and `embed_tokens` are absent
(the target's `lm_head` and embedding stand in).

The reference runs the layer with transformers' own `DeepseekV3DecoderLayer` (and its rotary
embedding and RMSNorm) in float64, eager attention with a causal mask, loaded with the layer's
weights, inside the MTP formula of vLLM's `DeepSeekMultiTokenPredictorLayer`:

    e = embed(ids); e[positions == 0] = 0
    x = eh_proj(cat([enorm(e), hnorm(h)], -1))      h = target final-normed state or previous state
    state = DeepseekV3DecoderLayer(x)                logits = lm_head(shared_head.norm(state))

reference.json has make_mtp_fixture.py's layout (target states, a prefill over each prompt shifted
by one, three greedy chain steps). Seeds are searched until every MTP argmax has a top-2 gap of 1e-2
and perturbing the MTP router's input by 1e-4 of its largest value never changes its experts.

    python tools/reference/make_deepseek_mtp_fixture.py           # (re)write the folder
    python tools/reference/make_deepseek_mtp_fixture.py --check   # rebuild in memory and compare
"""

from __future__ import annotations

import json
import shutil
import time

import draft_heads_common as common
import torch
from draft_heads_common import FIXTURES, f32list, greedy_chain, margin, versions, write_json
from safetensors.torch import load_file
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

TARGET = FIXTURES / "tiny-deepseek-v3"
OUT = FIXTURES / "tiny-deepseek-v3-mtp"
MTP_SHARD = "model-mtp.safetensors"
COPIED = [
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
]
BASE_SEED = 12000
MAX_SEED_TRIES = 200
PROMPTS = [0, 1]
CHAIN_STEPS = 3
MIN_MARGIN = 1e-2


def target_config() -> dict:
    return json.loads((TARGET / "config.json").read_text(encoding="utf-8"))


def hf_config(cfg: dict):
    c = ds.DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")})
    c._attn_implementation = "eager"
    return c


def layer_module(cfg: dict, seed: int) -> torch.nn.Module:
    """A seeded DeepSeek-V3 decoder layer (MoE: its index is past first_k_dense_replace)."""
    c = hf_config(cfg)
    torch.manual_seed(seed)
    layer = ds.DeepseekV3DecoderLayer(c, layer_idx=cfg["num_hidden_layers"]).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
        for name, b in sorted(layer.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return layer


def published(layer_state: dict, inter: int) -> dict:
    """The layer's tensors under the checkpoint's per-expert names (transformers 5 fuses
    `experts.gate_up_proj` [E, 2I, H] = [gate; up] and `experts.down_proj` [E, H, I] in memory)."""
    out = {}
    for k, v in layer_state.items():
        if k == "mlp.experts.gate_up_proj":
            for e in range(v.shape[0]):
                out[f"mlp.experts.{e}.gate_proj.weight"] = v[e, :inter].contiguous().clone()
                out[f"mlp.experts.{e}.up_proj.weight"] = v[e, inter:].contiguous().clone()
        elif k == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out[f"mlp.experts.{e}.down_proj.weight"] = v[e].contiguous().clone()
        else:
            out[k] = v.detach().contiguous().clone()
    return out


def check_expert_layout(target) -> None:
    """The per-expert conversion above equals what save_pretrained wrote for the target's layer 1."""
    saved = load_file(str(TARGET / "model.safetensors"))
    layer = target.model.layers[1]
    mine = published(layer.state_dict(), target.config.moe_intermediate_size)
    for k, v in mine.items():
        assert torch.equal(saved[f"model.layers.1.{k}"], v), k


def make_weights(cfg: dict, seed: int) -> dict:
    h = cfg["hidden_size"]
    pre = f"model.layers.{cfg['num_hidden_layers']}."
    layer = layer_module(cfg, seed)
    w = {pre + k: v for k, v in published(layer.state_dict(), cfg["moe_intermediate_size"]).items()}
    g = torch.Generator().manual_seed(seed + 1)
    w[pre + "enorm.weight"] = 0.8 + 0.4 * torch.rand([h], generator=g)
    w[pre + "hnorm.weight"] = 0.8 + 0.4 * torch.rand([h], generator=g)
    w[pre + "eh_proj.weight"] = 0.1 * torch.randn([h, 2 * h], generator=g)
    w[pre + "shared_head.norm.weight"] = 0.8 + 0.4 * torch.rand([h], generator=g)
    return w


class Mtp:
    """The MTP forward in float64 around transformers' decoder layer, loaded from the weights."""

    def __init__(self, cfg: dict, w: dict, target) -> None:
        self.cfg = cfg
        pre = f"model.layers.{cfg['num_hidden_layers']}."
        c = hf_config(cfg)
        self.layer = ds.DeepseekV3DecoderLayer(c, layer_idx=cfg["num_hidden_layers"]).eval()
        fused = {}
        inter = cfg["moe_intermediate_size"]
        n = cfg["n_routed_experts"]
        for k in self.layer.state_dict():
            if k == "mlp.experts.gate_up_proj":
                fused[k] = torch.stack(
                    [torch.cat([w[f"{pre}mlp.experts.{e}.gate_proj.weight"], w[f"{pre}mlp.experts.{e}.up_proj.weight"]]) for e in range(n)]
                )
            elif k == "mlp.experts.down_proj":
                fused[k] = torch.stack([w[f"{pre}mlp.experts.{e}.down_proj.weight"] for e in range(n)])
            else:
                fused[k] = w[pre + k]
        assert inter == fused["mlp.experts.down_proj"].shape[-1]
        self.layer.load_state_dict(fused, strict=True)
        self.layer.double()
        self.rotary = ds.DeepseekV3RotaryEmbedding(c).double()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.norms = {}
        for name in ("enorm", "hnorm", "shared_head.norm"):
            m = ds.DeepseekV3RMSNorm(h, eps=eps).double()
            m.weight.data.copy_(w[pre + name + ".weight"].double())
            self.norms[name] = m
        self.eh = w[pre + "eh_proj.weight"].double()
        self.embed = target.model.embed_tokens.weight.detach().double()
        self.head = target.lm_head.weight.detach().double()
        self.router_inputs: list[torch.Tensor] = []
        self.hook = self.layer.mlp.gate.register_forward_hook(
            lambda _m, i, _o: self.router_inputs.append(i[0].detach().clone())
        )

    @torch.no_grad()
    def __call__(self, ids: list[int], hs: torch.Tensor, pos: list[int]):
        p = torch.tensor(pos)
        e = self.embed[torch.tensor(ids)].clone()
        e[p == 0] = 0
        x = torch.cat([self.norms["enorm"](e), self.norms["hnorm"](hs.double())], dim=-1) @ self.eh.T
        t = x.shape[0]
        mask = torch.full((t, t), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
        cos_sin = self.rotary(x[None], p[None])
        state = self.layer(x[None], attention_mask=mask, position_ids=p[None], position_embeddings=cos_sin)[0]
        logits = self.norms["shared_head.norm"](state) @ self.head.T
        return logits, state

    def router_unstable(self) -> int:
        self.hook.remove()  # the checks below call the gate again
        gate = self.layer.mlp.gate
        g = torch.Generator().manual_seed(0)
        bad = 0
        with torch.no_grad():
            for x in self.router_inputs:
                x = x.reshape(-1, x.shape[-1])
                want = torch.sort(gate(x)[2], dim=-1).values
                for _ in range(4):
                    noise = torch.randn(x.shape, generator=g, dtype=x.dtype) * 1e-4 * float(x.abs().max())
                    got = torch.sort(gate(x + noise)[2], dim=-1).values
                    bad += int((got != want).any(dim=-1).sum())
        return bad


@torch.no_grad()
def target_states(model, ids: list[int]) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    try:
        model(torch.tensor([ids]))
    finally:
        hook.remove()
    return seen[0][0]


def compute_reference(cfg: dict, w: dict, target) -> dict:
    tref = json.loads((TARGET / "reference.json").read_text(encoding="utf-8"))
    mtp = Mtp(cfg, w, target)
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
    return {
        "checkpoint": OUT.name,
        "target": TARGET.name,
        **versions(),
        "mtp_layer": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "vocab_size": cfg["vocab_size"],
        "router_unstable_tokens": mtp.router_unstable(),
        "sequences": seqs,
    }


def acceptable(ref: dict) -> str | None:
    worst = common.worst_margin(ref)
    if worst < MIN_MARGIN:
        return f"top-2 margin {worst:.4f} < {MIN_MARGIN}"
    if ref["router_unstable_tokens"]:
        return f"{ref['router_unstable_tokens']} tokens change experts under a 1e-4 perturbation"
    return common.too_few_distinct(ref, "token_id", "token_ids", "prefill tokens")


def mtp_config() -> dict:
    cfg = target_config()
    cfg["num_nextn_predict_layers"] = 1
    return cfg


def build(seed: int, target):
    cfg = mtp_config()
    w = make_weights(cfg, seed)
    ref = compute_reference(cfg, w, target)
    ref["seed"] = seed
    return cfg, w, ref


def mtp_index(w: dict) -> dict:
    base = load_file(str(TARGET / "model.safetensors"))
    weight_map = {k: "model.safetensors" for k in base}
    weight_map.update({k: MTP_SHARD for k in w})
    total = sum(t.numel() * t.element_size() for t in list(base.values()) + list(w.values()))
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def write_folder(cfg: dict, w: dict) -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    for name in COPIED:
        shutil.copyfile(TARGET / name, OUT / name)
    write_json(OUT / "config.json", cfg)
    write_json(OUT / "model.safetensors.index.json", mtp_index(w))
    common.save_weights(OUT / MTP_SHARD, w)


def write_all() -> None:
    t0 = time.time()
    target = common.load_target(TARGET)
    check_expert_layout(target)
    cfg, w, ref = common.find_seed(build, acceptable, target, BASE_SEED, MAX_SEED_TRIES)
    write_folder(cfg, w)
    common.finish_folder(OUT, ref)
    for s in ref["sequences"]:
        pf = s["prefill"]
        print(
            f"seed {ref['seed']} prompt of {len(s['prompt_ids'])}: prefill margin {pf['min_margin']:.3f}, "
            f"chain {[c['token_id'] for c in s['chain']]}"
        )
    print(f"wrote {OUT} in {time.time() - t0:.1f}s")


def check() -> None:
    want = common.read_json(OUT / "reference.json")
    target = common.load_target(TARGET)
    cfg, w, ref = build(want["seed"], target)
    chk = common.Check()
    chk.same(common.read_json(OUT / "config.json"), cfg, "config.json")
    for name in COPIED:
        chk.same((OUT / name).read_bytes(), (TARGET / name).read_bytes(), f"{name} (not tiny-deepseek-v3's)")
    chk.weights(OUT / MTP_SHARD, w)
    chk.sequences(
        want,
        ref,
        ("input_ids", "token_ids", "positions"),
        ("logits", "state"),
        ("input_id", "position", "token_id"),
        ("logits", "state"),
    )
    chk.finish(acceptable(ref) is None, OUT.name, "DeepSeek MTP")


if __name__ == "__main__":
    common.main(__doc__, check, write_all)
