#!/usr/bin/env python3
"""Embedding throughput: sequences per second of `/v1/embeddings` at batch 1
(one input per request, one request at a time) and batch 32 (32 inputs in
one request), alternated A B A B on one `arbor serve --is-embedding` of the
tiny Qwen3 fixture (tests/fixtures/tiny-qwen3: a Qwen3-Embedding-shaped
causal model, last-token pooling). Every input is distinct (no prefix
reuse).

    python3 scripts/bench-embeddings.py [--rounds 5] [--tokens 128] [--threads 2]

Needs a built `arbor` (ARBOR_BIN, default target/release/arbor, else
target/debug/arbor).
"""
import argparse, json, os, subprocess, sys, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    arbor = os.environ.get("ARBOR_BIN") or next(
        (p for p in (os.path.join(ROOT, "target/release/arbor"), os.path.join(ROOT, "target/debug/arbor"))
         if os.path.exists(p)), None)
    if arbor is None:
        sys.exit("no arbor binary: cargo build --release -p arbor")
    model = os.path.join(ROOT, "tests/fixtures/tiny-qwen3")
    srv = subprocess.Popen([arbor, "serve", "--model-path", model, "--is-embedding", "--port", "0",
                            "--threads", str(a.threads), "--max-total-tokens", "65536"],
                           stdout=subprocess.PIPE, text=True)
    base = None
    for line in srv.stdout:
        if line.startswith("listening on "):
            base = line.split()[-1].strip()
            break
    if base is None:
        sys.exit("the server did not start")
    url = base + "/v1/embeddings"
    n = 0

    def inputs(k):
        nonlocal n
        out = []
        for _ in range(k):
            n += 1
            out.append([10 + (n * 131 + i * 17) % 480 for i in range(a.tokens)])
        return out

    results = {"batch 1": [], "batch 32": []}
    try:
        for r in range(a.rounds):
            t = time.perf_counter()
            for x in inputs(32):
                post(url, {"input": [x]})
            b1 = 32 / (time.perf_counter() - t)
            t = time.perf_counter()
            out = post(url, {"input": inputs(32)})
            b32 = 32 / (time.perf_counter() - t)
            assert len(out["data"]) == 32
            if r > 0:  # the first round warms up
                results["batch 1"].append(b1)
                results["batch 32"].append(b32)
    finally:
        srv.terminate()
        srv.wait()
    med = {k: sorted(v)[len(v) // 2] for k, v in results.items()}
    for k, v in results.items():
        print(f"{k:>9}: {med[k]:8.1f} sequences/s median of {len(v)} ({a.tokens} tokens each, {a.threads} threads)")
    print(f"batch 32 / batch 1: {med['batch 32'] / med['batch 1']:.2f}")


if __name__ == "__main__":
    main()
