#!/usr/bin/env bash
# Batch-1 decode and 512-token prefill of the default model's architecture in each weight format,
# side by side: the formats alternate within each round (A B C ... A B C ...), so a noisy machine
# affects them alike. Folders come from tools/reference/make_default_quant.py (default
# /tmp/arbor-quant); the GGUF Q4_1 is the default model itself.
#
#   scripts/bench-quant.sh [QUANT_DIR] [ROUNDS]
#
# MATMULS="f32 amx-bf16" runs each HF-quantized format under each --cpu-quant-matmul (labelled
# format/matmul; default f32 only); BATCH=8 measures decode at that batch size (default 1).
# Prints one line per run and a median summary per format (tokens/s).
set -euo pipefail
dir=${1:-/tmp/arbor-quant}
rounds=${2:-2}
arbor=${ARBOR_BIN:-target/release/arbor}
gguf=${ARBOR_DEFAULT_GGUF:-$HOME/.cache/arbor/models/SmolLM2-135M-Instruct.Q4_1.gguf}
threads=${THREADS:-2}
batch=${BATCH:-1}
read -r -a matmuls <<<"${MATMULS:-f32}"
# w8a8: the fp8-dynamic folder served with --quantization w8a8_fp8 (inputs rounded to E4M3 per
# 32); w8a8-static: the fp8-static folder so served (inputs rounded with its static scales).
# FORMATS="..." picks some of them.
read -r -a formats <<<"${FORMATS:-bf16 fp8-block fp8-dynamic w8a8 fp8-static w8a8-static awq gptq w4a16 nvfp4 gguf-q4_1}"
out=$(mktemp)
for r in $(seq "$rounds"); do
  for f in "${formats[@]}"; do
    extra=()
    case $f in
      gguf-q4_1) path=$gguf ;;
      w8a8) path=$dir/fp8-dynamic extra=(--quantization w8a8_fp8) ;;
      w8a8-static) path=$dir/fp8-static extra=(--quantization w8a8_fp8) ;;
      *) path=$dir/$f ;;
    esac
    [ -e "$path" ] || { echo "skip $f: $path is absent"; continue; }
    # bf16 and GGUF weights multiply the same way under every --cpu-quant-matmul.
    runs=("${matmuls[@]}")
    # So do W8A8 FP8 weights: their inputs are rounded to E4M3 either way.
    case $f in bf16 | gguf-q4_1 | w8a8 | w8a8-static) runs=(f32) ;; esac
    for mm in "${runs[@]}"; do
      label=$f
      [ ${#runs[@]} -gt 1 ] && label=$f/$mm
      log=$("$arbor" bench one-batch --model-path "$path" --threads "$threads" \
        --batch-size "$batch" --input-len 512 --output-len 65 --kv-cache-dtype auto \
        --cpu-quant-matmul "$mm" "${extra[@]}" 2>&1)
      pre=$(grep '^Prefill' <<<"$log" | tail -1 | sed -E 's/.*throughput: *([0-9.]+).*/\1/')
      dec=$(grep '^Decode\.  median' <<<"$log" | tail -1 | sed -E 's/.*throughput: *([0-9.]+).*/\1/')
      echo "round $r $label prefill512 $pre tok/s decode-b$batch $dec tok/s"
      echo "$label $pre $dec" >>"$out"
    done
  done
done
echo "median over $rounds rounds (tok/s): format prefill512 decode-b$batch"
python3 - "$out" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    f, p, d = line.split()
    rows.setdefault(f, []).append((float(p), float(d)))
base = rows.get("bf16")
for f, v in rows.items():
    p = statistics.median(x[0] for x in v)
    d = statistics.median(x[1] for x in v)
    rel = ""
    if base:
        bp = statistics.median(x[0] for x in base)
        bd = statistics.median(x[1] for x in base)
        rel = f"  ({p / bp:.2f}x, {d / bd:.2f}x bf16)"
    print(f"{f:12} {p:9.1f} {d:8.1f}{rel}")
EOF
rm -f "$out"
