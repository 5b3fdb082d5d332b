#!/usr/bin/env python3
"""What prompt log-probabilities cost: `/v1/completions` with `echo` and
`logprobs` (the prompt scored, as lm-evaluation-harness asks) against the
same request without them (plain prefill), on 512-token prompts of the
default model, alternated A B A B on one server. Prints prompt tokens per
second for each and the ratio.

    python3 scripts/bench-prompt-logprobs.py [--rounds 6] [--tokens 512] [--threads 2]

Needs a built `arbor` (ARBOR_BIN, default target/release/arbor) and the
default model (`arbor fetch-default`). Every request has its own prompt
(its first tokens differ), so no prompt is served from the prefix cache.
"""
import argparse, json, os, subprocess, sys, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    arbor = os.environ.get("ARBOR_BIN", os.path.join(ROOT, "target/release/arbor"))
    srv = subprocess.Popen([arbor, "serve", "--port", "0", "--threads", str(a.threads)],
                           stdout=subprocess.PIPE, text=True)
    base = None
    for line in srv.stdout:
        if line.startswith("listening on "):
            base = line.split()[-1].strip()
            break
    if base is None:
        sys.exit("the server did not start")
    url = base + "/v1/completions"
    results = {"plain": [], "echo+logprobs": []}
    try:
        n = 0
        for r in range(a.rounds):
            for kind in ("plain", "echo+logprobs"):
                n += 1
                prompt = [200 + (n * 131 + i * 7919) % 40000 for i in range(a.tokens)]
                body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
                if kind != "plain":
                    body.update({"echo": True, "logprobs": 1})
                t = time.perf_counter()
                out = post(url, body)
                dt = time.perf_counter() - t
                if kind != "plain":
                    assert len(out["choices"][0]["logprobs"]["token_logprobs"]) == a.tokens + 1
                if r > 0:  # the first round warms up
                    results[kind].append(a.tokens / dt)
    finally:
        srv.terminate()
        srv.wait()
    best = {k: max(v) for k, v in results.items()}
    med = {k: sorted(v)[len(v) // 2] for k, v in results.items()}
    for k in results:
        print(f"{k:>14}: {med[k]:8.1f} prompt tok/s median, {best[k]:8.1f} best ({len(results[k])} runs)")
    print(f"echo+logprobs / plain: {med['echo+logprobs'] / med['plain']:.3f} (median), "
          f"{best['echo+logprobs'] / best['plain']:.3f} (best)")


if __name__ == "__main__":
    main()
