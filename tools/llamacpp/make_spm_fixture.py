#!/usr/bin/env python3
"""Writes a small SentencePiece-style ("llama") GGUF vocabulary and llama.cpp's
tokenization of test prompts with it, for the arbor-gguf tokenizer tests.

No model in reach uses tokenizer.ggml.model = "llama", so this trains a tiny
SentencePiece BPE model (byte fallback, a control and a user-defined token)
on a fixed built-in text, converts it to a vocabulary-only GGUF the way
llama.cpp's converter does (tokens, scores, token types), and asks llama.cpp
(llama-cpp-python, vocab_only=True) to tokenize prompts with
add_space_prefix true and false.

Outputs (small; committed):
  crates/gguf/tests/fixtures/spm/vocab.gguf
  crates/gguf/tests/fixtures/spm/llamacpp.json

Needs `sentencepiece` and `gguf` in one interpreter (--build-python) and
llama-cpp-python in the one running this script:

    /work/llenv/bin/python tools/llamacpp/make_spm_fixture.py --build-python /work/pyenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "crates" / "gguf" / "tests" / "fixtures" / "spm"

TEXT = """\
Beautiful is better than ugly. Explicit is better than implicit.
Simple is better than complex. Complex is better than complicated.
Flat is better than nested. Sparse is better than dense. Readability counts.
Special cases aren't special enough to break the rules.
Although practicality beats purity. Errors should never pass silently.
In the face of ambiguity, refuse the temptation to guess.
There should be one-- and preferably only one --obvious way to do it.
Now is better than never. Although never is often better than *right* now.
If the implementation is hard to explain, it's a bad idea.
Namespaces are one honking great idea -- let's do more of those!
The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly.
def main():\n    print("hello, world")\n    return 0\n
for i in range(10): total += i * 2
Le café est très bon. Der Bär läuft über die Straße. El niño está aquí.
東京は日本の首都です。 Привет, как дела?
"""

PROMPTS = [
    "Hello world",
    " Hello world",
    "  two leading spaces",
    "The quick brown fox jumps over the lazy dog.",
    "Beautiful is better than ugly.\nSimple is better than complex.",
    "multiple   spaces\tand\ttabs",
    "trailing spaces   ",
    "café über niño Straße",
    "東京 日本 首都",
    "emoji 🦀 and unknown ☃ chars",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>after control",
    "a <tool> user-defined <tool>token",
    "numbers 1234567 and 3.14",
    "",
    " ",
    "\n",
]

BUILD = r'''
import sys, json
import sentencepiece as spm
import gguf
text_path, model_prefix, out_gguf = sys.argv[1:4]
spm.SentencePieceTrainer.train(
    input=text_path, model_prefix=model_prefix, model_type="bpe", vocab_size=600,
    byte_fallback=True, character_coverage=0.9995, num_threads=1, hard_vocab_limit=False,
    control_symbols=["<|im_start|>", "<|im_end|>"], user_defined_symbols=["<tool>"],
    split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
    normalization_rule_name="identity", seed_sentencepiece_size=100000,
)
sp = spm.SentencePieceProcessor(model_file=model_prefix + ".model")
tokens, scores, types = [], [], []
for i in range(sp.vocab_size()):
    tokens.append(sp.id_to_piece(i))
    scores.append(sp.get_score(i))
    if sp.is_unknown(i): t = 2
    elif sp.is_control(i): t = 3
    elif sp.is_unused(i): t = 5
    elif sp.is_byte(i): t = 6
    else: t = 1
    types.append(t)
for i, p in enumerate(tokens):
    if p == "<tool>": types[i] = 4
w = gguf.GGUFWriter(out_gguf, arch="llama")
w.add_name("arbor-spm-test-vocab")
w.add_context_length(128); w.add_embedding_length(8); w.add_block_count(1)
w.add_feed_forward_length(8); w.add_head_count(1); w.add_head_count_kv(1)
w.add_layer_norm_rms_eps(1e-5); w.add_rope_dimension_count(8); w.add_vocab_size(len(tokens))
w.add_tokenizer_model("llama")
w.add_token_list(tokens); w.add_token_scores(scores); w.add_token_types(types)
w.add_bos_token_id(sp.bos_id()); w.add_eos_token_id(sp.eos_id()); w.add_unk_token_id(sp.unk_id())
w.add_add_bos_token(True); w.add_add_eos_token(False); w.add_add_space_prefix(True)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
print(json.dumps({"vocab_size": len(tokens), "sentencepiece": spm.__version__, "gguf_py": getattr(gguf, "__version__", "?")}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-python", default="/work/pyenv/bin/python",
                    help="interpreter with sentencepiece and gguf")
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out_gguf = args.out_dir / "vocab.gguf"

    with tempfile.TemporaryDirectory() as tmp:
        text_path = Path(tmp) / "text.txt"
        text_path.write_text(TEXT * 3, encoding="utf-8")
        built = subprocess.run(
            [args.build_python, "-c", BUILD, str(text_path), str(Path(tmp) / "spm"), str(out_gguf)],
            check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]
    info = json.loads(built)

    import llama_cpp  # noqa: PLC0415

    results = {}
    for add_space_prefix in (True, False):
        # The same vocabulary with add_space_prefix = false, through llama.cpp's own override.
        kv = None if add_space_prefix else {"tokenizer.ggml.add_space_prefix": False}
        llm = llama_cpp.Llama(model_path=str(out_gguf), vocab_only=True, verbose=False, kv_overrides=kv)
        cases = []
        for text in PROMPTS:
            cases.append({
                "text": text,
                "ids": llm.tokenize(text.encode("utf-8"), add_bos=True, special=True),
                "ids_without_special": llm.tokenize(text.encode("utf-8"), add_bos=False, special=True),
            })
        results["add_space_prefix" if add_space_prefix else "no_space_prefix"] = cases
        del llm

    fixture = {
        "about": "llama.cpp tokenization with a tiny SentencePiece BPE vocabulary; written by tools/llamacpp/make_spm_fixture.py",
        "llama_cpp_python": llama_cpp.__version__,
        "build": info,
        "tokenize": "llama_tokenize(text, add_special, parse_special=True); add_special=True in `ids`, False in `ids_without_special`",
        "cases": results,
    }
    (args.out_dir / "llamacpp.json").write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out_gguf} ({out_gguf.stat().st_size} bytes) and llamacpp.json; vocab {info['vocab_size']}")


if __name__ == "__main__":
    main()
