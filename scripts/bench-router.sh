#!/usr/bin/env bash
# The router's policies side by side on 4 workers of the default model:
# `arbor bench serving` with generated-shared-prefix prompts (16 groups)
# through `arbor router` under round_robin, power_of_two, cache_aware and
# cache_aware with bounded load (--max-load-factor, LOAD_FACTORS), alternating the
# policies within each round; then the same with one group taking half the
# traffic (--gsp-hot-group-fraction 0.5). Every run starts from empty
# caches (--flush-cache goes through the router to every worker).
#
#   scripts/bench-router.sh [ROUNDS]
#
# Prints per run: cache hit rate, request throughput, output throughput,
# median and P99 TTFT, and max/mean of the requests each worker served
# (read from the workers' own metrics); then the medians per policy.
set -euo pipefail
rounds=${1:-2}
arbor=${ARBOR_BIN:-target/release/arbor}
model=${ARBOR_DEFAULT_GGUF:-$HOME/.cache/arbor/models/SmolLM2-135M-Instruct.Q4_1.gguf}
workers=${WORKERS:-4}
groups=${GROUPS_N:-16}
per_group=${PER_GROUP:-8}
sys_len=${SYS_LEN:-512}
q_len=${Q_LEN:-32}
out_len=${OUT_LEN:-16}
factors=${LOAD_FACTORS:-1.25}   # bounded-load factors to compare, space separated
hots=${HOT_FRACTIONS:-0 0.5}    # --gsp-hot-group-fraction values
policies=${POLICIES:-round_robin power_of_two cache_aware}
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

wait_url() { # log file -> base URL once "listening on" appears
  for _ in $(seq 600); do
    if grep -q '^listening on ' "$1" 2>/dev/null; then
      grep '^listening on ' "$1" | tail -1 | sed 's/^listening on //'; return 0
    fi
    sleep 0.2
  done
  echo "no 'listening on' in $1" >&2; cat "$1" >&2; return 1
}

urls=()
for i in $(seq "$workers"); do
  "$arbor" serve --model-path "$model" --port 0 --threads 1 --max-total-tokens 16384 \
    --enable-metrics >"$tmp/w$i.log" 2>&1 &
  pids+=($!)
done
for i in $(seq "$workers"); do urls+=("$(wait_url "$tmp/w$i.log")"); done
echo "workers: ${urls[*]}"

served() { # per-worker num_requests_total, space separated
  for u in "${urls[@]}"; do
    curl -s "$u/metrics" | awk '/^arbor:num_requests_total/ {print $NF}'
  done | tr '\n' ' '
}

results=$tmp/results.txt
run() { # label hot-fraction router-args...
  local label=$1 hot=$2; shift 2
  "$arbor" router --port 0 --worker-urls "${urls[@]}" "$@" >"$tmp/router.log" 2>&1 &
  local rp=$!
  local base; base=$(wait_url "$tmp/router.log")
  local before; before=$(served)
  local json=$tmp/run.json
  rm -f "$json"
  "$arbor" bench serving --backend arbor --base-url "$base" --tokenizer "$model" \
    --dataset-name generated-shared-prefix --gsp-num-groups "$groups" --gsp-prompts-per-group "$per_group" \
    --gsp-system-prompt-len "$sys_len" --gsp-question-len "$q_len" --gsp-output-len "$out_len" \
    --gsp-hot-group-fraction "$hot" --max-concurrency 16 --flush-cache --cache-report \
    --output-summary "$json" --disable-tqdm >"$tmp/bench.log" 2>&1 || { cat "$tmp/bench.log"; exit 1; }
  local after; after=$(served)
  kill "$rp"; wait "$rp" 2>/dev/null || true
  python3 - "$json" "$label" "$hot" "$before" "$after" >>"$results" <<'PY'
import json, sys
path, label, hot, before, after = sys.argv[1:6]
rows = [json.loads(l) for l in open(path) if l.strip()]
r = rows[-1]
d = [float(a) - float(b) for a, b in zip(after.split(), before.split())]
mean = sum(d) / len(d)
cache = r.get("cache") or {}
hit = cache.get("hit_rate", cache.get("cache_hit_rate"))
print(json.dumps({"policy": label, "hot": float(hot), "hit_rate": hit,
  "req_s": r.get("request_throughput"), "out_tok_s": r.get("output_throughput"),
  "ttft_median_ms": r.get("median_ttft_ms"), "ttft_p99_ms": r.get("p99_ttft_ms"),
  "per_worker": d, "max_over_mean": max(d) / mean if mean else None}))
PY
  tail -1 "$results"
}

for hot in $hots; do
  for r in $(seq "$rounds"); do
    for p in $policies; do
      run "$p" "$hot" --policy "$p"
    done
    for f in $factors; do
      run "cache_aware_bounded_$f" "$hot" --policy cache_aware --max-load-factor "$f"
    done
  done
done
echo "medians over $rounds rounds"
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
keys = []
for r in rows:
    k = (r["hot"], r["policy"])
    if k not in keys: keys.append(k)
print(f"{'hot':>4} {'policy':<20} {'hit':>6} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'max/mean':>8}")
def med(k, f):
    v = [r[f] for r in rows if (r["hot"], r["policy"]) == k and r[f] is not None]
    return statistics.median(v) if v else float("nan")
for k in keys:
    print(f"{k[0]:>4} {k[1]:<20} {med(k,'hit_rate'):>6.3f} {med(k,'req_s'):>7.2f} {med(k,'out_tok_s'):>9.1f} "
          f"{med(k,'ttft_median_ms'):>9.0f} {med(k,'ttft_p99_ms'):>9.0f} {med(k,'max_over_mean'):>8.2f}")
PY
