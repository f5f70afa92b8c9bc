#!/usr/bin/env bash
# Check the `gpu` profile on a CUDA machine (issue 22), in under 8 minutes; docs/operations.md, "On a GPU".
#
#   scripts/gpu_check.sh              # on the GPU machine: writes ${OUT:-gpu-check-out}/
#   scripts/gpu_check.sh --dry-run    # anywhere, ~15 s: prints the steps, runs the CPU-cheap parts only
#
# Steps:
#   1. decode-agreement: the gpu profile's drafter on CUDA bf16 vs CPU float32, 4 prompts x 16 greedy tokens,
#      one by one and batched: token agreement and max logit difference (duplex.bench.gpu_check)
#   2. load-bench: duplex bench --serve --profile gpu --sessions 1,8,32,64 --turns 3 --barge-ins 1
#      (target on an H100: 32 sessions with onset P90 <= 300 ms)
# Environment: PYTHON (default .venv/bin/python), OUT (default gpu-check-out).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-gpu-check-out}"
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (use --dry-run or nothing)" >&2; exit 2 ;;
  esac
done

AGREE=("$PYTHON" -m duplex.bench.gpu_check --profile gpu --device cuda --dtype bfloat16 --prompts 4 --tokens 16
       --out "$OUT/decode-agreement.json")
LOAD=("$PYTHON" -m duplex.cli bench --serve --profile gpu --sessions 1,8,32,64 --turns 3 --barge-ins 1
      --out "$OUT/load")

step() { echo "== step $1: $2"; }

has_cuda() {
  command -v nvidia-smi >/dev/null 2>&1 && "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
}

mkdir -p "$OUT"
if [ "$DRY" = 1 ]; then
  echo "dry run: the GPU steps are printed, not run; CPU-cheap stand-ins run instead (OUT=$OUT)"
  step 1 "decode-agreement: ${AGREE[*]}"
  # the same check on the CPU (bf16 vs float32, smaller): exercises loading, the device option and the report
  OMP_NUM_THREADS=1 "$PYTHON" -m duplex.bench.gpu_check --profile gpu --device cpu --dtype bfloat16 \
    --prompts 2 --tokens 4 --threads 1 --out "$OUT/decode-agreement-cpu.json" >/dev/null
  echo "   cpu stand-in ok: $OUT/decode-agreement-cpu.json"
  step 2 "load-bench: ${LOAD[*]}"
  "$PYTHON" -m duplex.cli bench --help >/dev/null  # argument validation only: the real run needs the GPU
  echo "   arguments ok (not run)"
  echo "dry run done"
  exit 0
fi

if ! has_cuda; then
  echo "no CUDA here (nvidia-smi or torch.cuda missing): run with --dry-run, or use --profile cpu" >&2
  exit 3
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

step 1 "decode-agreement"
timeout 180 "${AGREE[@]}"

step 2 "load-bench"
timeout 300 "${LOAD[@]}"

echo "done: $OUT/decode-agreement.json, $OUT/load/"
