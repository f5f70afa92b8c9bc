#!/usr/bin/env bash
# Train the streaming ASR on a GPU for a fixed number of minutes, resuming the shipped checkpoint, and
# write fp16 weights (the average of the last checkpoints) to $OUT. docs/asr.md, "GPU path".
#
#   scripts/gpu_train_asr.sh --minutes 8                 # on the GPU machine (writes $OUT/fc_small.nemo)
#   scripts/gpu_train_asr.sh --dry-run                   # anywhere, a few seconds: tiny model, 3 steps, export
#   scripts/gpu_train_asr.sh --check                     # which imports are missing, then exit
#   scripts/gpu_train_asr.sh --minutes 7 -- --total 13800  # options after -- go to train_streaming
#
# Environment: PYTHON (default: /opt/torch/.venv/bin/python3 if present, else .venv/bin/python, else
# python3), OUT (default ${OUT:-gpu-out}), RUN (default runs/gpu-asr), INIT (default
# asr/weights/fc_small.nemo; an export of a recipe-2 run goes on with its recipe's schedule), EVERY
# (checkpoint every N steps, default 500), WHEELS (a folder of py3.12 wheels installed offline first if
# NeMo is missing; default .whl, else shared/wheels/py312: docs/asr.md "GPU path" lists them).
set -euo pipefail
cd "$(dirname "$0")/.."

MINUTES=8
WORKERS=""
BATCH=""
MODE=train
PASS=()  # after --: passed to asr.training.train_streaming (e.g. -- --total 13800 --peak-lr 8e-4)
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) MINUTES="$2"; shift 2 ;;
    --workers) WORKERS="$2"; shift 2 ;;
    --batch-size) BATCH="$2"; shift 2 ;;
    --dry-run) MODE=dry; shift ;;
    --check) MODE=check; shift ;;
    --) shift; PASS=("$@"); break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

source scripts/python.sh
export PYTHONUNBUFFERED=1
OUT="${OUT:-gpu-out}"
RUN="${RUN:-runs/gpu-asr}"
INIT="${INIT:-asr/weights/fc_small.nemo}"
WHEELS="${WHEELS:-$([ -d .whl ] && echo .whl || echo shared/wheels/py312)}"
EVERY="${EVERY:-500}"
# training text where Debian's wordnet-base / fortunes are missing: written here by
# `python -m asr.training.speakers --write-text runs/asr-text.txt.gz` (1.1 MB) and carried
if [ -z "${DUPLEX_ASR_TEXT:-}" ] && [ ! -d /usr/share/wordnet ] && [ -f runs/asr-text.txt.gz ]; then
  export DUPLEX_ASR_TEXT=runs/asr-text.txt.gz
fi
# Debian's flite where the image has none: the archive `scripts/gpu_carry_asr.sh flite` makes
if ! command -v flite >/dev/null && [ -f runs/flite.tar.xz ]; then
  mkdir -p "${TMPDIR:-/tmp}/carried" && tar -xJf runs/flite.tar.xz -C "${TMPDIR:-/tmp}/carried"
  export PATH="${TMPDIR:-/tmp}/carried/flite/bin:$PATH"
fi
# the panel needs flite and Kokoro to synthesise its natural sets: score it on the GPU only when its
# cache travels (DUPLEX_ASR_PANEL_CACHE), else score the export here with `duplex eval asr --panel`
PANEL_N="${PANEL_N:-$([ -n "${DUPLEX_ASR_PANEL_CACHE:-}" ] && echo 60 || echo 0)}"

missing() {
  "$PY" - <<'PY'
import importlib.util
need = ["nemo.collections.asr", "sentencepiece", "soxr", "soundfile", "hibari", "espeakng_loader", "omegaconf"]
miss = []
for name in need:
    try:
        ok = importlib.util.find_spec(name) is not None
        if ok and name == "nemo.collections.asr":
            import nemo.collections.asr  # noqa: F401  (torchaudio, if present, must not break it)
    except Exception:
        ok = False
    if not ok:
        miss.append(name)
print(" ".join(miss))
PY
}

MISSING="$(missing)"
if [ -n "$MISSING" ] && [ -d "$WHEELS" ]; then
  echo "installing carried wheels from $WHEELS for: $MISSING"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --find-links "$WHEELS" "$WHEELS"/*.whl
  MISSING="$(missing)"
fi
if [ "$MODE" = check ] || { [ -n "$MISSING" ] && [ "$MODE" != check ]; }; then
  echo "python: $PY; missing: ${MISSING:-nothing}"
  [ -z "$MISSING" ] && exit 0
  echo "see docs/asr.md (GPU path) for the wheels to carry" >&2
  exit 2
fi

DEVICE=cpu
if "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then DEVICE=cuda; fi
CPUS="$(nproc)"
WORKERS="${WORKERS:-$(( CPUS > 2 ? CPUS - 2 : 1 ))}"

if [ "$MODE" = dry ]; then
  exec "$PY" -m asr.training.train_streaming --dry-run --device "$DEVICE"
fi

mkdir -p "$OUT"
ARGS=(--run "$RUN" --device "$DEVICE" --minutes "$MINUTES" --workers "$WORKERS" --pool $(( WORKERS * 256 ))
      --threads 4 --every "$EVERY" --panel-n "$PANEL_N")
[ -n "$BATCH" ] && ARGS+=(--batch-size "$BATCH")
ARGS+=(${PASS[@]+"${PASS[@]}"})
[ -e "$RUN/last.pt" ] || ARGS+=(--init "$INIT")
echo "training on $DEVICE for $MINUTES min with $WORKERS data workers ($PY)"
"$PY" -m asr.training.train_streaming "${ARGS[@]}" 2>&1 | grep -v "NeMo W" | tee "$OUT/train.log"
"$PY" -m asr.training.train_streaming --run "$RUN" --export "$OUT/fc_small.nemo" --average 5 --fp16
cp "$RUN/run.json" "$OUT/run.json"
echo "wrote $OUT/fc_small.nemo (fp16) and $OUT/train.log"
