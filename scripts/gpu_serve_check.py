#!/usr/bin/env python3
"""End-to-end check of `arbor serve --device cuda` (run by scripts/gpu-check.sh).

Starts the same model twice, on the CPU and on the GPU device, each on a free
loopback port; sends the same 16 greedy completions to both, all at once (so
each server batches them), and checks that every completion is identical
token for token (the CPU backend is the reference: the tiny fixtures' parity
tests hold it to transformers). Then a short `arbor bench serving` run at 64
concurrent requests against the GPU server, which must finish every request.
Both servers are stopped with SIGTERM and must exit cleanly. Standard library
only, so it runs under any python3.

Usage: gpu_serve_check.py ARBOR MODEL_DIR [DEVICE]   (DEVICE: cuda, rocm, wgpu)
"""
import concurrent.futures as cf
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "In the beginning",
    "def fibonacci(n):",
    "The capital of France is",
    "1, 2, 3, 4,",
    "Hello, my name is",
    "Water boils at",
    "import numpy as np",
    "The meaning of life",
    "SELECT * FROM",
    "Roses are red,",
    "The weather today",
    "To be or not to be",
    "A B C D E F",
    "Rust is a language",
]
MAX_TOKENS = 32


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Server:
    def __init__(self, arbor, model, device):
        self.device = device
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"arbor-{device}-", suffix=".log")
        self.proc = subprocess.Popen(
            [arbor, "serve", "--model-path", model, "--device", device,
             "--host", "127.0.0.1", "--port", str(self.port), "--max-total-tokens", "16384"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                urllib.request.urlopen(self.base + "/health", timeout=2)
                break
            except Exception:
                if self.proc.poll() is not None:
                    sys.exit(f"the {device} server exited during start-up:\n{self.tail()}")
                time.sleep(0.5)
        else:
            sys.exit(f"the {device} server did not answer /health in 180 s:\n{self.tail()}")
        models = json.load(urllib.request.urlopen(self.base + "/v1/models", timeout=10))
        self.model = models["data"][0]["id"]

    def tail(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def complete(self, prompt):
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                           "temperature": 0, "logprobs": 1}).encode()
        req = urllib.request.Request(self.base + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        choice = json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]
        return choice["logprobs"]["tokens"], choice["text"]

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            sys.exit(f"the {self.device} server ignored SIGTERM for 30 s")
        if rc != 0:
            sys.exit(f"the {self.device} server exited with {rc} after SIGTERM:\n{self.tail()}")


def all_at_once(server):
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(server.complete, PROMPTS))


def main():
    arbor, model = sys.argv[1], sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
    cpu = Server(arbor, model, "cpu")
    want = all_at_once(cpu)
    cpu.stop()
    gpu = Server(arbor, model, device)
    t0 = time.time()
    got = all_at_once(gpu)
    print(f"{len(PROMPTS)} concurrent completions of {MAX_TOKENS} tokens on {device}: "
          f"{time.time() - t0:.2f} s")
    differ = [i for i, (a, b) in enumerate(zip(want, got)) if a[0] != b[0]]
    for i in differ:
        a, b = want[i][0], got[i][0]
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"  differs: {PROMPTS[i]!r} at token {first}: cpu {a[first:first + 4]} "
              f"{device} {b[first:first + 4]}")
    print(f"greedy completions identical to the CPU server's: {len(PROMPTS) - len(differ)} of "
          f"{len(PROMPTS)}")
    bench = subprocess.run(
        [arbor, "bench", "serving", "--backend", "arbor", "--base-url", gpu.base,
         "--tokenizer", model, "--dataset-name", "random", "--random-input-len", "64",
         "--random-output-len", "32", "--random-range-ratio", "1", "--num-prompts", "256",
         "--max-concurrency", "64", "--seed", "1"],
        capture_output=True, text=True, timeout=300)
    print(bench.stdout[-3000:])
    gpu.stop()
    succeeded = [line.split()[-1] for line in bench.stdout.splitlines()
                 if line.startswith("Successful requests:")]
    if bench.returncode != 0 or succeeded != ["256"]:
        sys.exit(f"the benchmark did not finish every request:\n{bench.stderr[-2000:]}")
    if differ:
        sys.exit(f"{len(differ)} greedy completions differ between cpu and {device}")
    print("gpu serve check: OK")


if __name__ == "__main__":
    main()
