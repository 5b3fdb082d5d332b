#!/usr/bin/env python3
"""Independent multi-LoRA reference for Arbor.

Builds seeded PEFT LoRA adapters for the tiny base fixtures (tests/fixtures/tiny-llama and
tests/fixtures/tiny-qwen2), saves each one with PEFT's own `save_pretrained` under
tests/fixtures/lora/<name>/ (adapter_config.json + adapter_model.safetensors), reloads the SAVED
adapter with `PeftModel.from_pretrained` onto a freshly loaded base model and writes reference.json
(last-position logits and 32 greedy tokens for the base fixture's own prompts).

Independently of PEFT, the script also merges W' = W + scaling * B @ A (numpy, float64) from the
safetensors file into a copy of the base weights and checks that the merged model's logits equal
the PeftModel's.

    python tools/reference/make_lora_fixtures.py            # (re)write tests/fixtures/lora/*
    python tools/reference/make_lora_fixtures.py --check    # reload the committed folders, compare
    python tools/reference/make_lora_fixtures.py --only tiny-llama-mlp

Needs torch, transformers 5.x, peft, safetensors, numpy. See tools/reference/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
import warnings
from pathlib import Path

# peft stores target_modules as a set and writes it to adapter_config.json in set order, which
# depends on str hash randomisation: fix the hash seed (re-exec once) so reruns write the same bytes.
if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, *sys.argv])

# Single-threaded CPU math so that reruns produce the same bytes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import peft  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

warnings.filterwarnings("ignore")
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
FIXTURES = REPO / "tests" / "fixtures"
LORA_DIR = FIXTURES / "lora"

NEW_TOKENS = 32
MIN_MARGIN = 1e-2  # required top1-top2 gap on every greedy step (as make_fixtures.py)
MIN_DISTINCT = 8  # as make_fixtures.py
DIVERGE_WITHIN = 8  # adapter greedy must differ from the base greedy within this many tokens
MERGE_TOL = 1e-4  # max |merged - peft| on last logits
MAX_SEED_TRIES = 200
TOKENIZER_VOCAB = 500  # ids >= 500 are padded-vocab rows (tiny-qwen2 has 512)

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

# std is the standard deviation of both lora_A and lora_B (normal, mean 0). The element std of
# scaling * B @ A is then about scaling * sqrt(r) * std^2; the base linear weights have std 0.15.
SPECS = [
    {
        "name": "tiny-llama-attn",
        "base": "tiny-llama",
        "seed": 5000,
        "std": 0.07,
        "lora": dict(r=8, lora_alpha=16, target_modules=ATTN),
    },
    {
        "name": "tiny-llama-all",
        "base": "tiny-llama",
        "seed": 6000,
        "std": 0.07,
        "lora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=ATTN + MLP),
    },
    {
        "name": "tiny-llama-mlp",
        "base": "tiny-llama",
        "seed": 7000,
        "std": 0.07,
        "lora": dict(r=16, lora_alpha=32, target_modules=MLP, layers_to_transform=[0, 2]),
    },
    {
        "name": "tiny-qwen2-attn",
        "base": "tiny-qwen2",
        "seed": 8000,
        "std": 0.15,
        "lora": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    },
]

KEY_RE = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def versions() -> dict:
    return {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "peft_version": peft.__version__,
        "safetensors_version": safetensors.__version__,
        "numpy_version": np.__version__,
    }


def load_base(base: str):
    model = AutoModelForCausalLM.from_pretrained(
        str(FIXTURES / base), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def base_reference(base: str) -> dict:
    return json.loads((FIXTURES / base / "reference.json").read_text(encoding="utf-8"))


def expected_scaling(cfg: dict) -> float:
    """The LoRA scaling rule, from adapter_config.json alone."""
    if cfg.get("use_rslora"):
        return cfg["lora_alpha"] / math.sqrt(cfg["r"])
    return cfg["lora_alpha"] / cfg["r"]


# ----------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------


def save_adapter(spec: dict, seed: int, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    base = load_base(spec["base"])
    cfg = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, bias="none", **spec["lora"])
    model = get_peft_model(base, cfg)
    # peft initialises lora_B to zero (a no-op adapter): overwrite A and B with seeded normals,
    # in sorted parameter-name order.
    g = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * spec["std"])
                n += 1
    assert n > 0
    # A relative folder name, not the absolute path the base was loaded from.
    model.peft_config["default"].base_model_name_or_path = spec["base"]
    model.save_pretrained(str(out))
    card = out / "README.md"  # peft's generated model card: not needed
    if card.exists():
        card.unlink()
    assert sorted(f.name for f in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    for f in out.iterdir():
        os.chmod(f, 0o644)  # safetensors creates the file 0600


# ----------------------------------------------------------------------------------------------
# Reference computation (always from the saved folder)
# ----------------------------------------------------------------------------------------------


def read_adapter(d: Path) -> tuple[dict, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """adapter_config.json and {base module name: (A, B)} straight from the safetensors file."""
    cfg = json.loads((d / "adapter_config.json").read_text(encoding="utf-8"))
    pairs: dict[str, dict[str, np.ndarray]] = {}
    with safetensors.safe_open(str(d / "adapter_model.safetensors"), framework="numpy") as sf:
        for k in sf.keys():
            m = KEY_RE.match(k)
            assert m, f"unexpected tensor name {k}"
            t = sf.get_tensor(k)
            assert t.dtype == np.float32, (k, t.dtype)
            pairs.setdefault(m.group(1), {})[m.group(2)] = t
    out = {}
    for mod, ab in pairs.items():
        assert set(ab) == {"A", "B"}, (mod, set(ab))
        out[mod] = (ab["A"], ab["B"])
    return cfg, out


def check_layout(spec: dict, cfg: dict, tensors: dict, n_layers: int) -> None:
    """The file holds exactly the target modules of the chosen layers, with the right shapes."""
    lora = spec["lora"]
    layers = lora.get("layers_to_transform") or list(range(n_layers))
    want = set()
    for i in layers:
        for t in lora["target_modules"]:
            group = "self_attn" if t in ATTN else "mlp"
            want.add(f"model.layers.{i}.{group}.{t}")
    assert set(tensors) == want, (spec["name"], sorted(set(tensors) ^ want))
    r = cfg["r"]
    for mod, (a, b) in tensors.items():
        assert a.shape[0] == r and b.shape[1] == r, (mod, a.shape, b.shape)
    assert cfg["r"] == lora["r"] and cfg["lora_alpha"] == lora["lora_alpha"]
    assert bool(cfg.get("use_rslora")) == bool(lora.get("use_rslora"))
    assert sorted(cfg["target_modules"]) == sorted(lora["target_modules"])
    assert cfg.get("layers_to_transform") == lora.get("layers_to_transform")
    assert cfg["base_model_name_or_path"] == spec["base"]
    assert not cfg.get("rank_pattern") and not cfg.get("alpha_pattern")


def greedy(model, ids: list[int]) -> tuple[list[int], float, torch.Tensor]:
    """model.generate(do_sample=False) with EOS disabled (as make_fixtures.py), cross-checked
    against a cache-free argmax loop. Returns (ids, min top1-top2 gap, last prompt logits)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        last = model(input_ids=x).logits[0, -1].float()
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=497,
            output_logits=True,
            return_dict_in_generate=True,
        )
    gen = out.sequences[0, len(ids) :].tolist()
    assert len(gen) == NEW_TOKENS, len(gen)
    step_logits = torch.stack([s[0] for s in out.logits]).float()
    top2 = torch.topk(step_logits, 2, dim=-1).values
    gap = float((top2[:, 0] - top2[:, 1]).min())
    assert torch.equal(torch.argmax(step_logits, -1), torch.tensor(gen))
    assert torch.allclose(step_logits[0], last, rtol=0, atol=1e-4 * float(last.abs().max()))
    seq = list(ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            seq.append(int(torch.argmax(model(input_ids=torch.tensor([seq])).logits[0, -1])))
    assert seq[len(ids) :] == gen, "generate() != cache-free argmax loop"
    return gen, gap, last


def merged_model(base: str, cfg: dict, tensors: dict):
    """Fresh base model with W' = W + scaling * B @ A (float64 numpy) written into its weights."""
    model = load_base(base)
    s = expected_scaling(cfg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for mod, (a, b) in sorted(tensors.items()):
            w = params[mod + ".weight"]
            assert w.shape == (b.shape[0], a.shape[1]), (mod, w.shape, a.shape, b.shape)
            merged = w.detach().double().numpy() + s * (b.astype(np.float64) @ a.astype(np.float64))
            w.copy_(torch.from_numpy(merged.astype(np.float32)))
    return model


def compute_reference(spec: dict, d: Path, seed: int, std: float) -> tuple[dict, dict]:
    cfg, tensors = read_adapter(d)
    bref = base_reference(spec["base"])
    base = load_base(spec["base"])
    check_layout(spec, cfg, tensors, base.config.num_hidden_layers)

    # PEFT's own loader on a fresh base model, eval mode, no merge.
    pm = PeftModel.from_pretrained(load_base(spec["base"]), str(d)).eval()
    assert pm.active_adapter == "default"
    lora_layers = [m for m in pm.modules() if hasattr(m, "scaling") and isinstance(m.scaling, dict)]
    assert len(lora_layers) == len(tensors), (len(lora_layers), len(tensors))
    for m in lora_layers:
        assert math.isclose(m.scaling["default"], expected_scaling(cfg), rel_tol=1e-12), m.scaling
    # The loaded adapter weights are the stored ones, bit for bit.
    sd = pm.state_dict()
    for mod, (a, b) in tensors.items():
        pa = sd[f"base_model.model.{mod}.lora_A.default.weight"]
        pb = sd[f"base_model.model.{mod}.lora_B.default.weight"]
        assert np.array_equal(pa.numpy(), a) and np.array_equal(pb.numpy(), b), mod

    merged = merged_model(spec["base"], cfg, tensors)

    prompts = []
    merge_diff = 0.0
    for bp in bref["prompts"]:
        ids = bp["input_ids"]
        base_gen, _, base_last = greedy(base, ids)
        assert base_gen == bp["greedy_ids"], (spec["base"], "base greedy differs from its reference.json")
        gen, gap, last = greedy(pm, ids)
        mgen, _, mlast = greedy(merged, ids)
        merge_diff = max(merge_diff, float((mlast - last).abs().max()))
        diverge = next((i for i, (x, y) in enumerate(zip(gen, base_gen)) if x != y), None)
        prompts.append(
            {
                "text": bp["text"],
                "input_ids": ids,
                "last_logits": [float(v) for v in last.numpy().astype(np.float32)],
                "greedy_ids": gen,
                "min_top2_gap": gap,
                "base_greedy_ids": base_gen,
                "first_divergence": diverge,
                "max_abs_logit_delta": float((last - base_last).abs().max()),
                "max_abs_base_logit": float(base_last.abs().max()),
                "merged_greedy_ids_equal": mgen == gen,
            }
        )
    ref = {
        "adapter": spec["name"],
        "base_model": spec["base"],
        "architecture": base.config.architectures[0],
        **versions(),
        "seed": seed,
        "lora_std": std,
        "r": cfg["r"],
        "lora_alpha": cfg["lora_alpha"],
        "use_rslora": bool(cfg.get("use_rslora")),
        "scaling": expected_scaling(cfg),
        "target_modules": sorted(cfg["target_modules"]),
        "layers_to_transform": cfg.get("layers_to_transform"),
        "max_new_tokens": NEW_TOKENS,
        "model_vocab_size": base.config.vocab_size,
        "prompts": prompts,
    }
    return ref, {"merge_diff": merge_diff, "n_modules": len(tensors)}


def acceptable(ref: dict, info: dict) -> str | None:
    if info["merge_diff"] > MERGE_TOL:
        # A formula problem, not a seed problem: stop.
        sys.exit(f"{ref['adapter']}: merged vs peft last logits differ by {info['merge_diff']:.2e}")
    for p in ref["prompts"]:
        if p["min_top2_gap"] < MIN_MARGIN:
            return f"min_top2_gap {p['min_top2_gap']:.2e} < {MIN_MARGIN}"
        if max(p["greedy_ids"]) >= TOKENIZER_VOCAB:
            return "greedy picked a padded-vocab id"
        if len(set(p["greedy_ids"])) < MIN_DISTINCT:
            return f"only {len(set(p['greedy_ids']))} distinct greedy ids"
        if p["first_divergence"] is None or p["first_divergence"] >= DIVERGE_WITHIN:
            return f"greedy equals base for the first {DIVERGE_WITHIN} tokens"
        if not p["merged_greedy_ids_equal"]:
            return "merged-model greedy ids differ from peft's"
    return None


def summarize(ref: dict, info: dict, d: Path) -> None:
    size = sum(f.stat().st_size for f in d.iterdir())
    gaps = ", ".join(f"{p['min_top2_gap']:.4f}" for p in ref["prompts"])
    div = [p["first_divergence"] for p in ref["prompts"]]
    rel = max(p["max_abs_logit_delta"] / p["max_abs_base_logit"] for p in ref["prompts"])
    print(
        f"{ref['adapter']:16s} seed={ref['seed']} std={ref['lora_std']} r={ref['r']} alpha={ref['lora_alpha']} "
        f"scaling={ref['scaling']:.4f} modules={info['n_modules']} gaps=[{gaps}] first_divergence={div} "
        f"max|dlogit|/max|base|={rel:.2f} merged-vs-peft={info['merge_diff']:.2e} size={size / 1024:.0f} KiB"
    )


def build_all(only: list[str] | None) -> None:
    t0 = time.time()
    print("versions:", versions())
    for spec in SPECS:
        if only and spec["name"] not in only:
            continue
        d = LORA_DIR / spec["name"]
        for attempt in range(MAX_SEED_TRIES):
            seed = spec["seed"] + attempt
            save_adapter(spec, seed, d)
            ref, info = compute_reference(spec, d, seed, spec["std"])
            why = acceptable(ref, info)
            if why is None:
                break
            print(f"  {spec['name']}: seed {seed} rejected ({why})")
        else:
            sys.exit(f"{spec['name']}: no acceptable seed in {MAX_SEED_TRIES} tries")
        write_json(d / "reference.json", ref)
        os.chmod(d / "reference.json", 0o644)
        summarize(ref, info, d)
    print(f"done in {time.time() - t0:.1f}s")


def check_all(only: list[str] | None) -> None:
    """Reload every committed adapter folder in this process and compare with its reference.json."""
    ok = True
    for spec in SPECS:
        if only and spec["name"] not in only:
            continue
        d = LORA_DIR / spec["name"]
        want = json.loads((d / "reference.json").read_text(encoding="utf-8"))
        got, info = compute_reference(spec, d, want["seed"], want["lora_std"])
        why = acceptable(got, info)
        if why is not None:
            ok = False
            print(f"UNACCEPTABLE {spec['name']}: {why}")
        worst, exact = 0.0, True
        for pw, pg in zip(want["prompts"], got["prompts"], strict=True):
            for key in ("input_ids", "greedy_ids", "base_greedy_ids", "first_divergence"):
                if pw[key] != pg[key]:
                    ok = False
                    print(f"MISMATCH {spec['name']} {key}: {pw[key]!r} != {pg[key]!r}")
            a, b = np.array(pw["last_logits"]), np.array(pg["last_logits"])
            worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))
            exact &= bool(np.array_equal(a, b))
        if worst > 1e-4:
            ok = False
        print(
            f"{spec['name']:16s} greedy/ids ok, last_logits rel err {worst:.2e} (bit-exact: {exact}), "
            f"merged-vs-peft {info['merge_diff']:.2e}"
        )
    if not ok:
        sys.exit("LoRA reference check FAILED")
    print("LoRA reference check passed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="reload tests/fixtures/lora/* and compare")
    ap.add_argument("--only", nargs="*", help="adapter names (default: all)")
    args = ap.parse_args()
    if args.check:
        check_all(args.only)
    else:
        build_all(args.only)


if __name__ == "__main__":
    main()
