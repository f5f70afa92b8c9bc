#!/usr/bin/env bash
# Train the flow voice (tts/) on a GPU for a fixed number of minutes, starting from the shipped weights
# (tts/weights) or resuming $RUN, and write the fp16 export to $OUT/tts-weights; then, with
# --decoder-minutes N, train the codec's decoder further with its encoder frozen (tts.training.tune_decoder;
# DEC_FLOW_SHARE > 0 also feeds it that flow's latents, which hurt on the CPU A/B; DEC_SPECTRAL W adds the
# loss on the vocoder's output, docs/codec.md) and write $OUT/codec-weights. docs/tts.md, "GPU path".
#
#   scripts/gpu_train_flow.sh --minutes 6 --decoder-minutes 2   # on the GPU machine
#   scripts/gpu_train_flow.sh --dry-run        # anywhere, ~1 min: a few steps of each on a tiny pool, export
#   scripts/gpu_train_flow.sh --minutes 6 --layers 8 --enc-layers 5   # a deeper flow grown from $INIT (--grow)
#
# Environment: PYTHON (default: /opt/torch/.venv/bin/python3 if present, else .venv/bin/python, else
# python3), OUT (default gpu-out), RUN (default runs/gpu-flow), DEC_RUN (default runs/gpu-decoder),
# DEC_FLOW_SHARE (default 0), DEC_SPECTRAL (default 0; 6 is the CPU run's weight), INIT (default tts/weights).
# The teacher (hibari) runs on the CPU: with many cores, a larger --pool and --refresh keep the GPU fed.
set -euo pipefail
cd "$(dirname "$0")/.."

MINUTES=8
DEC_MINUTES=0
MODE=train
GROW=()
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) MINUTES="$2"; shift 2 ;;
    --decoder-minutes) DEC_MINUTES="$2"; shift 2 ;;
    --dry-run) MODE=dry; shift ;;
    --layers|--enc-layers) GROW+=("$1" "$2"); shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

source scripts/python.sh
OUT="${OUT:-gpu-out}"
RUN="${RUN:-runs/gpu-flow}"
DEC_RUN="${DEC_RUN:-runs/gpu-decoder}"
INIT="${INIT:-tts/weights}"
CODEC=codec/weights/speech_codec.safetensors

DEVICE=cpu
if "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then DEVICE=cuda; fi

ARGS=(--run "$RUN" --device "$DEVICE" --codec "$CODEC" --lr 5e-4 --lr-halflife 8000 --fragments 0.3)
if [ "$MODE" = dry ]; then
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
  RUN="$TMP/flow"
  DEC_RUN="$TMP/decoder"
  ARGS=(--run "$RUN" --device "$DEVICE" --codec "$CODEC" --minutes 0.05 --pool 8 --batch 2 --norm-examples 4
        --gate-n 1 --gate-minutes 999 --threads 1)
  DEC_MINUTES=0.05
  DEC_ARGS=(--pool 4 --batch 2 --gate-minutes 999 --threads 1)
  DEC_SPECTRAL="${DEC_SPECTRAL:-1}"  # the dry run exercises the spectral loss too
else
  CPUS="$(nproc)"
  ARGS+=(--minutes "$MINUTES" --threads 4 --batch 64 --pool 4000 --refresh 4 --gate-minutes 5 --ckpt-minutes 4)
  DEC_ARGS=(--threads 4 --batch 64 --pool 4000 --refresh 4 --gate-minutes 5 --ckpt-minutes 4)
  echo "training on $DEVICE for $MINUTES min ($CPUS CPUs, $PY)"
fi
if [ ! -e "$RUN/checkpoint.pt" ] && [ -f "$INIT/flow_model.json" ]; then
  if [ ${#GROW[@]} -gt 0 ]; then ARGS+=(--grow "$INIT" "${GROW[@]}"); else ARGS+=(--init "$INIT"); fi
fi
mkdir -p "$OUT"
"$PY" -m tts.training.train_flow "${ARGS[@]}" 2>&1 | tee "$OUT/train-flow.log"
"$PY" -m tts.training.train_flow --run "$RUN" --export "$OUT/tts-weights" --codec-file "$CODEC"
cp "$RUN/metrics.jsonl" "$RUN/curves.png" "$OUT/tts-weights/" 2>/dev/null || true
echo "wrote $OUT/tts-weights (fp16 flow_model.safetensors + flow_model.json) and $OUT/train-flow.log"
if [ "$DEC_MINUTES" != 0 ]; then
  # the encoder (the flow's target) stays bit for bit; the flow's export is checked against its latent
  DEC_ARGS+=(--run "$DEC_RUN" --device "$DEVICE" --minutes "$DEC_MINUTES" --flow "$OUT/tts-weights"
             --flow-share "${DEC_FLOW_SHARE:-0}" --spectral "${DEC_SPECTRAL:-0}" --lr 5e-4 --lr-halflife 6000)
  [ -e "$DEC_RUN/checkpoint.pt" ] || DEC_ARGS+=(--init "$CODEC")
  "$PY" -m tts.training.tune_decoder "${DEC_ARGS[@]}" 2>&1 | tee "$OUT/tune-decoder.log"
  "$PY" -m tts.training.tune_decoder --run "$DEC_RUN" --export "$OUT/codec-weights"
  echo "wrote $OUT/codec-weights (copy it over codec/weights: the flow's codec_latent_sha256 still matches)"
fi
