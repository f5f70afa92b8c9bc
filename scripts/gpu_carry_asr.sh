#!/usr/bin/env bash
# Make what a lent GPU machine needs for scripts/gpu_train_asr.sh fit its 64 MiB carry. docs/asr.md, "GPU path".
#
#   scripts/gpu_carry_asr.sh wheels     # py3.12 wheels NeMo + the voices need there -> .whl (~39 MB), and the
#                                       # training text -> runs/asr-text.txt.gz (the image has no wordnet)
#   scripts/gpu_carry_asr.sh trim       # a temporary branch `gpu-carry` without what ASR training does not
#                                       # use (LLM adapter, codec, flow voice, dialogue data, results): ~17 MB
#   scripts/gpu_carry_asr.sh flite      # Debian's flite (binary + voice libraries, the held-out slt and the
#                                       # unused time_awb stubbed to kal) -> runs/flite.tar.xz (~9 MB)
#   scripts/gpu_carry_asr.sh size       # what would travel, against the 64 MiB limit
#   scripts/gpu_carry_asr.sh restore    # back to the branch you were on; deletes `gpu-carry`
#
# Then, on the GPU tool: carry [".whl", "runs/asr-text.txt.gz", "runs/flite.tar.xz"] and run
#   WHEELS=.whl bash scripts/gpu_train_asr.sh --minutes 7
# INIT=path.nemo (an export of the CPU run, e.g. `--export x.nemo --average 5 --fp16`) is copied over
# asr/weights/fc_small.nemo on the trimmed branch, so the GPU slice goes on from the newest weights.
set -euo pipefail
cd "$(dirname "$0")/.."

# what `import nemo.collections.asr` loads that the GPU image ('cuda', Python 3.12) lacks, plus the voices;
# lightning 2.4.0 replaces the image's newer one, whose Trainer.save_checkpoint signature NeMo's
# nv-one-logger rejects at import
WHEELS=(StrEnum==0.4.15 annotated-types==0.8.0 braceexpand==0.1.7 cffi==2.1.1 cytoolz==1.2.0 datasets==5.2.0
  dill==0.4.1 googleapis-common-protos==1.76.0 httpcore2==2.16.2 httpx2==2.16.2 hydra-core==1.3.2
  intervaltree==3.2.1 kaldialign==0.12.0 lhotse==1.33.0 librosa==0.11.0 multiprocess==0.70.19
  nemo-toolkit==3.0.0 nv-one-logger-core==2.3.1 nv-one-logger-pytorch-lightning-integration==2.3.1
  nv-one-logger-training-telemetry==2.3.1 omegaconf==2.3.0 overrides==7.7.0 pydantic==2.14.4
  pydantic_core==2.50.5 sniffio==1.3.1 soundfile==0.14.0 toml==0.10.2 truststore==0.10.5
  typing-inspection==0.4.5 webdataset==1.0.2 audioread==3.1.0 soxr==1.1.0 pooch==1.9.0 decorator==5.3.1
  pycparser==3.12 platformdirs==4.14.8 lightning==2.4.0 espeakng-loader==0.2.4 hibari-tts==0.2.1)
LIMIT=$((64 * 1024 * 1024))

size() {
  local tree carry
  tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  carry=$(du -cb .whl runs/asr-text.txt.gz runs/flite.tar.xz 2>/dev/null | tail -1 | cut -f1)
  echo "tracked files $((tree / 1000000)) MB + carried $((carry / 1000000)) MB = $(((tree + carry) / 1000000)) MB" \
    "of $((LIMIT / 1000000)) MB"
  [ $((tree + carry)) -le $LIMIT ] || { echo "too big: run '$0 trim' first" >&2; return 1; }
}

case "${1:-}" in
  wheels)
    grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
    mkdir -p .whl
    PY="${PYTHON:-python3}"
    for spec in "${WHEELS[@]}"; do
      "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$spec"
    done
    # antlr4 4.9.3 (omegaconf's pin) is published as a source archive only: build its pure-Python wheel
    "$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
    .venv/bin/python -m asr.training.speakers --write-text runs/asr-text.txt.gz
    size || true
    ;;
  flite)
    # The binary links every voice library; slt (held out for testing) and time_awb (never used) are
    # replaced by stubs that register kal, which keeps slt out of training and the archive ~9 MB. The
    # stubbed binary crashes at exit after writing its WAV, so a wrapper accepts a written output.
    command -v flite >/dev/null && command -v gcc >/dev/null || { echo "needs flite and gcc here" >&2; exit 1; }
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    mkdir -p "$tmp/flite/bin" "$tmp/flite/lib"
    cp "$(command -v flite)" "$tmp/flite/bin/flite.real"
    for lib in $(ldd "$(command -v flite)" | awk '/libflite|libasound/ {print $3}'); do
      cp -L "$lib" "$tmp/flite/lib/$(basename "$lib")"
    done
    for voice in cmu_us_slt cmu_time_awb; do
      printf 'void *register_cmu_us_kal(const char *d);\nvoid *register_%s(const char *d) { return register_cmu_us_kal(d); }\nvoid unregister_%s(void *v) {}\n' \
        "$voice" "$voice" > "$tmp/$voice.c"
      gcc -shared -fPIC -Wl,-soname,"libflite_$voice.so.1" -o "$tmp/flite/lib/libflite_$voice.so.1" "$tmp/$voice.c" \
        -L"$tmp/flite/lib" -l:libflite_cmu_us_kal.so.1
    done
    cat > "$tmp/flite/bin/flite" <<'SH'
#!/bin/sh
# carried flite (scripts/gpu_carry_asr.sh flite): succeed when the output WAV was written
d=$(dirname "$0"); out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
LD_LIBRARY_PATH="$d/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$d/flite.real" "$@" 2>/dev/null
rc=$?
[ $rc -ne 0 ] && [ -n "$out" ] && [ -s "$out" ] && exit 0
exit $rc
SH
    chmod +x "$tmp/flite/bin/flite"
    "$tmp/flite/bin/flite" -voice rms -t "carried flite" -o "$tmp/check.wav"
    out="${FLITE_OUT:-runs/flite.tar.xz}"
    mkdir -p "$(dirname "$out")" && tar -C "$tmp" -cJf "$out" flite
    echo "wrote $out ($(du -h "$out" | cut -f1)); gpu_train_asr.sh unpacks runs/flite.tar.xz where flite is missing"
    ;;
  trim)
    [ -z "$(git status --porcelain --untracked-files=no)" ] || { echo "commit or stash your changes first" >&2; exit 1; }
    git rev-parse --abbrev-ref HEAD > .git/gpu-carry-from
    git checkout -q -b gpu-carry
    git rm -rq --ignore-unmatch dialogue/weights/drafter_adapter.safetensors codec/weights tts/weights docs/results \
      data/dialogue
    if [ -n "${INIT:-}" ]; then
      cp "$INIT" asr/weights/fc_small.nemo
      cp "${INIT%.nemo}.json" asr/weights/fc_small.json
      git add asr/weights
    fi
    git commit -qm "temporary: what a GPU ASR slice carries (scripts/gpu_carry_asr.sh restore)"
    size
    ;;
  size) size ;;
  restore)
    from=$(cat .git/gpu-carry-from 2>/dev/null || echo main)
    git checkout -q "$from" && git branch -D -q gpu-carry && rm -f .git/gpu-carry-from
    echo "back on $from"
    ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
