#!/usr/bin/env python3
"""Replay the Mooncake conversation trace through SGLang's own RadixCache.

For every request, in trace order: ``match_prefix`` of its tokens, ``insert``
of its tokens, then LRU eviction down to ``--bound`` cached tokens
(``evict(cached - bound)`` when over). Each hash id ``h`` of a request stands
for the 512-token block ``h*512 .. h*512+511``; the last block is cut at
``input_length``. The totals (tokens matched, tokens evicted, tokens cached at
the end) are written as JSON; ``crates/kv-radix/tests/sglang_replay.rs``
replays the same runs through kv-radix and asserts equal totals.

Needs SGLang 0.5.23 from PyPI and what its ``radix_cache`` module imports
(torch 2.14.1 and a handful of small packages; no GPU is used):

    python -m venv /tmp/sgl && /tmp/sgl/bin/pip install --no-deps sglang==0.5.23
    /tmp/sgl/bin/pip install torch==2.14.1 apache-tvm-ffi==0.1.11 numpy orjson psutil \
        pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython \
        aiohttp transformers torchvision dill sentencepiece compressed_tensors gguf

    python tools/reference/radix_replay.py \
        --out crates/kv-radix/tests/fixtures/sglang_radix_mooncake.json

writes the committed fixture (the default runs: the first 2,000 requests with
bounds of 200,000 and 1,000,000 tokens, and the whole trace with 1,000,000,
each with page sizes 1 and 16; under a minute).

SGLang stamps nodes with ``time.monotonic()``; by default the script replaces
that clock (in the radix_cache module only) with a counter that grows by one on
every call, so the order of the stamps is the one real time gives (every call
reads a later time) but runs are deterministic. ``--real-clock`` keeps the
real clock, to check that the totals do not depend on the replacement.
"""

import argparse
import gzip
import itertools
import json
import sys
import time
from array import array
from pathlib import Path

BLOCK = 512
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[3]
    / "shared/data/traces/mooncake/conversation_trace.jsonl.gz"
)


def load_trace(path):
    reqs = []
    with gzip.open(path, "rt") as f:
        for line in f:
            r = json.loads(line)
            n = r["input_length"]
            toks = array("q")
            for h in r["hash_ids"]:
                toks.extend(range(h * BLOCK, h * BLOCK + BLOCK))
            reqs.append(toks[:n])
    return reqs


class MockAllocator:
    """What RadixCache asks of a KV allocator when it frees evicted values."""

    device = "cpu"

    def free_segment(self, *args, **kwargs):
        pass


def replay(reqs, page_size, bound, real_clock):
    import sglang.srt.mem_cache.radix_cache as rc
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )

    if not real_clock:
        ticks = itertools.count(1)

        class Clock:
            @staticmethod
            def monotonic():
                return float(next(ticks))

            perf_counter = staticmethod(time.perf_counter)

        rc.time = Clock
    else:
        rc.time = time

    tree = rc.RadixCache.create_simulated(
        page_size=page_size, mock_allocator=MockAllocator()
    )
    matched = evicted = evictions = 0
    for toks in reqs:
        res = tree.match_prefix(MatchPrefixParams(key=rc.RadixKey(toks)))
        matched += res.device_prefix_len
        tree.insert(InsertParams(key=rc.RadixKey(toks)))
        cached = tree.evictable_size() + tree.protected_size()
        if cached > bound:
            out = tree.evict(EvictParams(num_tokens=cached - bound))
            evicted += out.num_tokens_evicted
            evictions += 1
    return {
        "requests": len(reqs),
        "page_size": page_size,
        "bound": bound,
        "queried_tokens": sum(len(t) for t in reqs),
        "matched_tokens": matched,
        "evicted_tokens": evicted,
        "evict_calls": evictions,
        "cached_tokens": tree.evictable_size() + tree.protected_size(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument(
        "--runs",
        default="2000:1:200000,2000:16:200000,2000:1:1000000,2000:16:1000000,"
        "0:1:1000000,0:16:1000000",
        help="comma-separated REQUESTS:PAGE_SIZE:BOUND (REQUESTS 0 = the whole trace)",
    )
    ap.add_argument("--out", type=Path, help="JSON file to write (default: stdout)")
    ap.add_argument("--real-clock", action="store_true")
    args = ap.parse_args()

    import sglang

    reqs = load_trace(args.trace)
    runs = []
    for spec in args.runs.split(","):
        n, ps, bound = (int(x) for x in spec.split(":"))
        t0 = time.time()
        r = replay(reqs[:n] if n else reqs, ps, bound, args.real_clock)
        print(f"{r} ({time.time() - t0:.0f} s)", file=sys.stderr)
        runs.append(r)
    doc = {
        "source": f"sglang {sglang.__version__} RadixCache (lru), "
        "tools/reference/radix_replay.py",
        "trace": "mooncake/conversation_trace.jsonl.gz",
        "block_tokens": BLOCK,
        "runs": runs,
    }
    text = json.dumps(doc, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
