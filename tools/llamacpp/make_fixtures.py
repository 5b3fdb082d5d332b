#!/usr/bin/env python3
"""Writes llama.cpp reference fixtures for SmolLM2-135M-Instruct (Q4_1 GGUF).

Output: tests/fixtures/smollm2/llamacpp.json (small; committed). It holds
  * tokenization of prompts with unicode, whitespace runs, code and special
    tokens, by llama.cpp's own tokenizer (llama_tokenize with add_special=True
    and parse_special=True), and whether BOS was added;
  * three chat prompts rendered with the GGUF's `tokenizer.chat_template`
    (jinja2, add_generation_prompt=True; checked equal to llama-cpp-python's
    own Jinja2ChatFormatter), their token ids, and llama.cpp's first 32 greedy
    tokens (top_k=1, temperature 0, repeat penalty off; stopping early at an
    end-of-generation token);
  * header facts and the first tensors' infos as read by the `gguf` Python
    package (names, ggml types, shapes, absolute offsets, byte sizes);
  * the llama.cpp / llama-cpp-python version and the metadata used.

Usage (llama-cpp-python must be importable; the `gguf` package may live in a
different interpreter, named by --gguf-python):

    /work/llenv/bin/python tools/llamacpp/make_fixtures.py \
        --model ~/.cache/arbor/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --gguf-python /work/pyenv/bin/python

The model path defaults to $ARBOR_DEFAULT_GGUF, else
$ARBOR_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf (ARBOR_HOME defaults to
~/.cache/arbor), the same lookup the Rust tests use.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "fixtures" / "smollm2" / "llamacpp.json"
SEED = 1234
N_THREADS = 2
N_GREEDY = 32

PROMPTS = [
    "Hello, world!",
    "The café served crème brûlée to the naïve señor in Zürich.",
    "日本語のテキストと中文字符，还有한국어도 있습니다。",
    "Emoji: 🦀🚀 family 👩‍👩‍👧 heart ❤️ flag 🇫🇷!",
    "Multiple   spaces    and\ttabs\t\there  \t  mixed",
    "Line one\nLine two\n\n\nLine five\r\nWindows line\n",
    "Numbers: 1234567890, 3.14159, -1e-10, 42nd, 2024-11-29, 100000000",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text with<|im_end|>inline special and <|endoftext|> too<|im_start|>",
    "   leading and trailing spaces   ",
    "I'm sure they'll say it's fine, we've done it; DON'T YOU'D've",
    "Ünïcödé mixed with русский текст and العربية and ελληνικά",
    "<repo_name>arbor<file_sep>src/main.rs\nfn main() { println!(\"hi\"); }",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "non\u00a0breaking\u2003em-space\u3000ideographic and zero\u200bwidth",
    "",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "List three primary colors."},
    ],
    [
        {"role": "user", "content": "Hi! What's 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
        {"role": "user", "content": "Now write a short poem about the sea."},
    ],
]

# Scalar metadata recorded in the fixture (arrays are summarized).
META_KEYS = [
    "general.architecture",
    "general.name",
    "general.file_type",
    "general.quantization_version",
    "llama.block_count",
    "llama.context_length",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.rope.freq_base",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.vocab_size",
    "llama.rope.dimension_count",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.chat_template",
]
ARRAY_KEYS = ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"]
FIRST_TENSORS = 8
EXTRA_TENSORS = ["blk.29.ffn_down.weight", "output_norm.weight"]


def default_model() -> Path:
    env = os.environ.get("ARBOR_DEFAULT_GGUF")
    if env:
        return Path(env)
    home = os.environ.get("ARBOR_HOME") or os.path.join(Path.home(), ".cache", "arbor")
    return Path(home) / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_facts(model: Path) -> dict:
    """Header, metadata and tensor infos as read by the `gguf` package."""
    import gguf  # noqa: PLC0415

    r = gguf.GGUFReader(str(model))
    meta = {}
    for key in META_KEYS:
        f = r.fields.get(key)
        if f is not None:
            meta[key] = f.contents()
    arrays = {}
    for key in ARRAY_KEYS:
        f = r.fields.get(key)
        if f is None:
            continue
        vals = f.contents()
        h = hashlib.sha256(json.dumps(vals, ensure_ascii=False).encode()).hexdigest()
        arrays[key] = {"len": len(vals), "first": vals[:20], "last": vals[-3:], "sha256_json": h}
    version = int(r.fields["GGUF.version"].contents())
    align_f = r.fields.get("general.alignment")
    alignment = int(align_f.contents()) if align_f is not None else 32

    def info(t) -> dict:
        ne = [int(x) for x in t.shape]
        return {
            "name": t.name,
            "ggml_type": t.tensor_type.name,
            "ggml_type_id": int(t.tensor_type),
            "ne": ne,
            "shape": list(reversed(ne)),
            "offset": int(t.data_offset),
            "bytes": int(t.n_bytes),
        }

    picked = [info(t) for t in r.tensors[:FIRST_TENSORS]]
    picked += [info(t) for t in r.tensors if t.name in EXTRA_TENSORS]
    return {
        "gguf_py_version": getattr(gguf, "__version__", "unknown"),
        "version": version,
        "tensor_count": len(r.tensors),
        "kv_count": int(r.fields["GGUF.kv_count"].contents()),
        "alignment": alignment,
        "data_offset": int(r.data_offset),
        "file_size": model.stat().st_size,
        "metadata": meta,
        "arrays": arrays,
        "tensors": picked,
    }


def llama_version_info(llama_cpp) -> dict:
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    libs = sorted(p.name for p in lib_dir.glob("lib*.so.*.*.*")) if lib_dir.is_dir() else []
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "shared_libraries": libs,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
    }


def render_chat(template: str, messages: list, bos: str, eos: str) -> str:
    import jinja2  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    env = ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True
    )
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model())
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--gguf-python", default=os.environ.get("ARBOR_GGUF_PYTHON", "/work/pyenv/bin/python"),
                    help="interpreter with the `gguf` package, used when this one lacks it")
    ap.add_argument("--gguf-facts-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = args.model.expanduser()
    if not model.is_file():
        sys.exit(f"model not found: {model}")

    if args.gguf_facts_only:
        json.dump(gguf_facts(model), sys.stdout, ensure_ascii=False)
        return

    try:
        facts = gguf_facts(model)
    except ImportError:
        out = subprocess.run(
            [args.gguf_python, __file__, "--model", str(model), "--gguf-facts-only"],
            check=True, capture_output=True, text=True,
        ).stdout
        facts = json.loads(out)

    import llama_cpp  # noqa: PLC0415
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # noqa: PLC0415

    llm = llama_cpp.Llama(
        model_path=str(model), n_ctx=2048, n_threads=N_THREADS, n_threads_batch=N_THREADS,
        n_gpu_layers=0, seed=SEED, verbose=False,
    )
    bos_id, eos_id = llm.token_bos(), llm.token_eos()
    # A second context that keeps every position's logits, to record llama.cpp's
    # own top-2 margin at each greedy step (steps with a near-tie may flip under
    # any other summation order, including llama.cpp's own batched evaluation).
    scorer = llama_cpp.Llama(
        model_path=str(model), n_ctx=2048, n_threads=N_THREADS, n_threads_batch=N_THREADS,
        n_gpu_layers=0, seed=SEED, verbose=False, logits_all=True,
    )

    def step_scores(prompt_ids: list, out_ids: list) -> dict:
        """Per greedy step: llama.cpp's top-2 margin and top-5 logits (decoding one
        token at a time, as generation does), and how far llama.cpp's own batched
        evaluation of the same sequence is from that (its self-consistency)."""
        import numpy as np  # noqa: PLC0415
        scorer.reset()
        scorer.eval(prompt_ids)
        margins, tops, seq = [], [], []
        for tok in out_ids:
            logits = np.array(scorer.scores[scorer.n_tokens - 1])
            top = np.argsort(-logits)[:5]
            if int(top[0]) != tok:
                sys.exit(f"scoring context disagrees with generation at step {len(margins)}")
            margins.append(round(float(logits[top[0]] - logits[top[1]]), 5))
            tops.append([[int(t), round(float(logits[t]), 5)] for t in top])
            seq.append(logits)
            scorer.eval([tok])
        scorer.reset()
        scorer.eval(prompt_ids + out_ids[:-1])
        n = len(prompt_ids)
        batch = np.array(scorer.scores[n - 1:n - 1 + len(out_ids)])
        spread = float(np.abs(batch - np.array(seq)).max())
        return {"greedy_margins": margins, "greedy_top5": tops,
                "batched_vs_sequential_max_abs_diff": round(spread, 5)}

    def piece(tok: int) -> str:
        return llm.detokenize([tok], special=True).decode("utf-8", errors="replace")

    def is_eog(tok: int) -> bool:
        return tok in eog_ids

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llm.n_vocab()
    eog_ids = [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    control_ids = [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_control(vocab, i)]

    tokenize = []
    for text in PROMPTS:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        plain = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        tokenize.append({
            "text": text,
            "add_special": True,
            "parse_special": True,
            # Whether llama.cpp put BOS in front (add_bos_token), as opposed to a
            # literal special token in the text that happens to share its id.
            "bos_added": ids != plain,
            "ids": ids,
            "ids_without_special": plain,
        })

    template = facts["metadata"]["tokenizer.chat_template"]
    bos_text, eos_text = piece(bos_id), piece(eos_id)
    chats = []
    for messages in CHATS:
        prompt = render_chat(template, messages, bos_text, eos_text)
        via_llama_cpp_python = Jinja2ChatFormatter(template, eos_text, bos_text)(messages=messages).prompt
        if via_llama_cpp_python != prompt:
            sys.exit(f"chat rendering differs from llama-cpp-python's:\n{prompt!r}\n{via_llama_cpp_python!r}")
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        llm.reset()
        out_ids = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out_ids.append(int(tok))
            if is_eog(tok) or len(out_ids) >= N_GREEDY:
                break
        chats.append({
            "messages": messages,
            "add_generation_prompt": True,
            "prompt": prompt,
            "prompt_ids": ids,
            "greedy_ids": out_ids,
            **step_scores(ids, out_ids),
            "greedy_pieces": [piece(t) for t in out_ids],
            "greedy_text": llm.detokenize(out_ids, special=False).decode("utf-8", errors="replace"),
            "stopped_at_eog": bool(out_ids) and is_eog(out_ids[-1]),
        })

    fixture = {
        "about": "llama.cpp reference for SmolLM2-135M-Instruct Q4_1; written by tools/llamacpp/make_fixtures.py",
        "model_file": model.name,
        "llama_cpp": llama_version_info(llama_cpp),
        "settings": {
            "n_threads": N_THREADS, "seed": SEED, "n_ctx": 2048, "device": "cpu",
            "greedy": {"top_k": 1, "temp": 0.0, "repeat_penalty": 1.0, "max_tokens": N_GREEDY,
                       "stop": "an end-of-generation token (llama_vocab_is_eog), included"},
            "tokenize": "llama_tokenize(text, add_special=True, parse_special=True)",
            "chat_template": "GGUF tokenizer.chat_template rendered by jinja2 ImmutableSandboxedEnvironment"
                             "(trim_blocks, lstrip_blocks), add_generation_prompt=True; equal to llama-cpp-python's Jinja2ChatFormatter",
        },
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "eog_token_ids": eog_ids,
        "control_token_ids": control_ids,
        "gguf": facts,
        "tokenize": tokenize,
        "chat": chats,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    for c in chats:
        print(repr(c["greedy_text"]))


if __name__ == "__main__":
    main()
