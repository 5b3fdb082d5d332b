#!/usr/bin/env python3
"""Random-string tokenization by llama.cpp, to check arbor-gguf's tokenizer
beyond the committed fixtures (not committed itself: it is large).

For each GGUF given (a model or a vocabulary-only file), writes
<out-dir>/<name>.json with N random strings mixing ASCII, digits, whitespace
of every kind, punctuation, accented/CJK/Cyrillic/Arabic/Devanagari letters,
combining marks, emoji with joiners, contractions and special-token texts,
each with llama.cpp's ids (add_special=True, parse_special=True).
Compare with:

    ARBOR_TOKENIZE_CORPUS=<out-dir>/<name>.json ARBOR_TOKENIZE_GGUF=<file.gguf> \
        cargo test -p arbor-gguf --test llamacpp_corpus -- --ignored --nocapture

To test other `tokenizer.ggml.pre` values on one vocabulary, copy a GGUF's
metadata with another `pre` (the `gguf` package's GGUFWriter) and run both.
"""

import argparse
import json
import random
from pathlib import Path

import llama_cpp

PIECES = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") * 3
    + list("0123456789") * 2
    + [" "] * 20
    + list("\t\n\r\u00a0\u3000\u2028\u200b\u2003\x0b\x0c")
    + list(".,;:!?'\"-_()[]{}<>/\\|@#$%^&*+=~`")
    + list("éèêëçàâäöüßñøåÉÈÇÜ")
    + list("日本語中文字한국어テキスト")
    + list("🦀🚀👩‍👧❤️🇫🇷")
    + ["\u0301", "\u0308", "\u200d", "\ufe0f"]
    + list("русскийтекстعربيةελληνικάहिन्दी")
    + ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL"]
    + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "<|im_", "<|", "|>"]
    + ["\x00", "\x01", "\x7f"]
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", nargs="+", type=Path)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/arbor-corpus"))
    ap.add_argument("-n", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for path in args.gguf:
        rng = random.Random(args.seed)
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        cases = []
        for _ in range(args.n):
            text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 40)))
            cases.append({"text": text, "ids": llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)})
        out = args.out_dir / f"{path.stem}.json"
        out.write_text(json.dumps(cases, ensure_ascii=False), encoding="utf-8")
        print(f"{path} -> {out} ({len(cases)} strings)")


if __name__ == "__main__":
    main()
