#!/usr/bin/env python3
"""Arbor against llama.cpp on the same GGUF files of a Qwen3.5-0.8B-shaped hybrid model.

The model is tools/reference/bench_hybrid.py's (Qwen3_5ForCausalLM with Qwen3.5-0.8B's text shape:
hidden 1024, 24 layers of which every 4th is gated attention and the rest Gated DeltaNet, 8 query /
2 KV heads of 256, 16+16 linear heads of 128, MLP 3584, vocabulary 248320 tied; seeded random bf16
weights), converted by llama.cpp's own convert_hf_to_gguf.py to `qwen35` GGUF files of each
`--types` (bf16, q8_0). On each file, alternating the engines (A B A B) on the same CPU threads:

- prefill of a 512-token prompt (batch 1): tokens per second;
- decode after a 128-token prompt at batch 1 and batch 16: tokens per second over 32 steps
  (Arbor: `arbor bench one-batch`'s median step; llama.cpp: its low-level batch API, one
  `llama_decode` per step with a token for each of the 16 sequences, wall time of the 32 steps).

llama.cpp is llama-cpp-python (0.3.36 here) built from its sdist with
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
-DGGML_AMX_BF16=OFF" (its AMX kernels die with SIGILL on these VMs). Run it with that venv's
Python, which also needs torch and transformers (to write the model once):

    python tools/llamacpp/bench_hybrid.py --arbor target/release/arbor \
        --llama-cpp /path/to/llama_cpp_python-0.3.36/vendor/llama.cpp [--threads 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "reference"))

import bench_hybrid  # noqa: E402  (the model and `arbor bench one-batch`)

# The tiny tokenizer bench_hybrid copies has no hash in convert's table; its split is Qwen2's.
CONVERT = r"""
import sys
llama, model, out, outtype = sys.argv[1:5]
sys.path.insert(0, llama)
sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", outtype, "--outfile", out, "--no-mtp"]
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
convert_hf_to_gguf.main()
"""


def gguf_of(llama: Path, model: Path, outtype: str) -> Path:
    out = model.parent / f"{model.name}-{outtype}.gguf"
    if not out.exists():
        env = dict(os.environ, PYTHONPATH=str(llama / "gguf-py"))
        subprocess.run([sys.executable, "-c", CONVERT, str(llama), str(model), str(out) + ".part", outtype],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        os.replace(str(out) + ".part", out)
    return out


def _quiet(_level, _text, _user_data) -> None:
    pass


try:
    import llama_cpp as _l

    _QUIET = _l.llama_log_callback(_quiet)
except ImportError:  # the model writer and `--help` need no llama.cpp
    _QUIET = None


class LlamaCpp:
    """One llama.cpp context over `path` for `seqs` sequences."""

    def __init__(self, path: Path, threads: int, seqs: int) -> None:
        import llama_cpp as l

        self.l = l
        l.llama_log_set(_QUIET, None)
        l.llama_backend_init()
        mp = l.llama_model_default_params()
        self.model = l.llama_model_load_from_file(str(path).encode(), mp)
        cp = l.llama_context_default_params()
        cp.n_ctx = 1024 * max(1, seqs)
        cp.n_batch = 512
        cp.n_ubatch = 512
        cp.n_seq_max = seqs
        cp.n_threads = threads
        cp.n_threads_batch = threads
        self.ctx = l.llama_init_from_model(self.model, cp)
        self.batch = l.llama_batch_init(512, 0, seqs)
        self.seqs = seqs

    def clear(self) -> None:
        self.l.llama_memory_clear(self.l.llama_get_memory(self.ctx), True)

    def decode(self, items: list[tuple[int, int, int]]) -> None:
        """One llama_decode of (token, position, sequence) items, logits for every item."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1
        if self.l.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        self.l.llama_synchronize(self.ctx)

    def prefill(self, n: int) -> float:
        self.clear()
        toks = [200 + (i * 7919) % 40000 for i in range(n)]
        items = [(t, i, 0) for i, t in enumerate(toks)]
        t0 = time.perf_counter()
        for s in range(0, n, 512):
            part = items[s:s + 512]
            b = self.batch
            b.n_tokens = len(part)
            for i, (tok, pos, seq) in enumerate(part):
                b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
                b.seq_id[i][0] = seq
                b.logits[i] = 1 if s + i == n - 1 else 0
            if self.l.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
        self.l.llama_synchronize(self.ctx)
        return n / (time.perf_counter() - t0)

    def decode_rate(self, prompt: int, steps: int) -> float:
        self.clear()
        for q in range(self.seqs):
            toks = [300 + (q * 131 + i * 7919) % 40000 for i in range(prompt)]
            for s in range(0, prompt, 512):
                self.decode([(t, s + i, q) for i, t in enumerate(toks[s:s + 512])])
        t0 = time.perf_counter()
        for k in range(steps):
            self.decode([(500 + (q * 17 + k) % 40000, prompt + k, q) for q in range(self.seqs)])
        return self.seqs * steps / (time.perf_counter() - t0)

    def close(self) -> None:
        self.l.llama_batch_free(self.batch)
        self.l.llama_free(self.ctx)
        self.l.llama_model_free(self.model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arbor", required=True)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp tree with convert_hf_to_gguf.py")
    ap.add_argument("--model", default="/tmp/arbor-qwen35-0.8b-shaped")
    ap.add_argument("--types", default="bf16,q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model_dir = Path(args.model)
    bench_hybrid.write_model(model_dir)
    import llama_cpp

    print(f"llama-cpp-python {llama_cpp.__version__}; {args.threads} threads; {args.rounds} rounds")
    for outtype in args.types.split(","):
        gguf = gguf_of(args.llama_cpp, model_dir, outtype)
        print(f"== {gguf.name} ({gguf.stat().st_size / 2**30:.2f} GiB)", flush=True)
        results: dict[str, list[float]] = {}

        def add(k: str, v: float) -> None:
            results.setdefault(k, []).append(v)

        for r in range(args.rounds):
            a = bench_hybrid.arbor_run(args.arbor, gguf, args.threads, 1, 512, 2)
            add("arbor prefill 512 tok/s", a["prefill_throughput"])
            one = LlamaCpp(gguf, args.threads, 1)
            one.prefill(512)  # warm-up
            add("llama.cpp prefill 512 tok/s", one.prefill(512))
            for batch in (1, 16):
                a = bench_hybrid.arbor_run(args.arbor, gguf, args.threads, batch, 128, 33)
                add(f"arbor decode bs{batch} tok/s", a["median_decode_throughput"])
                ctx = one if batch == 1 else LlamaCpp(gguf, args.threads, batch)
                add(f"llama.cpp decode bs{batch} tok/s", ctx.decode_rate(128, 32))
                if ctx is not one:
                    ctx.close()
            one.close()
            print(f"round {r + 1} done", flush=True)
        for k, v in results.items():
            print(f"{k:34s} {statistics.median(v):9.1f}   (runs: {', '.join(f'{x:.1f}' for x in v)})")
        for what in ("prefill 512", "decode bs1", "decode bs16"):
            a = statistics.median(results[f"arbor {what} tok/s"])
            t = statistics.median(results[f"llama.cpp {what} tok/s"])
            print(f"{outtype} {what:12s} arbor / llama.cpp = {a / t:.2f}x")


if __name__ == "__main__":
    main()
