#!/usr/bin/env python3
"""The Responses API of `arbor serve` read by the official `openai` client.

Usage: openai_responses.py BASE_URL

Creates a response (not streamed, then streamed), reads the stored one back,
continues it with previous_response_id, deletes it, and checks that an
unknown field is refused with a 400 naming it. Prints one line per check and
`ok` at the end; exits non-zero on the first failure.
"""

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
    print("pass:", what)


def main() -> int:
    base = sys.argv[1].rstrip("/")
    client = OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
    model = client.models.list().data[0].id

    r = client.responses.create(
        model=model,
        instructions="Answer briefly.",
        input="Hello there",
        max_output_tokens=8,
        temperature=0,
    )
    check(r.id.startswith("resp_") and r.object == "response", "create: id and object")
    check(r.status in ("completed", "incomplete"), f"create: status {r.status}")
    check(isinstance(r.output_text, str), "create: output_text")
    check(r.usage.input_tokens > 0 and r.usage.output_tokens > 0, "create: usage")

    types = []
    text = ""
    final = None
    stream = client.responses.create(
        model=model, instructions="Answer briefly.", input="Hello there", max_output_tokens=8,
        temperature=0, stream=True
    )
    for event in stream:
        types.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    check(types[0] == "response.created", "stream: starts with response.created")
    check(types[-1] in ("response.completed", "response.incomplete"), f"stream: ends with {types[-1]}")
    check(text == r.output_text, "stream: deltas equal the whole answer")
    check(final.output_text == r.output_text, "stream: final response")

    got = client.responses.retrieve(r.id)
    check(got.id == r.id and got.output_text == r.output_text, "retrieve")
    nxt = client.responses.create(
        model=model, input="And again", previous_response_id=r.id, max_output_tokens=4, temperature=0
    )
    check(nxt.usage.input_tokens > r.usage.input_tokens, "previous_response_id extends the prompt")
    client.responses.delete(r.id)
    try:
        client.responses.retrieve(r.id)
        check(False, "deleted responses are gone")
    except openai.NotFoundError:
        check(True, "deleted responses are gone")
    try:
        client.responses.create(model=model, input="x", extra_body={"colour": "blue"})
        check(False, "unknown fields are refused")
    except openai.BadRequestError as e:
        check(e.body.get("param") == "colour" or "colour" in str(e), "unknown fields are refused")
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
