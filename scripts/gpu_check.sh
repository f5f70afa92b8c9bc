#!/usr/bin/env bash
# Check the `gpu` profile on a CUDA machine (issue 22), in under 8 minutes; docs/operations.md, "On a GPU".
#
#   scripts/gpu_check.sh              # on the GPU machine: writes ${OUT:-gpu-check-out}/
#   scripts/gpu_check.sh --dry-run    # anywhere, ~30 s: prints the steps, runs the CPU-cheap parts only
#
# Steps:
#   1. decode-agreement: the gpu profile's drafter on CUDA bf16 vs CPU float32, 4 prompts x 16 greedy tokens,
#      one by one and batched: token agreement and max logit difference (duplex.bench.gpu_check)
#   2. load-bench: duplex bench --serve --profile gpu --sessions 1,8,32,64 --turns 3 --barge-ins 1
#      (target on an H100: 32 sessions with onset P90 <= 300 ms)
#   3. capacity: duplex.bench.gpu_capacity --sessions 1,8,32,64: both LLMs' batched prefill/decode, the flow
#      voice's batched chunks, and the device's part of the onset when N turns end at once (+ CUDA vs CPU)
# Steps 1 and 2 need the profile's LLM weights (and NeMo for 2); where they are not installed (a machine that
# only gets this repository), they are skipped with a note and step 3 runs the LLMs' architectures with
# random weights (same compute per token; duplex/bench/data/llm_architectures.json).
# Environment: PYTHON (default: /opt/torch/.venv/bin/python3 if present, else .venv/bin/python, else python3),
# OUT (default gpu-check-out), SESSIONS (default 1,8,32,64).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/python.sh
PYTHON="$PY"
OUT="${OUT:-gpu-check-out}"
SESSIONS="${SESSIONS:-1,8,32,64}"
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (use --dry-run or nothing)" >&2; exit 2 ;;
  esac
done

AGREE=("$PYTHON" -m duplex.bench.gpu_check --profile gpu --device cuda --dtype bfloat16 --prompts 4 --tokens 16
       --out "$OUT/decode-agreement.json")
LOAD=("$PYTHON" -m duplex.cli bench --serve --profile gpu --sessions 1,8,32,64 --turns 3 --barge-ins 1
      --out "$OUT/load")
CAPACITY=("$PYTHON" -m duplex.bench.gpu_capacity --device cuda --dtype bfloat16 --sessions "$SESSIONS"
          --llm-variants pool per_session padded --tts-front cpu device
          --out "$OUT/capacity")

step() { echo "== step $1: $2"; }

has_cuda() {
  command -v nvidia-smi >/dev/null 2>&1 && "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
}

# 0 when the gpu profile's LLM weights are installed here
has_llm_weights() {
  "$PYTHON" - <<'PY' 2>/dev/null
import sys
from dialogue import llm_weights
from duplex.base.config import load_profile
p = load_profile("gpu")
sys.exit(0 if all(llm_weights.status(p.component(c).weights).ok for c in ("llm", "drafter")) else 1)
PY
}

has_nemo() {
  "$PYTHON" -c 'import nemo.collections.asr' >/dev/null 2>&1
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
  step 3 "capacity: ${CAPACITY[*]}"
  # tiny random LLMs, the shipped voice with the recorded phonemes (what a bare GPU machine uses)
  OMP_NUM_THREADS=1 "$PYTHON" -m duplex.bench.gpu_capacity --device cpu --dtype float32 --sessions 1,2 --tiny \
    --decode-tokens 2 --repeats 1 --threads 1 --front-end table --llm-variants pool per_session padded \
    --tts-front cpu device --out "$OUT/capacity-cpu" >/dev/null
  echo "   cpu stand-in ok: $OUT/capacity-cpu/capacity.json"
  echo "dry run done"
  exit 0
fi

if ! has_cuda; then
  echo "no CUDA here (nvidia-smi or torch.cuda missing): run with --dry-run, or use --profile cpu" >&2
  exit 3
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
status=0

if has_llm_weights; then
  step 1 "decode-agreement"
  timeout 180 "${AGREE[@]}" || status=1
  if has_nemo; then
    step 2 "load-bench"
    timeout 300 "${LOAD[@]}" || status=1
  else
    step 2 "load-bench: skipped (NeMo is not installed: the gpu profile's ASR needs it)"
  fi
else
  step 1 "decode-agreement: skipped (the gpu profile's LLM weights are not installed here)"
  step 2 "load-bench: skipped (the same)"
fi

step 3 "capacity"
timeout 420 "${CAPACITY[@]}" || status=1

echo "done: $OUT/ (exit $status)"
exit $status
