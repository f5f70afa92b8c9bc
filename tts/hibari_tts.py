"""Streaming TTS stage with hibari (the af_heart voice shipped in the package): text deltas in, one
24 kHz audio chunk per phrase out, each tagged with exactly the text it speaks."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from duplex.base.config import ComponentConfig, ConfigError
from duplex.base.errors import ModelError
from duplex.base.messages import TtsChunk, TtsInput
from duplex.base.phrases import PhraseSegmenter, PhraseState
from duplex.base.stage import SequentialBatchMixin

SAMPLE_RATE = 24000
PIP_HINT = "pip install hibari-tts==0.2.1"

# hibari pads every utterance with ~0.3 s of silence on each side: between phrases of one sentence that
# is a 0.7 s gap, and before the first phrase it is pure latency. Trim it and add a pause that fits the
# punctuation instead.
SILENCE_THRESHOLD = 1e-3  # -60 dBFS; hibari's padding is exact zeros, speech onsets exceed 1e-3
LEAD_SECONDS = 0.02
PAUSE_SECONDS = {"sentence": 0.25, "clause": 0.12, "none": 0.03}


def _pause_after(text: str) -> float:
    core = text.rstrip("\"')]}”’»")
    if core.endswith((".", "!", "?", "…")):
        return PAUSE_SECONDS["sentence"]
    if core.endswith((",", ";", ":")):
        return PAUSE_SECONDS["clause"]
    return PAUSE_SECONDS["none"]


def trim_silence(audio: np.ndarray, pause_seconds: float, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Cut leading silence to LEAD_SECONDS and trailing silence to exactly `pause_seconds`."""
    loud = np.flatnonzero(np.abs(audio) > SILENCE_THRESHOLD)
    if loud.size == 0:
        return audio[:0]
    start = max(0, int(loud[0]) - round(LEAD_SECONDS * sample_rate))
    voiced = audio[start : int(loud[-1]) + 1]
    return np.concatenate([voiced, np.zeros(round(pause_seconds * sample_rate), np.float32)])


@dataclass
class TtsState:
    """Per-response state: only the phrase segmenter's (synthesis itself keeps none)."""

    phrases: PhraseState


class HibariSynth:
    """The loaded hibari model, shared by all sessions; phrase text -> deterministic audio."""

    def __init__(self, voice: str = "heart", threads: int = 1, speed: float = 1.0, seed: int = 0) -> None:
        try:
            from hibari import Hibari
            from hibari.voices import VOICES
        except ImportError:
            raise ModelError(f"the TTS needs hibari-tts: {PIP_HINT}") from None
        # other voices are downloaded on first use, which fails offline and stalls a server: refuse them
        if not VOICES.get(voice, {}).get("bundled"):
            bundled = [name for name, v in VOICES.items() if v.get("bundled")]
            raise ConfigError(f"hibari voice {voice!r} is not shipped in the package; use one of {bundled}")
        if not 0.5 <= speed <= 2.0:
            raise ConfigError("tts option 'speed' must be in [0.5, 2.0]")
        self._tts = Hibari(voice=voice, threads=threads)
        _ = self._tts.g2p  # load the G2P now rather than inside the first session's turn
        # hibari's G2P loads its OOV model lazily and is not documented as thread-safe; it takes well under
        # a millisecond per phrase, so a lock costs nothing. onnxruntime's run() is thread-safe, unlocked.
        self._g2p_lock = threading.Lock()
        self.speed = float(speed)
        self.seed = int(seed)
        self.synthesize("Ready.")  # warm-up: onnxruntime's first run is several times slower

    def synthesize(self, text: str) -> np.ndarray:
        """Float32 audio at 24 kHz; the same text always gives the same samples (fixed noise seed)."""
        with self._g2p_lock:
            phonemes = self._tts.phonemize(text)
        rng = np.random.default_rng(self.seed)
        parts = [self._tts.from_ids(self._tts.ids(ps), self.speed, rng) for ps in phonemes]
        return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)


class HibariTtsStage(SequentialBatchMixin[TtsState, TtsInput, list[TtsChunk]]):
    """Streaming stage: LLM text deltas in, a list of phrase chunks out (empty until a phrase is ready).

    hibari has no batched call, so `step_batch` synthesises sessions in turn.
    """

    kind = "tts"
    sample_rate = SAMPLE_RATE

    def __init__(self, synth: HibariSynth, first_phrase_words: int = 3, max_phrase_words: int = 12) -> None:
        self.synth = synth
        self.segmenter = PhraseSegmenter(first_phrase_words, max_phrase_words)

    def init_state(self) -> TtsState:
        return TtsState(phrases=self.segmenter.init_state())

    def step(self, state: TtsState, chunk: TtsInput) -> tuple[list[TtsChunk], TtsState]:
        """Add a delta; synthesise every phrase that became ready. The input state is not modified."""
        phrases, phrase_state = self.segmenter.step(state.phrases, chunk.text, chunk.final)
        out = []
        for text in phrases:
            audio = trim_silence(self.synth.synthesize(text), _pause_after(text))
            if audio.size:  # a phrase hibari cannot pronounce is not reported as spoken
                out.append(TtsChunk(audio=audio, text=text))
        return out, TtsState(phrases=phrase_state)


def load_tts_stage(cfg: ComponentConfig) -> HibariTtsStage:
    """Build the TTS stage from the models.yaml `tts` component (backend `hibari`)."""
    if cfg.backend != "hibari":
        raise ConfigError(f"component {cfg.name!r}: unknown TTS backend {cfg.backend!r} (known: hibari)")
    opts = cfg.options
    synth = HibariSynth(
        voice=str(opts.get("voice", "heart")),
        threads=int(opts.get("threads", 1)),
        speed=float(opts.get("speed", 1.0)),
        seed=int(opts.get("seed", 0)),
    )
    return HibariTtsStage(
        synth,
        first_phrase_words=int(opts.get("first_phrase_words", 3)),
        max_phrase_words=int(opts.get("max_phrase_words", 12)),
    )
