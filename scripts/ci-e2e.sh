#!/usr/bin/env bash
# End-to-end checks of the release binary against real clients, run by
# .ci/run after the test suite (and usable by hand):
#   1. starts `arbor serve` on the default model on a free loopback port;
#   2. runs scripts/openai_smoke.py with the official `openai` Python client
#      (completions, chat, streaming with usage, n, logprobs, 4xx errors);
#   3. runs a short `arbor bench serving` against the same server, which must
#      finish every request;
#   4. stops the server with SIGTERM and checks that it exits cleanly.
# Environment: PYTHON (a Python with `openai` installed; default python3),
# ARBOR (the binary; default target/release/arbor).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
ARBOR="${ARBOR:-target/release/arbor}"
[ -x "$ARBOR" ] || { echo "ci-e2e: $ARBOR not built (cargo build --release -p arbor)" >&2; exit 1; }

PORT="$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
BASE="http://127.0.0.1:$PORT"
LOG="$(mktemp -t arbor-e2e.XXXXXX.log)"

"$ARBOR" serve --host 127.0.0.1 --port "$PORT" --max-total-tokens 16384 >"$LOG" 2>&1 &
SERVER=$!
cleanup() { kill "$SERVER" 2>/dev/null || true; }
trap cleanup EXIT

for _ in $(seq 1 120); do
  if curl -sf "$BASE/health" >/dev/null 2>&1; then break; fi
  if ! kill -0 "$SERVER" 2>/dev/null; then
    echo "ci-e2e: the server exited during start-up:" >&2; cat "$LOG" >&2; exit 1
  fi
  sleep 0.5
done
curl -sf "$BASE/health" >/dev/null || { echo "ci-e2e: no /health after 60 s" >&2; cat "$LOG" >&2; exit 1; }

echo "-- openai client against $BASE"
"$PYTHON" scripts/openai_smoke.py "$BASE"

echo "-- arbor bench serving against $BASE"
BENCH_OUT="$(mktemp -t arbor-e2e-bench.XXXXXX.txt)"
"$ARBOR" bench serving --backend arbor --base-url "$BASE" --dataset-name random \
  --random-input-len 64 --random-output-len 16 --num-prompts 16 --max-concurrency 4 --seed 1 \
  | tee "$BENCH_OUT"
grep -Eq "Successful requests: +16 *$" "$BENCH_OUT" || { echo "ci-e2e: not every benchmark request succeeded" >&2; exit 1; }

echo "-- SIGTERM"
kill -TERM "$SERVER"
for _ in $(seq 1 60); do
  kill -0 "$SERVER" 2>/dev/null || break
  sleep 0.5
done
if kill -0 "$SERVER" 2>/dev/null; then echo "ci-e2e: the server ignored SIGTERM for 30 s" >&2; exit 1; fi
wait "$SERVER" && rc=0 || rc=$?
[ "$rc" -eq 0 ] || { echo "ci-e2e: the server exited with $rc after SIGTERM" >&2; cat "$LOG" >&2; exit 1; }
trap - EXIT
echo "ci-e2e: 3 passed, 0 failed"
