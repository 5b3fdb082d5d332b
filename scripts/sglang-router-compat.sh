#!/usr/bin/env bash
# Arbor workers behind SGLang's own router (PyPI sglang-router, unmodified):
# two `arbor serve` workers of the tiny Llama fixture, SGLang's router in
# front with cache_aware; the native API, the OpenAI chat API (official
# client) and a stream through it must equal the workers' direct answers
# (greedy), a shared prefix must stay on one worker, and SGLang's
# /get_loads must read every worker's own /get_load.
#
#   PYTHON=venv/bin/python ARBOR=target/debug/arbor scripts/sglang-router-compat.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
arbor=${ARBOR:-target/debug/arbor}
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
urls=()
for i in 0 1; do
  "$arbor" serve --model-path tests/fixtures/tiny-llama --port 0 --threads 1 \
    --max-total-tokens 8192 --enable-metrics >"$tmp/w$i.log" 2>&1 &
  pids+=($!)
done
# The address a server printed in its log (`listening on URL`), waiting for it.
server_url() {
  for _ in $(seq 300); do grep -q '^listening on ' "$1" && break; sleep 0.1; done
  grep '^listening on ' "$1" | sed 's/^listening on //'
}
for i in 0 1; do urls+=("$(server_url "$tmp/w$i.log")"); done
free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# Starts SGLang's router (NAME, LOG, then its arguments) on two free ports
# (its own and Prometheus') and waits for it; sets $router_port. A port
# picked free can be taken again (by an outgoing connection's ephemeral
# port) before the router binds it: then it tries again with new ports.
start_router() {
  local name="$1" log="$2" pid try
  shift 2
  for try in 1 2 3; do
    router_port=$(free_port)
    "$py" -m sglang_router.launch_router --host 127.0.0.1 --port "$router_port" \
      --prometheus-port "$(free_port)" "$@" >"$log" 2>&1 &
    pid=$!
    pids+=("$pid")
    for _ in $(seq 240); do
      curl -sf "http://127.0.0.1:$router_port/health" >/dev/null && return 0
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.5
    done
    if kill -0 "$pid" 2>/dev/null || ! grep -q "Address already in use" "$log"; then break; fi
    echo "$name: a port was taken before it bound it (try $try); trying new ports"
  done
  echo "$name did not come up" >&2
  tail -20 "$log"
  return 1
}
start_router "SGLang's router" "$tmp/router.log" --worker-urls "${urls[@]}" --policy cache_aware || exit 1
port=$router_port
"$py" - "http://127.0.0.1:$port" "${urls[@]}" <<'PY' || { tail -20 "$tmp/router.log"; exit 1; }
import json, sys, time, urllib.request
router, workers = sys.argv[1], sys.argv[2:]
def post(url, body):
    rq = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(rq, timeout=60) as r:
        return r.read().decode()
def served():
    out = []
    for w in workers:
        text = urllib.request.urlopen(w + "/metrics", timeout=10).read().decode()
        out.append(sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("arbor:num_requests_total")))
    return out
prefix = "oak elm ash fir yew bay " * 6
before = served()
for q in range(4):
    body = {"text": f"{prefix} question {q}", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    got = json.loads(post(router + "/generate", body))
    want = json.loads(post(workers[0] + "/generate", body))
    assert got["output_ids"] == want["output_ids"], (got, want)
after = served()
d = [a - b for a, b in zip(after, before)]
# Each direct request counted once on worker 0; the routed ones all on one worker.
routed = [d[0] - 4, d[1]]
assert sorted(routed) == [0, 4], d
from openai import OpenAI
c = OpenAI(base_url=router + "/v1", api_key="none")
direct = OpenAI(base_url=workers[1] + "/v1", api_key="none")
msgs = [{"role": "user", "content": "Name a tree."}]
a = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=6, temperature=0)
b = direct.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=6, temperature=0)
assert a.choices[0].message.content == b.choices[0].message.content, (a, b)
s = "".join(ch.choices[0].text for ch in c.completions.create(model="tiny-llama", prompt="Hi", max_tokens=5, temperature=0, stream=True))
t = direct.completions.create(model="tiny-llama", prompt="Hi", max_tokens=5, temperature=0).choices[0].text
assert s == t, (s, t)
# SGLang's /get_loads reads each worker's /get_load (-1 when it cannot):
# every Arbor worker must report a load, the one it reports itself.
loads = json.loads(urllib.request.urlopen(router + "/get_loads", timeout=30).read())
got = {w["worker"].rstrip("/"): w["load"] for w in loads["workers"]}
own = {}
for w in workers:
    ranks = json.loads(urllib.request.urlopen(w + "/get_load", timeout=10).read())
    own[w.rstrip("/")] = sum(r["num_tokens"] for r in ranks)
assert got == own and all(v >= 0 for v in got.values()), (loads, own)
print(f"SGLang's router in front of Arbor workers: native, chat, stream equal; prefix affinity {routed}; loads {got}")
PY

# Prefill/decode disaggregation behind SGLang's router (--pd-disaggregation):
# it sends each request to an Arbor prefill worker and an Arbor decode worker
# at once with bootstrap_host/port/room; the decode worker pulls the room's
# KV and first token from the prefill worker's bootstrap port. Greedy output
# must equal a whole worker's, the decode worker must report the prompt's
# pages as cached, count the pulled tokens and start every request from the
# prefill's first token, and both pools must drain.
"$arbor" serve --model-path tests/fixtures/tiny-llama --port 0 --threads 1 --max-total-tokens 8192 \
  --enable-metrics --disaggregation-mode prefill --disaggregation-bootstrap-port 0 >"$tmp/p.log" 2>&1 &
pids+=($!)
"$arbor" serve --model-path tests/fixtures/tiny-llama --port 0 --threads 1 --max-total-tokens 8192 \
  --enable-metrics --disaggregation-mode decode >"$tmp/d.log" 2>&1 &
pids+=($!)
purl=$(server_url "$tmp/p.log")
durl=$(server_url "$tmp/d.log")
bport=$("$py" -c 'import json,sys,urllib.request; print(json.load(urllib.request.urlopen(sys.argv[1] + "/get_server_info"))["disaggregation"]["bootstrap_port"])' "$purl")
start_router "SGLang's PD router" "$tmp/pd-router.log" --pd-disaggregation \
  --prefill "$purl" "$bport" --decode "$durl" --policy round_robin || exit 1
pdport=$router_port
"$py" - "http://127.0.0.1:$pdport" "$durl" "$purl" "${urls[0]}" <<'PY' || { tail -20 "$tmp/pd-router.log"; tail -20 "$tmp/d.log"; tail -20 "$tmp/p.log"; exit 1; }
import json, sys, time, urllib.request
router, decode, prefill, whole = sys.argv[1:]
def post(url, body):
    rq = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(rq, timeout=120) as r:
        return json.loads(r.read().decode())
def metric(url, name):
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("arbor:" + name))
pulled = metric(decode, "kv_transfer_tokens_total")
for q in range(3):
    prompt = "birch maple cedar " * (8 + 5 * q) + f"question {q}"
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    got = post(router + "/generate", body)
    want = post(whole + "/generate", body)
    assert got["output_ids"] == want["output_ids"], (got, want)
    n = got["meta_info"]["prompt_tokens"]
    cached = got["meta_info"]["cached_tokens"]
    # The decode worker matched the pulled whole pages of the prompt.
    assert cached >= (n - 1) // 16 * 16 > 0, (n, cached, got["meta_info"])
from openai import OpenAI
c = OpenAI(base_url=router + "/v1", api_key="none")
direct = OpenAI(base_url=whole + "/v1", api_key="none")
msgs = [{"role": "user", "content": "Name three trees that grow near rivers, please. " * 3}]
a = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=8, temperature=0)
b = direct.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=8, temperature=0)
assert a.choices[0].message.content == b.choices[0].message.content, (a, b)
moved = metric(decode, "kv_transfer_tokens_total") - pulled
failed = metric(decode, "kv_transfer_failures_total")
assert moved > 0 and failed == 0, (moved, failed)
# Each of the 4 requests started from the first token its prefill sampled.
given = metric(decode, "given_first_tokens_total")
assert given == 4, given
for w in (prefill, decode):
    urllib.request.urlopen(urllib.request.Request(w + "/flush_cache", b"", method="POST"), timeout=30).read()
    for _ in range(100):
        load = json.loads(urllib.request.urlopen(w + "/get_load", timeout=10).read())
        if sum(r["num_tokens"] for r in load) == 0:
            break
        time.sleep(0.05)
    else:
        sys.exit(f"{w}: KV still held after a flush: {load}")
print(f"SGLang's PD router over an Arbor prefill and decode worker: greedy equal, {moved:.0f} KV tokens pulled by bootstrap room, {given:.0f} requests started from the prefill's first token")
PY
