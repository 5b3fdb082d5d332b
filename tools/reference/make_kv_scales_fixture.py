#!/usr/bin/env python3
"""tests/fixtures/quant/fp8-kv-scales: a checkpoint with an FP8 KV cache calibrated by
llm-compressor (compressed-tensors `kv_cache_scheme`, per-layer `self_attn.k_scale` and
`self_attn.v_scale`), and its reference logits from a numpy forward written from the definitions.

The model is tiny-llama with its keys and values made 512 times larger: each layer's k_proj and
v_proj rows are multiplied by 512 and its q_proj and o_proj divided by 512. Powers of two are exact
in floating point, so scores (q.k) and the attention output (o_proj of the weighted values) are
those of tiny-llama and the f32 forward of this model is tiny-llama's (checked here against
tiny-llama's transformers reference.json). But keys and values now reach about 2000, beyond FP8
E4M3's largest value (448): an FP8 KV cache needs the checkpoint's scales, as real checkpoints with
activation outliers do.

The format (vLLM and SGLang's reading of it): a cached key is stored as e4m3(k / k_scale),
saturating at +-448, rounding to nearest even, and read back as float(stored) * k_scale; likewise
values with v_scale. Every key and value is read from the cache, the current token's too. The
scales are calibrated here as llm-compressor does: the largest |k| (after RoPE) and |v| of each
layer over the calibration text (the three reference prompts) divided by 448.

reference.json holds, per prompt, the f32 logits of the last position (`last_logits_f32`, equal to
tiny-llama's) and with the FP8 cache (`last_logits`), and 24 greedy tokens with the FP8 cache
(`greedy_ids`).

    python tools/reference/make_kv_scales_fixture.py   (numpy, ml_dtypes)
"""

import json
import math
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors_np import load_file, save_file

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
SRC = FIXTURES / "tiny-llama"
OUT = FIXTURES / "quant" / "fp8-kv-scales"
BOOST = 512.0
E4M3_MAX = 448.0
GREEDY = 24

def llama3_inv_freq(cfg: dict) -> np.ndarray:
    hd = cfg["head_dim"]
    rope = cfg["rope_scaling"]
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(f)
        elif wavelen > old / lo:
            out.append(f / factor)
        else:
            s = (old / wavelen - lo) / (hi - lo)
            out.append((1 - s) * f / factor + s * f)
    return np.array(out)


def fp8_roundtrip(x: np.ndarray, scale: float) -> np.ndarray:
    """What an FP8 E4M3 cache with this scale gives back for x."""
    q = np.clip(x.astype(np.float32) / np.float32(scale), -E4M3_MAX, E4M3_MAX)
    return q.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * np.float64(np.float32(scale))


def forward(w: dict, cfg: dict, ids: list, kv_scales=None, record=None, linear_input=None) -> np.ndarray:
    """Logits of every position (float64 arithmetic on the stored weights). `linear_input`, when
    given, maps the input of each decoder layer's seven linears (not lm_head) to what they multiply."""
    li = linear_input or (lambda v: v)
    h, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    f = lambda n: w[n].astype(np.float64)
    t = len(ids)
    x = f("model.embed_tokens.weight")[ids]
    inv = llama3_inv_freq(cfg)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)

    def norm(v, g):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * g

    def rope(v):  # [t, heads, hd], rotate-half
        a, b = v[..., : hd // 2], v[..., hd // 2 :]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        y = li(norm(x, f(f"{p}.input_layernorm.weight")))
        q = rope((y @ f(f"{p}.self_attn.q_proj.weight").T).reshape(t, nh, hd))
        k = rope((y @ f(f"{p}.self_attn.k_proj.weight").T).reshape(t, nkv, hd))
        v = (y @ f(f"{p}.self_attn.v_proj.weight").T).reshape(t, nkv, hd)
        if record is not None:
            record.setdefault(i, [0.0, 0.0])
            record[i][0] = max(record[i][0], float(np.abs(k).max()))
            record[i][1] = max(record[i][1], float(np.abs(v).max()))
        if kv_scales is not None:
            k = fp8_roundtrip(k, kv_scales[i][0])
            v = fp8_roundtrip(v, kv_scales[i][1])
        rep = nh // nkv
        k = np.repeat(k, rep, axis=1)
        v = np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(t, nh * hd)
        x = x + li(o) @ f(f"{p}.self_attn.o_proj.weight").T
        y = li(norm(x, f(f"{p}.post_attention_layernorm.weight")))
        g = y @ f(f"{p}.mlp.gate_proj.weight").T
        u = y @ f(f"{p}.mlp.up_proj.weight").T
        x = x + li(g / (1 + np.exp(-g)) * u) @ f(f"{p}.mlp.down_proj.weight").T
    x = norm(x, f("model.norm.weight"))
    return x @ f("lm_head.weight").T


def observed_input_amax(w: dict, cfg: dict, ids: list) -> list:
    """max |x| of each linear input `forward` hands its `linear_input` hook, over `ids`: per layer
    (in order) the input of Q/K/V, of o_proj, of gate/up and of down_proj, as an FP8 min-max
    observer calibrates static input scales (python floats)."""
    amax = [0.0] * (4 * cfg["num_hidden_layers"])
    calls = [0]

    def observe(x):
        i = calls[0] % len(amax)
        calls[0] += 1
        amax[i] = max(amax[i], float(np.abs(x).max()))
        return x

    forward({k: v.astype(np.float64) for k, v in w.items()}, cfg, ids, linear_input=observe)
    return amax


def main() -> None:
    cfg = json.loads((SRC / "config.json").read_text())
    ref = json.loads((SRC / "reference.json").read_text())
    w = {}
    for shard in sorted(SRC.glob("model-*.safetensors")):
        w.update(load_file(shard))
    # The independent forward agrees with transformers on tiny-llama.
    for p in ref["prompts"]:
        got = forward(w, cfg, p["input_ids"])[-1]
        err = np.abs(got - np.array(p["last_logits"])).max()
        assert err < 1e-4, err
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn"
        w[f"{p}.q_proj.weight"] = (w[f"{p}.q_proj.weight"] / BOOST).astype(np.float32)
        w[f"{p}.k_proj.weight"] = (w[f"{p}.k_proj.weight"] * BOOST).astype(np.float32)
        w[f"{p}.v_proj.weight"] = (w[f"{p}.v_proj.weight"] * BOOST).astype(np.float32)
        w[f"{p}.o_proj.weight"] = (w[f"{p}.o_proj.weight"] / BOOST).astype(np.float32)
    amax = {}
    prompts = []
    for p in ref["prompts"]:
        f32 = forward(w, cfg, p["input_ids"], record=amax)[-1]
        err = np.abs(f32 - np.array(p["last_logits"])).max()
        assert err < 1e-4, err
        prompts.append({"text": p["text"], "input_ids": p["input_ids"], "last_logits_f32": f32.tolist()})
    scales = {i: (np.float32(k / E4M3_MAX), np.float32(v / E4M3_MAX)) for i, (k, v) in amax.items()}
    assert min(k for k, _ in amax.values()) > 2 * E4M3_MAX, amax  # scales are needed
    for i, (ks, vs) in scales.items():
        w[f"model.layers.{i}.self_attn.k_scale"] = np.array([ks], np.float32)
        w[f"model.layers.{i}.self_attn.v_scale"] = np.array([vs], np.float32)
    for p in prompts:
        ids = list(p["input_ids"])
        logits = forward(w, cfg, ids, kv_scales=scales)[-1]
        p["last_logits"] = logits.tolist()
        greedy, margins = [], []
        for _ in range(GREEDY):
            last = forward(w, cfg, ids, kv_scales=scales)[-1]
            top = np.sort(last)[-2:]
            margins.append(float(top[1] - top[0]))
            nxt = int(np.argmax(last))
            greedy.append(nxt)
            ids.append(nxt)
        p["greedy_ids"] = greedy
        p["min_margin"] = min(margins)
        err = np.abs(np.array(p["last_logits"]) - np.array(p["last_logits_f32"])).max()
        print(f"prompt of {len(p['input_ids'])} tokens: FP8-KV vs f32 logits max diff {err:.4f}, "
              f"min greedy margin {p['min_margin']:.4f}")

    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    for name in ["generation_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(SRC / name, OUT / name)
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "compressed",
        "config_groups": {},
        "ignore": ["lm_head"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                            "dynamic": False, "symmetric": True},
    }
    (OUT / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(w, OUT / "model.safetensors")
    reference = {
        "source": "tiny-llama, keys and values x512 (q_proj, o_proj / 512), FP8 E4M3 KV scales calibrated "
                  "as amax/448 over these prompts; numpy forward (tools/reference/make_kv_scales_fixture.py)",
        "kv_scales": {str(i): [float(k), float(v)] for i, (k, v) in scales.items()},
        "kv_amax": {str(i): v for i, v in amax.items()},
        "prompts": prompts,
    }
    (OUT / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {OUT}: scales {reference['kv_scales']}")


if __name__ == "__main__":
    main()
