#!/usr/bin/env python3
"""Smoke test of `arbor serve` with the official `openai` Python client.

Usage: openai_smoke.py BASE_URL [--api-key KEY] [--model NAME]

BASE_URL is the server root (e.g. http://127.0.0.1:30000); the client talks to
BASE_URL/v1. Checks /v1/models, completions, chat completions, streaming of
both (with stream_options.include_usage), n > 1, and an error answer. Prints
one line per check and exits non-zero on the first failure.
"""

import argparse
import sys

try:
    import openai
    from openai import OpenAI
except ImportError:  # pragma: no cover
    print("the `openai` package is missing: pip install openai", file=sys.stderr)
    sys.exit(2)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base_url")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key, timeout=120, max_retries=0)
    steps = []

    def step(name):
        def wrap(fn):
            steps.append((name, fn))
            return fn

        return wrap

    state = {}

    @step("models")
    def _():
        models = client.models.list().data
        check(len(models) >= 1, "no model listed")
        state["model"] = args.model or models[0].id
        return state["model"]

    @step("completions")
    def _():
        r = client.completions.create(model=state["model"], prompt="Hello, my name is", max_tokens=8, temperature=0)
        check(len(r.choices) == 1, "one choice")
        check(r.choices[0].finish_reason in ("stop", "length"), f"finish_reason {r.choices[0].finish_reason}")
        check(r.usage is not None and r.usage.completion_tokens >= 1, "usage.completion_tokens")
        check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, "usage.total_tokens")
        return repr(r.choices[0].text)

    @step("completions n=2, seed, stop")
    def _():
        r = client.completions.create(
            model=state["model"], prompt="The sky is", max_tokens=6, n=2, seed=7, temperature=0.8, stop=["\n\n"]
        )
        check(len(r.choices) == 2, "two choices")
        check(sorted(c.index for c in r.choices) == [0, 1], "choice indexes")
        return f"{len(r.choices)} choices"

    @step("completions stream + usage")
    def _():
        text, finish, usage = "", None, None
        for chunk in client.completions.create(
            model=state["model"],
            prompt="Once upon a time",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        check(finish in ("stop", "length"), f"finish_reason {finish}")
        check(usage is not None and usage.completion_tokens >= 1, "usage chunk")
        return repr(text)

    @step("chat")
    def _():
        r = client.chat.completions.create(
            model=state["model"],
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
            max_tokens=8,
            temperature=0,
        )
        check(r.choices[0].message.role == "assistant", "assistant role")
        check(r.choices[0].message.content is not None, "content")
        check(r.usage is not None and r.usage.prompt_tokens > 0, "usage")
        return repr(r.choices[0].message.content)

    @step("chat stream + usage")
    def _():
        text, role, finish, usage = "", None, None, None
        for chunk in client.chat.completions.create(
            model=state["model"],
            messages=[{"role": "user", "content": "Count to three."}],
            max_completion_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.choices:
                d = chunk.choices[0].delta
                role = d.role or role
                text += d.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        check(role == "assistant", "role delta")
        check(finish in ("stop", "length"), f"finish_reason {finish}")
        check(usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, "usage")
        return repr(text)

    @step("chat logprobs")
    def _():
        r = client.chat.completions.create(
            model=state["model"],
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        lp = r.choices[0].logprobs
        check(lp is not None and len(lp.content) == r.usage.completion_tokens, "one entry per token")
        check(all(len(e.top_logprobs) == 2 for e in lp.content), "top_logprobs")
        return f"{len(lp.content)} entries"

    @step("errors are 4xx with a message")
    def _():
        try:
            client.completions.create(model=state["model"], prompt="x", max_tokens=0)
        except openai.BadRequestError as e:
            check("max_tokens" in str(e), f"message names max_tokens: {e}")
        else:
            raise AssertionError("max_tokens=0 was accepted")
        try:
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        except openai.NotFoundError:
            pass
        else:
            raise AssertionError("an unknown model was accepted")
        return "ok"

    for name, fn in steps:
        try:
            detail = fn()
        except Exception as e:  # noqa: BLE001 - report any failure and stop
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            return 1
        print(f"ok   {name}: {detail}")
    print("openai smoke test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
