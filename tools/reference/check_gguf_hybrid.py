#!/usr/bin/env python3
"""Cross-check the GGUF files crates/models/tests/gguf_hybrid.rs writes for the
hybrid fixtures (tiny-qwen3.5, tiny-qwen3.5-moe, tiny-qwen3-next) against the
ones llama.cpp's own converter writes from the same checkpoints.

For each fixture it runs llama.cpp's `convert_hf_to_gguf.py <fixture>
--outtype f32 --no-mtp` (from a llama.cpp source tree, e.g. the one vendored
in the llama-cpp-python 0.3.36 sdist, with that tree's gguf-py), reads both
files with gguf-py and compares:

- the metadata: the same keys with the same types and values (the `GGUF.*`
  header fields aside; `general.name` is compared by presence only: convert
  makes "Tiny Qwen3.5" of the folder name, the test writes the folder name);
- the tensors: the same names, types and shapes, and values equal (max
  absolute difference printed; `ssm_a = -exp(A_log)` may differ by an ulp
  between torch's and Rust's exp, everything else must be bit-identical).

The tiny fixtures' tokenizers are not among the real tokenizers whose
pre-tokenizer hash convert recognises, so convert is run with
`TextModel.get_vocab_base_pre` returning "qwen2" (their split regex is
Qwen2's; the Rust writer names it so too). `--no-mtp` because the fixtures
have no multi-token-prediction layers and no `mtp_num_hidden_layers`, for
which convert's Qwen3.5 / Qwen3-Next classes otherwise assert.

With --run-llama it also loads convert's files in llama.cpp itself
(llama-cpp-python, e.g. 0.3.36 built from its sdist) and requires
transformers' tokens and greedy continuations (reference.json), printing
its last-position logit error.

Usage:
  python tools/reference/check_gguf_hybrid.py --llama-cpp DIR [--arbor-out DIR] [--run-llama]

Without --arbor-out the script runs
`ARBOR_GGUF_HYBRID_OUT=<tmp> cargo test -p arbor-models --test gguf_hybrid`
to write the Rust files first. Needs torch, transformers, numpy,
safetensors (what convert imports). Exit status 0 when everything matches.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-next"]
# Compared by presence only (provenance, not model data).
NAME_ONLY = {"general.name"}
# Tensors computed through a transcendental function on both sides.
ULP_TOLERANT = ("ssm_a",)

CONVERT = r"""
import sys
llama, model, out = sys.argv[1:4]
sys.path.insert(0, llama)
sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", "f32", "--outfile", out, "--no-mtp"]
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
convert_hf_to_gguf.main()
"""


def convert(llama: Path, fixture: Path, out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(llama / "gguf-py"))
    r = subprocess.run(
        [sys.executable, "-c", CONVERT, str(llama), str(fixture), str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        sys.exit(f"convert_hf_to_gguf.py failed on {fixture.name}:\n{r.stderr[-4000:]}")


def metadata(reader) -> dict[str, tuple[str, object]]:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        types = "/".join(t.name for t in field.types)
        out[key] = (types, field.contents())
    return out


def tensors(reader) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    return {
        t.name: (t.tensor_type.name, tuple(int(x) for x in t.data.shape), np.asarray(t.data))
        for t in reader.tensors
    }


def compare(name: str, ours: Path, theirs: Path, gguf) -> list[str]:
    problems: list[str] = []
    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    ma, mb = metadata(a), metadata(b)
    for key in sorted(set(ma) | set(mb)):
        if key not in ma:
            problems.append(f"metadata key {key} only in convert's file: {mb[key]}")
        elif key not in mb:
            problems.append(f"metadata key {key} only in the Rust file: {ma[key]}")
        elif key not in NAME_ONLY and ma[key] != mb[key]:
            va, vb = (str(ma[key])[:200], str(mb[key])[:200])
            problems.append(f"metadata {key}: Rust {va} != convert {vb}")
    ta, tb = tensors(a), tensors(b)
    for t in sorted(set(ta) - set(tb)):
        problems.append(f"tensor {t} only in the Rust file")
    for t in sorted(set(tb) - set(ta)):
        problems.append(f"tensor {t} only in convert's file")
    worst = {}
    for t in sorted(set(ta) & set(tb)):
        (da, sa, xa), (db, sb, xb) = ta[t], tb[t]
        if (da, sa) != (db, sb):
            problems.append(f"tensor {t}: Rust {da} {sa} != convert {db} {sb}")
            continue
        diff = float(np.max(np.abs(xa.astype(np.float64) - xb.astype(np.float64)))) if xa.size else 0.0
        kind = t.split(".")[2] if t.startswith("blk.") else t.split(".")[0]
        worst[kind] = max(worst.get(kind, 0.0), diff)
        scale = float(np.max(np.abs(xb))) if xb.size else 0.0
        limit = 4 * np.finfo(np.float32).eps * scale if kind in ULP_TOLERANT else 0.0
        if diff > limit:
            problems.append(f"tensor {t}: values differ by up to {diff:.3g}")
    print(
        f"{name}: {len(ma)} metadata keys, {len(ta)} tensors; "
        f"max |Rust - convert| per tensor kind: "
        + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items()) if v)
        + (" (other kinds 0)" if any(worst.values()) else "all 0")
    )
    return problems


def run_llama(name: str, path: Path) -> list[str]:
    """llama.cpp's tokens, last logits and greedy tokens on the fixture's prompts."""
    import json

    from llama_cpp import Llama

    ref = json.loads((ROOT / "tests/fixtures" / name / "reference.json").read_text())
    llm = Llama(model_path=str(path), n_ctx=1024, n_batch=512, n_threads=2, logits_all=True, verbose=False)
    problems = []
    for i, p in enumerate(ref["prompts"]):
        if llm.tokenize(p["text"].encode(), add_bos=False, special=False) != p["input_ids"]:
            problems.append(f"llama.cpp tokenizes prompt {i} differently")
        llm.reset()
        llm.eval(p["input_ids"])
        want = np.array(p["last_logits"])
        err = np.abs(np.array(llm.scores[llm.n_tokens - 1]) - want).max() / np.abs(want).max()
        out = []
        for _ in p["greedy_ids"]:
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([out[-1]])
        same = out == p["greedy_ids"]
        print(f"  llama.cpp, prompt {i} ({len(p['input_ids'])} tokens): last logits within "
              f"{err:.1e} x max|logit|, greedy tokens {'as transformers' if same else 'DIFFER'}")
        if not same:
            problems.append(f"llama.cpp's greedy tokens differ on prompt {i}")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP_DIR"),
                    help="llama.cpp source tree (with convert_hf_to_gguf.py and gguf-py)")
    ap.add_argument("--arbor-out", type=Path,
                    help="folder holding the Rust test's <fixture>.gguf files (default: run the test)")
    ap.add_argument("--run-llama", action="store_true",
                    help="also run convert's files in llama.cpp (llama-cpp-python) against reference.json")
    args = ap.parse_args()
    if args.llama_cpp is None or not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        sys.exit("--llama-cpp must name a llama.cpp tree with convert_hf_to_gguf.py")
    sys.path.insert(0, str(args.llama_cpp / "gguf-py"))
    import gguf  # noqa: E402  (the tree's own gguf-py)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        arbor_out = args.arbor_out
        if arbor_out is None:
            arbor_out = tmp / "arbor"
            env = dict(os.environ, ARBOR_GGUF_HYBRID_OUT=str(arbor_out))
            cmd = ["cargo", "test", "-q", "-p", "arbor-models", "--test", "gguf_hybrid", "matches_transformers"]
            print("running:", " ".join(cmd), flush=True)
            subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        problems: list[str] = []
        for name in FIXTURES:
            theirs = tmp / f"{name}.convert.gguf"
            convert(args.llama_cpp, ROOT / "tests/fixtures" / name, theirs)
            ours = arbor_out / f"{name}.gguf"
            if not ours.is_file():
                sys.exit(f"{ours} is missing (did the Rust test run with ARBOR_GGUF_HYBRID_OUT?)")
            problems += [f"{name}: {p}" for p in compare(name, ours, theirs, gguf)]
            if args.run_llama:
                problems += [f"{name}: {p}" for p in run_llama(name, theirs)]
    for p in problems:
        print("MISMATCH", p)
    print("OK: the Rust writer matches convert_hf_to_gguf.py" if not problems
          else f"{len(problems)} mismatches")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
