#!/usr/bin/env python3
"""Runs a program in SGLang's frontend language against a running server.

Usage: sglang-frontend.py BASE_URL

The program uses `gen` with a stop string and with a regex, `select`, and
`fork`/`join`, through `sgl.RuntimeEndpoint` (the real `sglang` package).
It prints one JSON object: each variable the program produced, and for
`select` the choice with its normalized prompt log-probabilities as the
frontend computed them. The caller checks them (crates/arbor/tests).
"""

import json
import sys

import sglang as sgl


@sgl.function
def profile(s, name):
    s += "The following is a short profile of " + name + ".\n"
    s += "Name: " + name + "\n"
    s += "Age: " + sgl.gen("age", max_tokens=8, regex=r"[1-9][0-9]?", temperature=0)
    s += "\nCity: " + sgl.gen("city", max_tokens=16, stop="\n", temperature=0)
    s += "\nFavourite colour: " + sgl.select("colour", choices=["red", "green", "blue"])
    s += "\nHobbies:\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"{i + 1}. " + sgl.gen("hobby", max_tokens=12, stop="\n", temperature=0)
    forks.join()
    s += "Summary: " + sgl.gen("summary", max_tokens=10, stop=["\n", "."], temperature=0)


def main() -> None:
    base = sys.argv[1]
    backend = sgl.RuntimeEndpoint(base)
    sgl.set_default_backend(backend)
    state = profile.run(name="Ada")
    meta = state.get_meta_info("colour")
    out = {
        "model": backend.get_model_name(),
        "text": state.text(),
        "age": state["age"],
        "city": state["city"],
        "colour": state["colour"],
        "colour_normalized_prompt_logprobs": meta["normalized_prompt_logprobs"],
        "colour_input_token_logprobs": meta["input_token_logprobs"],
        "hobbies": [f["hobby"] for f in state.fork_states] if hasattr(state, "fork_states") else None,
        "summary": state["summary"],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
