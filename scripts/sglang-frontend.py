#!/usr/bin/env python3
"""Runs a program in SGLang's frontend language against a running server.

Usage: sglang-frontend.py BASE_URL

The program (the real `sglang` package, through `sgl.RuntimeEndpoint`) uses
`gen` with a regex, with a stop string and with a stop regex, `select`, and
`fork`/`join`. It prints one JSON object: the program's text and each
variable it produced, with the meta information of `select` (the
normalized prompt log-probabilities the frontend compared). The caller
checks them against the server's native API (crates/arbor/tests).
"""

import json
import sys

import sglang as sgl

COLOURS = ["red", "green", "blue"]


@sgl.function
def profile(s, name):
    s += "The following is a short profile of " + name + ".\n"
    s += "Name: " + name + "\n"
    s += "Age: " + sgl.gen("age", max_tokens=8, regex=r"[1-9][0-9]?", temperature=0)
    s += "\nCity: " + sgl.gen("city", max_tokens=16, stop="\n", temperature=0)
    s += "\nFavourite colour: " + sgl.select("colour", choices=COLOURS)
    s += "\nMotto: " + sgl.gen("motto", max_tokens=24, stop_regex=r"[.!?\n]", temperature=0)
    s += "\nHobbies:\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"{i + 1}. " + sgl.gen("hobby", max_tokens=12, stop="\n", temperature=0)
    hobbies = [f["hobby"] for f in forks]
    forks.join()
    for i, h in enumerate(hobbies):
        s += f"{i + 1}. {h}\n"
    s += "Summary: " + sgl.gen("summary", max_tokens=10, stop=["\n", "."], temperature=0)


def main() -> None:
    base = sys.argv[1]
    backend = sgl.RuntimeEndpoint(base)
    sgl.set_default_backend(backend)
    state = profile.run(name="Ada")
    text = state.text()
    error = state.error()
    if error is not None:
        raise SystemExit(f"the program failed: {error}")
    meta = state.get_meta_info("colour")
    print(
        json.dumps(
            {
                "model": backend.get_model_name(),
                "text": text,
                "age": state["age"],
                "city": state["city"],
                "colour": state["colour"],
                "choices": COLOURS,
                "normalized_prompt_logprobs": meta["normalized_prompt_logprobs"],
                "motto": state["motto"],
                "summary": state["summary"],
            }
        )
    )


if __name__ == "__main__":
    main()
