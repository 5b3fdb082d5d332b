#!/usr/bin/env bash
# HiCache benchmark: the Mooncake conversation trace (scaled: --trace-block-tokens)
# replayed against `arbor serve` with a device KV pool of about a tenth of the
# working set, without tiers, with the host tier, host + file store and
# host + redis; then the time to first token of a long prefix after a restart
# (served from the file store) against the same prompt cold.
#
# Usage: scripts/bench-hicache.sh [N_PROMPTS] [BLOCK_TOKENS] [DEVICE_TOKENS]
# (ONLY="none host host_file host_redis long" picks parts; OUT sets the folder;
# CONCURRENCY the requests in flight, default 4; RATIO the host tier over the
# device pool, default 2.)
# Needs a release build (cargo build --release -p arbor), the default model
# (arbor fetch-default) and redis-server on PATH (the redis run is skipped without).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-400}
BLOCK=${2:-8}
DEVICE=${3:-7168}
BIN=${ARBOR_BIN:-target/release/arbor}
MODEL=${ARBOR_MODEL:-$HOME/.cache/arbor/models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-/tmp/arbor-bench-hicache}
PORT=${PORT:-31800}
rm -rf "$OUT" && mkdir -p "$OUT"

serve() { # name, extra flags...
  local name=$1; shift
  "$BIN" serve --model-path "$MODEL" --port "$PORT" --max-total-tokens "$DEVICE" \
    --enable-metrics "$@" >"$OUT/$name.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 600); do
    grep -q "listening on" "$OUT/$name.log" 2>/dev/null && return 0
    kill -0 $SERVER 2>/dev/null || { cat "$OUT/$name.log"; return 1; }
    sleep 0.1
  done
  return 1
}
stop() { kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true; }
metric() { curl -s "http://127.0.0.1:$PORT/metrics" | awk -v m="arbor:$1" 'index($0, m"{")==1 {print $NF; exit}'; }

replay() { # name, extra flags...
  local name=$1; shift
  # ONLY="host host_file" runs just those replays.
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  serve "$name" "$@"
  "$BIN" bench serving --port "$PORT" --tokenizer "$MODEL" --dataset-name mooncake \
    --num-prompts "$N" --trace-block-tokens "$BLOCK" --trace-output-len 4 \
    --trace-speed inf --max-concurrency "${CONCURRENCY:-4}" --tokenize-prompt --warmup-requests 0 \
    --cache-report --disable-tqdm --output-summary "$OUT/summary.jsonl" >"$OUT/$name.bench" 2>&1
  echo "$name host_hit_tokens=$(metric hicache_host_hit_tokens_total) storage_hit_tokens=$(metric hicache_storage_hit_tokens_total) storage_errors=$(metric hicache_storage_errors_total)" >>"$OUT/tiers.txt"
  stop
}

HOST=(--enable-hierarchical-cache --hicache-ratio "${RATIO:-2}" --hicache-write-policy write_through)
replay none
replay host "${HOST[@]}"
# Storage hits count only when the request waits for its prefetch (SGLang's
# best_effort admits at once); the threshold is scaled with the blocks.
FETCH=(--hicache-storage-prefetch-policy wait_complete)
replay host_file "${HOST[@]}" "${FETCH[@]}" --hicache-storage-backend file \
  --hicache-storage-backend-extra-config "{\"dir\": \"$OUT/store\", \"prefetch_threshold\": 16}"
if command -v redis-server >/dev/null; then
  RPORT=$((PORT + 1))
  redis-server --port $RPORT --bind 127.0.0.1 --save '' --appendonly no --dir "$OUT" >/dev/null &
  REDIS=$!
  sleep 0.5
  replay host_redis "${HOST[@]}" "${FETCH[@]}" --hicache-storage-backend redis \
    --hicache-storage-backend-extra-config "{\"url\": \"redis://127.0.0.1:$RPORT\", \"prefetch_threshold\": 16}"
  kill $REDIS; wait $REDIS 2>/dev/null || true
fi

# A 2,000-token prefix: cold, then after a restart from the file store.
if [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" long "* ]]; then
python3 - "$OUT/long.json" <<'EOF'
import json, random, sys
random.seed(5)
ids = [random.randrange(1000, 40000) for _ in range(2000)]
json.dump({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, open(sys.argv[1], "w"))
EOF
ttft() { curl -s -o /dev/null -w '%{time_total}' -H 'content-type: application/json' \
  -d @"$OUT/long.json" "http://127.0.0.1:$PORT/generate"; }
STORE=(--hicache-storage-backend file --hicache-storage-prefetch-policy wait_complete
  --hicache-storage-backend-extra-config "{\"dir\": \"$OUT/store-long\"}")
serve long_cold "${HOST[@]}" "${STORE[@]}"
COLD=$(ttft)
sleep 2 # the backups reach the store
stop
serve long_restart "${HOST[@]}" "${STORE[@]}"
WARM=$(ttft)
stop
echo "2000-token prefix: cold ${COLD}s, after a restart (file store) ${WARM}s" >>"$OUT/tiers.txt"
fi

for f in none host host_file host_redis; do
  [ -f "$OUT/$f.bench" ] || continue
  echo "== $f"
  grep -E "Mean TTFT|Median TTFT|P99 TTFT|[Cc]ache hit|cached|Output token throughput" "$OUT/$f.bench" || true
done
cat "$OUT/tiers.txt"
