#!/usr/bin/env bash
# GPU check of the CUDA backend (crates/backend-cuda), for a machine with an
# NVIDIA GPU (sm_80 or newer; sized for one H200, under 8 minutes):
#   1. prints the driver, GPU, toolkit and Rust versions, and finds cuBLAS and
#      NVRTC (CUDA 12 or 13: system CUDA, /usr/local/cuda*, or pip's nvidia-*
#      wheels);
#   2. builds `arbor` with `--features cuda` and checks that `arbor info`
#      opens the device;
#   3. runs the GPU tests with ARBOR_REQUIRE_CUDA=1 (a missing device fails
#      instead of skipping), each in its own process under a time limit:
#      parity with the CPU backend on the tiny fixtures (identical greedy
#      tokens), every op and the attention kernels against the CPU on random
#      inputs within their stated tolerances (latent attention's 576-wide
#      heads too), CUDA graphs against eager
#      decoding, device sampling, verification, tier copies and a load-back
#      read by the forward that loads it, LoRA, the
#      tensor-core GEMMs of FP8/INT4/NVFP4 weights (and W8A8) against the CPU, tensor
#      parallelism (two ranks on the one device, host-staged collectives: the
#      check that would let `--tp-size` run on cuda), and the NVRTC compile
#      test;
#   4. serves tiny-llama with `arbor serve --device cuda` and with the CPU,
#      checks that 16 concurrent greedy completions are identical, and runs
#      `arbor bench serving` at 64 concurrent requests against the GPU server
#      (scripts/gpu_serve_check.py);
#   5. runs the benchmark (decode tok/s at batch 1, 8, 64, 256 and prefill of
#      2,048 tokens on a Llama-3.1-8B-shaped model with random bf16 weights
#      made on the GPU) and prints its table, with the share of the HBM
#      roofline reached at batch 1; then 8 of its layers with FP8 weights
#      (`--quant fp8`, quantized at load), with W8A8 FP8 (`--quant
#      w8a8_fp8`: E4M3 inputs on FP8 tensor cores, sm_89+), as AutoAWQ INT4
#      and ModelOpt NVFP4 checkpoints (`--quant awq`, `--quant nvfp4`) and in
#      bf16, the quantized runs also timing their linears through the
#      dequantizing GEMM against the tensor-core GEMM (prefill, and decode
#      at batch 1 alternated); and a
#      HiCache load-back (4,096 tokens of KV from host memory, 128 computed
#      on them) with the loads on the copy stream, layer by layer, in place
#      from pinned pages and through staging, against the loads written
#      before the forward (alternated).
#      Then 8 layers of DeepSeek-V2-Lite's latent attention (576-wide heads:
#      the d576 decode and prefill kernels; `--model deepseek-v2-lite`).
#
# Usage:
#   scripts/gpu-check.sh                   build here with cargo, then run
#   scripts/gpu-check.sh --build-only DIR  build and copy the test and benchmark
#                                          executables and arbor (xz) to DIR
#                                          (no GPU needed)
#   scripts/gpu-check.sh --rocm            AMD GPU path (ARBOR_REQUIRE_ROCM=1): build
#                                          with --features rocm, `arbor info` must
#                                          open the device, the hiprtc compile test
#                                          for the device's arch, and the device
#                                          suite shared with CUDA and wgpu (tests/gpu)
#   scripts/gpu-check.sh --prebuilt DIR    run executables from DIR (a machine
#                                          without cargo or crates.io)
#   scripts/gpu-check.sh --env             print the `export LD_LIBRARY_PATH=...`
#                                          line that finds the CUDA libraries
#                                          (for scripts/gpu-profile.sh)
# Environment: CARGO_TARGET_DIR (default target-cuda), ARBOR_CUDA_LIB_DIRS
# (extra folders holding libcublas.so.12 / libnvrtc.so.12, or the .so.13 of
# CUDA 13), BENCH_ARGS (extra arguments for the benchmark, such as
# "--layers 4"), GPU_CHECK_LOGS (folder for the logs; default
# CARGO_TARGET_DIR), TEST_TIMEOUT and BENCH_TIMEOUT (seconds per test
# process and for the benchmark; 180 and 300).
set -euo pipefail

MODE=run
DIR=""
case "${1:-}" in
  "") ;;
  --build-only) MODE=build-only; DIR="${2:?--build-only needs a folder}" ;;
  --prebuilt) MODE=prebuilt; DIR="${2:?--prebuilt needs a folder}" ;;
  --rocm) MODE=rocm ;;
  --env) MODE=env ;;
  -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
  *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target-cuda}"
START=$(date +%s)
step() { echo; echo "== [$(( $(date +%s) - START ))s] $*"; }
die() { echo; echo "gpu-check: FAILED: $*" >&2; exit 1; }
trap 'echo "gpu-check: FAILED at line $LINENO (exit $?)" >&2' ERR

if [ "$MODE" = rocm ]; then
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR%-cuda}-rocm"
  step "ROCm: versions"
  command -v rocminfo >/dev/null && rocminfo | grep -E "Marketing Name|Name: +gfx" | head -8 || echo "rocminfo not found"
  rustc --version
  step "ROCm: build arbor --features rocm"
  cargo build --release -p arbor --features rocm
  step "ROCm: arbor info must open the device"
  "$CARGO_TARGET_DIR/release/arbor" info | tee /tmp/gpu-check-rocm-info.txt
  grep -q "^  rocm: .*gfx" /tmp/gpu-check-rocm-info.txt || die "arbor info did not open a ROCm device"
  ARCH="$(grep -o 'gfx[0-9a-f]*' /tmp/gpu-check-rocm-info.txt | head -1)"
  step "ROCm: hiprtc compile test for $ARCH, and the device suite (crates/backend-gpu/tests/suite)"
  ARBOR_REQUIRE_ROCM=1 ARBOR_REQUIRE_HIPRTC=1 ARBOR_HIPRTC_ARCHES="$ARCH" \
    cargo test --release -p arbor-backend-rocm -- --nocapture
  step "ROCm: done"
  exit 0
fi

# Folders that may hold the CUDA libraries.
lib_dirs() {
  local d
  for d in ${ARBOR_CUDA_LIB_DIRS:-} ${CUDA_HOME:+$CUDA_HOME/lib64} \
    /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    /usr/local/cuda-*/lib64 /usr/local/cuda-*/targets/x86_64-linux/lib \
    /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib; do
    [ -d "$d" ] && echo "$d"
  done
  if command -v python3 >/dev/null; then
    python3 - <<'PY' 2>/dev/null || true
import glob, site, sys
roots = list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path
for r in roots:
    for d in glob.glob(r + "/nvidia/*/lib"):
        print(d)
PY
  fi
}

# The folder holding the first file matching one of the names, if any.
find_lib() {
  local d n
  for d in $(lib_dirs); do
    for n in "$@"; do
      if compgen -G "$d/$n" >/dev/null; then echo "$d"; return 0; fi
    done
  done
  for n in "$@"; do
    d="$(ldconfig -p 2>/dev/null | awk -v n="$n" '$1 == n {print $NF; exit}')"
    if [ -n "$d" ]; then dirname "$d"; return 0; fi
  done
  return 1
}

add_lib_dir() {
  case ":${LD_LIBRARY_PATH:-}:" in
    *":$1:"*) ;;
    *) export LD_LIBRARY_PATH="$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
}

# cudarc (built against CUDA 12.8) opens `libcublas.so`, `libcublasLt.so`
# and `libnvrtc.so` unversioned before it tries `.so.12`, and never tries
# `.so.13`: a folder of unversioned links to the libraries found (CUDA 12 or
# 13, whose C APIs used here are the same) goes first on LD_LIBRARY_PATH.
find_cuda_libs() {
  step "CUDA libraries"
  local shim="${TMPDIR:-/tmp}/arbor-cuda-libs" name dir file
  rm -rf "$shim"; mkdir -p "$shim"
  for name in cublas cublasLt nvrtc; do
    dir="$(find_lib "lib$name.so.12" "lib$name.so.13" "lib$name.so")" || true
    [ -n "$dir" ] || die "lib$name.so.12 (or .13) not found (install the CUDA toolkit or pip's nvidia-cublas-cu12 and nvidia-cuda-nvrtc-cu12, or set ARBOR_CUDA_LIB_DIRS)"
    for file in "$dir/lib$name.so.12" "$dir/lib$name.so.13" "$dir/lib$name.so"; do
      [ -e "$file" ] && break
    done
    file="$(readlink -f "$file")"
    ln -sf "$file" "$shim/lib$name.so"
    add_lib_dir "$dir"
    printf '%-9s %s\n' "$name:" "$file"
  done
  add_lib_dir "$shim"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  # NCCL (the nccl tests of the GPU binary): optional, named by its soname.
  if [ -z "${ARBOR_NCCL_LIB:-}" ]; then
    dir="$(find_lib libnccl.so.2)" || true
    if [ -n "$dir" ]; then export ARBOR_NCCL_LIB="$dir"; fi
  fi
  echo "ARBOR_NCCL_LIB=${ARBOR_NCCL_LIB:-(not found: the nccl tests will report a skip)}"
}

versions() {
  step "versions"
  if [ "$MODE" != build-only ]; then
    command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this machine has no NVIDIA driver"
    nvidia-smi || die "nvidia-smi failed"
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv || true
  fi
  if command -v nvcc >/dev/null; then nvcc --version | tail -2; else echo "nvcc: absent (fine: kernels are compiled with NVRTC)"; fi
  if [ "$MODE" != prebuilt ]; then rustc -V; cargo -V; fi
  uname -srm
}

build() {
  step "build: arbor with --features cuda (release)"
  cargo build --release -p arbor --features cuda
  step "build: GPU tests and benchmark (release)"
  cargo test --release -p arbor-backend-cuda --no-run
  cargo build --release -p arbor-backend-cuda --example gpu_bench
}

# Path of the CUDA backend's test executable `name` (gpu, nvrtc_compile), as
# cargo reports it: other crates' test binaries share names (ROCm's `gpu`),
# so the newest file of that name in deps/ is not necessarily this one.
test_exe() {
  cargo test --release -p arbor-backend-cuda --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and t.get("name") == sys.argv[1] \
            and "arbor-backend-cuda" in m.get("package_id", "") + m.get("manifest_path", ""):
        print(m["executable"])
' "$1" | tail -1
}

export_bins() {
  step "copying executables to $DIR"
  mkdir -p "$DIR"
  local gpu nv
  gpu="$(test_exe gpu)"; nv="$(test_exe nvrtc_compile)"
  [ -x "$gpu" ] && [ -x "$nv" ] || die "test executables not found in $CARGO_TARGET_DIR/release/deps"
  cp "$gpu" "$DIR/gpu-tests"
  cp "$nv" "$DIR/nvrtc-compile"
  cp "$CARGO_TARGET_DIR/release/examples/gpu_bench" "$DIR/gpu_bench"
  cp "$CARGO_TARGET_DIR/release/arbor" "$DIR/arbor"
  strip "$DIR"/* 2>/dev/null || true
  # The server binary travels compressed (a device machine may take few MiB).
  xz -9f "$DIR/arbor"
  ls -la "$DIR"
  du -sh "$DIR"
}

run_checks() {
  local gpu nv bench arbor
  if [ "$MODE" = prebuilt ]; then
    gpu="$DIR/gpu-tests"; nv="$DIR/nvrtc-compile"; bench="$DIR/gpu_bench"; arbor=""
    if [ -f "$DIR/arbor.xz" ] && [ ! -x "$DIR/arbor" ]; then
      python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$DIR/arbor.xz" "$DIR/arbor"
      chmod +x "$DIR/arbor"
    fi
    [ -x "$DIR/arbor" ] && arbor="$DIR/arbor"
  else
    gpu="$(test_exe gpu)"; nv="$(test_exe nvrtc_compile)"
    bench="$CARGO_TARGET_DIR/release/examples/gpu_bench"
    arbor="$CARGO_TARGET_DIR/release/arbor"
  fi
  for f in "$gpu" "$nv" "$bench"; do [ -x "$f" ] || die "missing executable $f"; done
  export ARBOR_REQUIRE_CUDA=1 ARBOR_REQUIRE_NVRTC=1
  export ARBOR_FIXTURES="$ROOT/tests/fixtures"
  export ARBOR_CUDA_CACHE="${ARBOR_CUDA_CACHE:-$CARGO_TARGET_DIR/cuda-kernel-cache}"
  export RUST_BACKTRACE=1
  local logs="${GPU_CHECK_LOGS:-$CARGO_TARGET_DIR}" failed=0 name rc passed=0 n=0
  mkdir -p "$logs"
  if [ -n "$arbor" ]; then
    step "arbor info (the cuda backend must open the device)"
    "$arbor" info | tee "$logs/gpu-check-info.txt"
    grep -q "cuda: unavailable" "$logs/gpu-check-info.txt" && die "arbor info could not open the CUDA device"
  fi
  step "NVRTC: every kernel for sm_80 and sm_90"
  rc=0; timeout "${TEST_TIMEOUT:-180}" "$nv" --nocapture >"$logs/gpu-check-nvrtc.txt" 2>&1 || rc=$?
  cat "$logs/gpu-check-nvrtc.txt"
  [ "$rc" = 0 ] || { echo "NVRTC test FAILED (exit $rc)"; failed=$((failed + 1)); }
  step "GPU tests (parity, ops, attention, graphs, sampling), each in its own process"
  # One process per test, one at a time: a fault that poisons a CUDA context
  # (an illegal address, a hang stopped by the time limit) fails that test
  # alone and the rest still report.
  : >"$logs/gpu-check-tests.txt"
  for name in $("$gpu" --list --format terse 2>/dev/null | sed -n 's/: test$//p'); do
    n=$((n + 1)); rc=0
    echo "--- $name" >>"$logs/gpu-check-tests.txt"
    timeout "${TEST_TIMEOUT:-180}" "$gpu" --exact "$name" --test-threads=1 --nocapture \
      >>"$logs/gpu-check-tests.txt" 2>&1 || rc=$?
    if [ "$rc" = 0 ] && tail -40 "$logs/gpu-check-tests.txt" | grep -q "skipped:"; then rc=skip; fi
    if [ "$rc" = 0 ]; then
      passed=$((passed + 1)); echo "ok      $name"
    else
      failed=$((failed + 1)); echo "FAILED  $name (exit $rc)"
      echo "--- $name FAILED (exit $rc)" >>"$logs/gpu-check-tests.txt"
    fi
  done
  echo "GPU tests: $passed of $n passed"
  [ "$n" -gt 0 ] || { echo "no GPU tests were listed"; failed=$((failed + 1)); }
  if [ -n "$arbor" ]; then
    step "serve: tiny-llama over HTTP on cuda against the cpu, and arbor bench serving"
    rc=0
    timeout "${BENCH_TIMEOUT:-300}" python3 "$ROOT/scripts/gpu_serve_check.py" "$arbor" \
      "$ROOT/tests/fixtures/tiny-llama" cuda >"$logs/gpu-check-serve.txt" 2>&1 || rc=$?
    cat "$logs/gpu-check-serve.txt"
    [ "$rc" = 0 ] || { echo "serve check FAILED (exit $rc)"; failed=$((failed + 1)); }
  fi
  step "benchmark: Llama-3.1-8B shape, random bf16 weights on the GPU"
  rc=0
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-300}" "$bench" ${BENCH_ARGS:-} >"$logs/gpu-check-bench.txt" 2>&1 || rc=$?
  cat "$logs/gpu-check-bench.txt"
  [ "$rc" = 0 ] || { echo "benchmark FAILED (exit $rc)"; failed=$((failed + 1)); }
  step "benchmark: FP8 and W8A8 FP8 (quantized at load), AWQ INT4 and NVFP4 (checkpoint formats) weights (tensor-core GEMM against the dequantizing one) against bf16, 8 layers"
  rc=0
  : >"$logs/gpu-check-bench-quant.txt"
  for q in fp8 w8a8_fp8 awq nvfp4 auto; do
    timeout "${BENCH_TIMEOUT:-300}" "$bench" --layers 8 --batches 1,64 --steps 16 --prefill 2048 \
      --quant "$q" >>"$logs/gpu-check-bench-quant.txt" 2>&1 || rc=$?
  done
  awk '/== arbor CUDA benchmark ==/{p=1} /^loaded /{p=0} p' "$logs/gpu-check-bench-quant.txt"
  [ "$rc" = 0 ] || { echo "quantized benchmark FAILED (exit $rc)"; failed=$((failed + 1)); }
  step "benchmark: DeepSeek-V2-Lite latent attention (576-wide heads, 16 query heads on one), 8 layers"
  rc=0
  timeout "${BENCH_TIMEOUT:-300}" "$bench" --model deepseek-v2-lite --layers 8 --batches 1,64 \
    --steps 16 --prefill 2048 --load-back 0 >"$logs/gpu-check-bench-mla.txt" 2>&1 || rc=$?
  sed -n '/== arbor CUDA benchmark ==/,$p' "$logs/gpu-check-bench-mla.txt"
  [ "$rc" = 0 ] || { echo "latent-attention benchmark FAILED (exit $rc)"; failed=$((failed + 1)); }
  step "summary"
  grep -E "^(test result|---.*FAILED)|panicked" "$logs/gpu-check-tests.txt" "$logs/gpu-check-nvrtc.txt" || true
  sed -n '/== arbor CUDA benchmark ==/,$p' "$logs/gpu-check-bench.txt"
  echo
  [ "$failed" = 0 ] || die "$failed check(s) failed (logs in $logs)"
  echo "gpu-check: OK in $(( $(date +%s) - START )) s"
}

if [ "$MODE" = env ]; then
  find_cuda_libs >&2
  echo "export LD_LIBRARY_PATH='$LD_LIBRARY_PATH'"
  exit 0
fi

versions
case "$MODE" in
  build-only)
    build
    export_bins
    ;;
  prebuilt)
    find_cuda_libs
    run_checks
    ;;
  run)
    find_cuda_libs
    build
    run_checks
    ;;
esac
