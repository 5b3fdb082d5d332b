#!/usr/bin/env bash
# Kernel-time profile of the CUDA backend with Nsight Compute (ncu), for a
# machine with an NVIDIA GPU and ncu (about a minute on an H200):
#   1. each kernel's share of GPU time in three phases of gpu_bench on two
#      layers of the Llama-3.1-8B shape: a 2,048-token prefill, decode at
#      batch 1 and decode at batch 256 (context 512) -- one metric
#      (gpu__time_duration.sum), clocks left alone;
#   2. ncu's speed-of-light, occupancy, warp-state and memory sections of one
#      launch each of the decode and the tensor-core prefill attention kernels.
# The first launches of each phase (weight fill, warm-up) are included in its
# table, and the prefill phase runs gpu_bench's A/B: the tensor-core attention
# kernel, then the f32 one. Kernels are named as launched (cuBLAS's GEMMs as
# nvjet_* / sm90_*).
#
# Usage: scripts/gpu-profile.sh DIR   DIR holds gpu_bench, as
#                                     `scripts/gpu-check.sh --build-only DIR`
#                                     leaves it; the three kernel-time CSVs
#                                     and two ncu reports are written to
#                                     OUT_DIR (default DIR).
# Environment: NCU (default: ncu on PATH, else /usr/local/cuda/bin/ncu),
# ARBOR_CUDA_LIB_DIRS (as for gpu-check.sh), OUT_DIR.
set -euo pipefail

DIR="${1:?usage: scripts/gpu-profile.sh DIR (holding gpu_bench)}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT_DIR:-$DIR}"
BENCH="$DIR/gpu_bench"
[ -x "$BENCH" ] || { echo "gpu-profile: $BENCH is not an executable" >&2; exit 1; }
NCU="${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}"
[ -x "$NCU" ] || { echo "gpu-profile: ncu not found (set NCU)" >&2; exit 1; }
eval "$(bash "$ROOT/scripts/gpu-check.sh" --env)"
# The kernel cache and gpu_bench's own output stay out of OUT_DIR, which
# receives five reports (a device machine returns at most 8 files).
TMP="${TMPDIR:-/tmp}"
export ARBOR_CUDA_CACHE="${ARBOR_CUDA_CACHE:-$TMP/arbor-cuda-kernel-cache}"
mkdir -p "$OUT_DIR"

# Kernel shares of one phase: raw CSV (one row per launch) to a table.
shares() {
  python3 - "$1" <<'PY'
import collections, csv, sys
rows = [l for l in open(sys.argv[1]) if l.startswith('"')]
table = list(csv.reader(rows))
head, body = table[0], [r for r in table[1:] if r and r[0].isdigit()]
name, time = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
total, per = 0.0, collections.defaultdict(lambda: [0, 0.0])
for r in body:
    t = float(r[time].replace(",", ""))
    per[r[name][:70]][0] += 1
    per[r[name][:70]][1] += t
    total += t
print(f"{len(body)} launches, {total / 1e6:.2f} ms of GPU time")
for k, (n, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:12]:
    print(f"{100 * t / total:5.1f}%  {t / n / 1e3:9.1f} us x {n:4d}  {k}")
PY
}

for phase in "prefill:--batches none --prefill 2048" "decode-bs1:--batches 1 --steps 4 --prefill 0" \
  "decode-bs256:--batches 256 --steps 4 --prefill 0"; do
  name="${phase%%:*}"; args="${phase#*:}"
  echo "== $name (gpu_bench --layers 2 $args)"
  # shellcheck disable=SC2086
  "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    --log-file "$OUT_DIR/ncu-$name.csv" "$BENCH" --layers 2 $args >"$TMP/gpu-profile-$name.log" 2>&1
  shares "$OUT_DIR/ncu-$name.csv"
done

SECTIONS="--section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats"
for k in "decode_split_bf16_d128:--batches 256 --steps 2 --prefill 0" \
  "prefill_mma_bf16_d128:--batches none --prefill 2048"; do
  kernel="${k%%:*}"; args="${k#*:}"
  echo "== $kernel (one launch)"
  # shellcheck disable=SC2086
  "$NCU" --clock-control none -k "$kernel" --launch-skip 3 --launch-count 1 $SECTIONS \
    "$BENCH" --layers 2 $args >"$OUT_DIR/ncu-$kernel.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy|Warp Cycles Per Issued" \
    "$OUT_DIR/ncu-$kernel.txt" || true
done
echo "gpu-profile: reports in $OUT_DIR"
