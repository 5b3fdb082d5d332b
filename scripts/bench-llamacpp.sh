#!/usr/bin/env bash
# Arbor against llama.cpp on the default model (SmolLM2-135M-Instruct Q4_1 GGUF), in one run on
# one machine: 512-token prefill and batch-1 decode, the engines alternated (A B A B), same
# threads (tools/llamacpp/bench_compare.py prints both, the ratios and the batch-1 roofline).
#
#   scripts/bench-llamacpp.sh [ROUNDS]
#
# llama.cpp comes from PyPI's llama-cpp-python sources, built into $VENV (default
# ~/.cache/arbor/llamacpp-venv; 15-20 minutes on 2 cores the first time) with the flags below:
# native builds and the AMX kernels are off because the AMX kernels die with SIGILL on some VMs;
# AVX-512 (with VNNI and BF16), AVX2, FMA and F16C are on. THREADS (default 2) for both engines.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
threads=${THREADS:-2}
venv=${VENV:-$HOME/.cache/arbor/llamacpp-venv}
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
if ! "$venv/bin/python" -c 'import llama_cpp' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --no-binary llama-cpp-python llama-cpp-python
fi
cargo run --release -q -p arbor -- fetch-default
cargo bench -q -p arbor-models --bench default_model --no-run
# The read bandwidth for the roofline, from the forward bench's first line ("... GB/s").
bw=$(ARBOR_BENCH_THREADS=$threads cargo bench -q -p arbor-models --bench forward 2>/dev/null \
  | grep -o '[0-9.]* GB/s' | head -1 | cut -d' ' -f1 || true)
args=(--threads "$threads" --rounds "$rounds")
[ -n "$bw" ] && args+=(--bandwidth-gbs "$bw")
"$venv/bin/python" tools/llamacpp/bench_compare.py "${args[@]}"
