#!/usr/bin/env bash
# The minimal engine: `cargo build -p arbor --no-default-features` (no
# kv-radix, grammar or spec-decode) must build and still serve. Run by
# .ci/run (and usable by hand). Checks:
#   1. it serves /generate on the tiny fixture;
#   2. a json_schema request gets a 400 (structured output is compiled out);
#   3. flags of compiled-out features are refused naming the cargo feature.
# The minimal binary is copied to target/arbor-minimal, so the full
# target/debug/arbor the tests use is rebuilt by the next cargo command.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${CARGO_TARGET_DIR:-target}"
PYTHON="${PYTHON:-python3}"
cargo build -p arbor --no-default-features
BIN="$TARGET/arbor-minimal"
cp "$TARGET/debug/arbor" "$BIN"
MODEL=tests/fixtures/tiny-llama
pass=0
fail() { echo "minimal-engine: $*" >&2; exit 1; }

for args in "--radix-eviction-policy lru:kv-radix" "--speculative-algorithm NGRAM:spec-decode" "--grammar-backend llguidance:grammar"; do
  flags="${args%%:*}"; feature="${args##*:}"
  # shellcheck disable=SC2086
  if out="$("$BIN" serve --model-path "$MODEL" --port 0 $flags 2>&1)"; then fail "$flags was accepted"; fi
  grep -q "\`$feature\` cargo feature" <<<"$out" || fail "$flags: no word of the $feature feature: $out"
  pass=$((pass + 1))
done

PORT="$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
BASE="http://127.0.0.1:$PORT"
LOG="$(mktemp -t arbor-minimal.XXXXXX.log)"
"$BIN" serve --model-path "$MODEL" --host 127.0.0.1 --port "$PORT" --max-total-tokens 4096 >"$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf "$BASE/health" >/dev/null 2>&1 && break
  kill -0 "$SERVER" 2>/dev/null || { cat "$LOG" >&2; fail "the server exited during start-up"; }
  sleep 0.5
done
body="$(curl -sf "$BASE/generate" -d '{"text": "hello world", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}')" || fail "/generate failed"
"$PYTHON" -c 'import json,sys; v=json.loads(sys.argv[1]); assert v["meta_info"]["completion_tokens"] == 8, v' "$body" || fail "unexpected answer $body"
pass=$((pass + 1))
code="$(curl -s -o /dev/null -w '%{http_code}' "$BASE/generate" -d '{"text": "hi", "sampling_params": {"max_new_tokens": 4, "json_schema": "{\"type\": \"object\"}"}}')"
[ "$code" = 400 ] || fail "a json_schema request got $code, not 400"
pass=$((pass + 1))
kill -TERM "$SERVER"; wait "$SERVER" || true
trap - EXIT
echo "minimal-engine: $pass passed, 0 failed"
