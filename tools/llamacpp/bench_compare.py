#!/usr/bin/env python3
"""Arbor against llama.cpp on the default model (SmolLM2-135M-Instruct Q4_1), in
one run on one machine: prefill tok/s for a 512-token prompt and batch-1 decode
tok/s over 128 tokens, each engine measured `--rounds` times alternately (best
of each), with the same thread count; prints both and the ratios, plus the
batch-1 roofline (weight bytes per token / measured read bandwidth).

Needs llama-cpp-python (`pip install llama-cpp-python` in a venv: it compiles
llama.cpp, 15-20 minutes on 2 cores) and a built Arbor bench:
    cargo bench -p arbor-models --bench default_model --no-run
    /path/to/venv/bin/python tools/llamacpp/bench_compare.py --bandwidth-gbs GBS
(GBS: the read bandwidth the first line of
`ARBOR_BENCH_THREADS=2 cargo bench -p arbor-models --bench forward` prints).
"""
import argparse, json, os, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def llama_cpp_round(model, threads):
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=1024, n_batch=512, n_ubatch=512,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = [200 + (i * 7919) % 40000 for i in range(512)]
    best_p = float("inf")
    for _ in range(3):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        best_p = min(best_p, time.perf_counter() - t)
    best_d = float("inf")
    for _ in range(3):
        llm.reset()
        llm.eval(prompt[:16])
        t = time.perf_counter()
        for i in range(128):
            llm.eval([prompt[16 + i]])
        best_d = min(best_d, time.perf_counter() - t)
    return {"prefill_tok_s": 512 / best_p, "decode_tok_s": 128 / best_d}


def arbor_round(model, threads):
    # The same file for both engines.
    env = dict(os.environ, ARBOR_BENCH_THREADS=str(threads), ARBOR_DEFAULT_GGUF=str(model))
    out = subprocess.run(["cargo", "bench", "-q", "-p", "arbor-models", "--bench", "default_model"],
                         cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    line = [l for l in out.splitlines() if l.startswith("{")][-1]
    return json.loads(line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/arbor/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="measured read bandwidth for the roofline")
    a = ap.parse_args()
    best = {"arbor": {}, "llama.cpp": {}}
    for r in range(a.rounds):
        for name, fn in (("llama.cpp", lambda: llama_cpp_round(a.model, a.threads)), ("arbor", lambda: arbor_round(a.model, a.threads))):
            res = fn()
            for k in ("prefill_tok_s", "decode_tok_s"):
                best[name][k] = max(best[name].get(k, 0), res[k])
            if "weight_bytes" in res:
                best["arbor"]["weight_bytes"] = res["weight_bytes"]
            print(f"round {r} {name}: prefill {res['prefill_tok_s']:.1f} tok/s, decode {res['decode_tok_s']:.1f} tok/s", flush=True)
    A, L = best["arbor"], best["llama.cpp"]
    print(f"\n| | prefill 512 tok/s | decode bs1 tok/s |\n|---|---|---|")
    print(f"| llama.cpp | {L['prefill_tok_s']:.1f} | {L['decode_tok_s']:.1f} |")
    print(f"| arbor | {A['prefill_tok_s']:.1f} | {A['decode_tok_s']:.1f} |")
    print(f"| arbor / llama.cpp | {A['prefill_tok_s']/L['prefill_tok_s']:.2f}x | {A['decode_tok_s']/L['decode_tok_s']:.2f}x |")
    if a.bandwidth_gbs and A.get("weight_bytes"):
        roof = a.bandwidth_gbs * 1e9 / A["weight_bytes"]
        print(f"batch-1 roofline {roof:.0f} tok/s ({A['weight_bytes']/1e6:.0f} MB at {a.bandwidth_gbs} GB/s): "
              f"arbor {100*A['decode_tok_s']/roof:.0f}%, llama.cpp {100*L['decode_tok_s']/roof:.0f}%")


if __name__ == "__main__":
    main()
