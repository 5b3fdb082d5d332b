#!/usr/bin/env python3
"""Arbor against transformers on a Qwen3.5-0.8B-shaped hybrid model (random weights, bf16).

Writes the model once (Qwen3_5ForCausalLM with Qwen3.5-0.8B's text shape: hidden 1024, 24 layers
of which every 4th is gated attention and the rest Gated DeltaNet, 8 query / 2 KV heads of 256,
16 key and 16 value linear heads of 128, MLP 3584, vocabulary 248320 tied) with seeded random
weights, then times, alternating the two engines (A B A B) on the same CPU threads:

- prefill of 512 tokens (batch 1): tokens per second;
- decode at batch 1 and batch 16 after a 128-token prompt: tokens per second (median step for
  Arbor, mean of 32 steps for transformers' generate with its cache);
- first, the time to first token over HTTP (`arbor serve`) of a 4,000-token prompt cold, and of
  the same prefix with new 16-token questions (reused through a recurrent state snapshot).

Arbor runs `arbor bench one-batch` on the folder (its default precision: bf16 weights, f16 KV;
bf16-rounded activations where the CPU has AMX); transformers runs the same folder in bf16 with
its own chunked gated delta rule (no FLA kernels on the CPU).

    python tools/reference/bench_hybrid.py --arbor target/release/arbor [--threads 2] [--rounds 2]
    python tools/reference/bench_hybrid.py --arbor target/release/arbor --snapshot-cost  # decode with/without snapshots
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

HERE = Path(__file__).resolve().parent
TOKENIZER_FROM = HERE.parent.parent / "tests" / "fixtures" / "tiny-qwen3.5"

SHAPE = dict(
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)


def write_model(out: Path) -> None:
    if (out / "model.safetensors").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(**SHAPE)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER_FROM / f, out / f)


def arbor_run(arbor: str, model: Path, threads: int, batch: int, input_len: int, output_len: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        subprocess.run(
            [
                arbor, "bench", "one-batch", "--model-path", str(model), "--threads", str(threads),
                "--batch-size", str(batch), "--input-len", str(input_len), "--output-len", str(output_len),
                "--result-filename", f.name,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        lines = Path(f.name).read_text().strip().splitlines()
    return json.loads(lines[-1])


def hf_prefill(model, n: int) -> float:
    x = torch.randint(0, 1000, (1, n))
    with torch.no_grad():
        model(x)  # warm-up
        t0 = time.perf_counter()
        model(x)
    return n / (time.perf_counter() - t0)


def hf_decode(model, batch: int, prompt: int, steps: int) -> float:
    x = torch.randint(0, 1000, (batch, prompt))
    with torch.no_grad():
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(x))
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=steps + 1, min_new_tokens=steps + 1, **kw)
        total = time.perf_counter() - t0
    return batch * steps / max(total - prefill, 1e-9)


def ttft(arbor: str, model: Path, threads: int, prefix_len: int = 4000) -> None:
    """Time to first token of a `prefix_len`-token prompt cold, then of the same prefix with a
    new 16-token question (warm: restored from its state snapshot), over HTTP (`arbor serve`,
    one token asked: its latency is the time to first token)."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [arbor, "serve", "--model-path", str(model), "--threads", str(threads), "--port", str(port),
         "--max-total-tokens", "16384", "--max-running-requests", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    summary = []
    try:
        for line in proc.stdout:
            summary.append(line.rstrip())
            if "listening on" in line:
                break
        url = f"http://127.0.0.1:{port}/generate"

        def ask(ids: list[int]) -> tuple[float, int]:
            body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
            req = urllib.request.Request(url, body.encode(), {"content-type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
            return time.perf_counter() - t0, out["meta_info"]["cached_tokens"]

        g = torch.Generator().manual_seed(7)
        prefix = torch.randint(0, 1000, (prefix_len,), generator=g).tolist()
        rows = []
        for i in range(3):
            question = torch.randint(0, 1000, (16,), generator=g).tolist()
            rows.append((i, *ask(prefix + question)))
        for line in summary:
            if "KV cache" in line or "cache:" in line:
                print(line)
        for i, secs, cached in rows:
            print(f"ttft request {i} ({prefix_len}+16 tokens): {secs:.3f} s, cached_tokens {cached}")
        print(f"warm / cold TTFT: {rows[1][1] / rows[0][1]:.3f} (1/{rows[0][1] / rows[1][1]:.1f})")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def snapshot_cost(arbor: str, model: Path, threads: int, rounds: int) -> None:
    """Decode throughput over HTTP with and without state snapshots (A B A B): 4 requests at once,
    128-token prompts, 64 new tokens each; `--max-mamba-cache-size 4` leaves no slot for snapshots
    (prefix reuse off), 8 takes a snapshot every page (16 tokens) of each decoding request."""
    import socket
    import threading
    import urllib.request

    def serve(slots: int):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        proc = subprocess.Popen(
            [arbor, "serve", "--model-path", str(model), "--threads", str(threads), "--port", str(port),
             "--max-total-tokens", "4096", "--max-running-requests", "4", "--max-mamba-cache-size", str(slots)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for line in proc.stdout:
            if "listening on" in line:
                break
        return proc, f"http://127.0.0.1:{port}/generate"

    def batch(url: str, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, 1000, (128,), generator=g).tolist() for _ in range(4)]

        def one(ids):
            body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 64, "temperature": 0,
                                                                      "ignore_eos": True}})
            req = urllib.request.Request(url, body.encode(), {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                r.read()

        t0 = time.perf_counter()
        ts = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return 4 * 64 / (time.perf_counter() - t0)

    results: dict[int, list[float]] = {4: [], 8: []}
    for r in range(rounds):
        for slots in (4, 8):
            proc, url = serve(slots)
            try:
                batch(url, 100)  # warm-up
                results[slots].append(batch(url, 200 + r))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    off, on = statistics.median(results[4]), statistics.median(results[8])
    print(f"4 requests x 64 tokens: no snapshots {off:.1f} tok/s {results[4]}, "
          f"snapshots {on:.1f} tok/s {results[8]}: ratio {on / off:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arbor", required=True)
    ap.add_argument("--model", default="/tmp/arbor-qwen35-0.8b-shaped")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ttft-only", action="store_true", help="only the warm/cold TTFT over HTTP")
    ap.add_argument("--snapshot-cost", action="store_true", help="only decode with and without snapshots")
    args = ap.parse_args()
    model_dir = Path(args.model)
    write_model(model_dir)
    if args.snapshot_cost:
        snapshot_cost(args.arbor, model_dir, args.threads, args.rounds)
        return
    ttft(args.arbor, model_dir, args.threads)
    if args.ttft_only:
        return
    torch.set_num_threads(args.threads)
    hf = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    results: dict[str, list[float]] = {}

    def add(k: str, v: float) -> None:
        results.setdefault(k, []).append(v)

    for r in range(args.rounds):
        a = arbor_run(args.arbor, model_dir, args.threads, 1, 512, 2)
        add("arbor prefill 512 tok/s", a["prefill_throughput"])
        add("transformers prefill 512 tok/s", hf_prefill(hf, 512))
        for batch in (1, 16):
            a = arbor_run(args.arbor, model_dir, args.threads, batch, 128, 33)
            add(f"arbor decode bs{batch} tok/s", a["median_decode_throughput"])
            add(f"transformers decode bs{batch} tok/s", hf_decode(hf, batch, 128, 32))
        print(f"round {r + 1} done", flush=True)
    for k, v in results.items():
        print(f"{k:36s} {statistics.median(v):9.1f}   (runs: {', '.join(f'{x:.1f}' for x in v)})")
    for what in ("prefill 512", "decode bs1", "decode bs16"):
        a = statistics.median(results[f"arbor {what} tok/s"])
        t = statistics.median(results[f"transformers {what} tok/s"])
        print(f"{what:12s} arbor / transformers = {a / t:.2f}x")


if __name__ == "__main__":
    main()
