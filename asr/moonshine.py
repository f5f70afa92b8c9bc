"""Moonshine base-en (from `moonshine_cpp`) as a segment-level ASR stage.

Moonshine is not a streaming model: each transcription re-reads the whole open segment. The session
asks for partials every `partial_interval_ms` and a final at end of turn; a new segment starts with
a fresh `init_state()`.
"""

from __future__ import annotations

import ctypes
import queue
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from asr.vad import ModelError
from duplex.config import ComponentConfig, ConfigError
from duplex.stage import SequentialBatchMixin

SAMPLE_RATE = 16000
#: below ~1000 samples the encoder's convolutions get an empty input and onnxruntime *aborts the
#: process* (an uncaught C++ exception), so anything shorter than 0.1 s is answered without the model
MIN_SAMPLES = SAMPLE_RATE // 10
PIP_HINT = "pip install moonshine-cpp==0.1.4"

_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class AsrChunk:
    """New audio of the open segment; `transcribe` asks for its transcript now, `final` marks end of turn."""

    samples: np.ndarray
    transcribe: bool = False
    final: bool = False


@dataclass(frozen=True)
class AsrOutput:
    """Transcript of the whole open segment (`text` is None when none was asked for)."""

    text: str | None
    is_final: bool
    audio_seconds: float
    compute_seconds: float


@dataclass
class AsrState:
    """The open segment's audio, kept as the chunks received; joined only when transcribed."""

    chunks: tuple[np.ndarray, ...] = ()
    n_samples: int = 0

    def audio(self) -> np.ndarray:
        if not self.chunks:
            return np.zeros(0, np.float32)
        return self.chunks[0] if len(self.chunks) == 1 else np.concatenate(self.chunks)


def clean_text(text: str) -> str:
    """Strip and collapse whitespace."""
    return _SPACES.sub(" ", text).strip()


class MoonshineModel:
    """Loaded Moonshine handles, shareable by all sessions and executor threads.

    libmoonshine documents no thread safety and appears to have no locking of its own (it keeps models in
    a global vector and each model owns its onnxruntime sessions), so each handle is used by one thread at a time:
    `instances` handles form a pool. One handle is the right default on 2 cores because onnxruntime
    inside libmoonshine already uses every core for one call (its thread count cannot be set via the C API).
    Loading another model appends to that global vector, so build models at start-up, not while serving.
    """

    def __init__(self, instances: int = 1) -> None:
        try:
            import moonshine_cpp
        except ImportError:
            raise ModelError(f"the Moonshine ASR needs moonshine-cpp: {PIP_HINT}") from None
        except OSError as exc:  # its shared libraries failed to load
            raise ModelError(
                f"moonshine-cpp is installed but cannot load its libraries ({exc}); "
                f"reinstall: {PIP_HINT} --force-reinstall"
            ) from None
        if instances < 1:
            raise ConfigError("asr option 'instances' must be >= 1")
        self._lib = moonshine_cpp.moonshine_lib
        # the Python wrappers own the handles and free them when collected
        try:
            self._models = [moonshine_cpp.MoonshineModel() for _ in range(instances)]
        except (AssertionError, MemoryError) as exc:  # its way of saying the bundled model files are bad
            raise ModelError(
                f"cannot load Moonshine base-en ({exc}); reinstall: {PIP_HINT} --force-reinstall"
            ) from None
        self._pool: queue.Queue[int] = queue.Queue()
        for model in self._models:
            self._pool.put(model.model_handle)
        self.transcribe(np.zeros(SAMPLE_RATE, np.float32))  # warm-up: the first call is ~2x slower

    @contextmanager
    def _handle(self) -> Iterator[int]:
        handle = self._pool.get()
        try:
            yield handle
        finally:
            self._pool.put(handle)

    def transcribe(self, audio: np.ndarray) -> str:
        """Transcript of 16 kHz mono float32 audio; '' for audio shorter than 0.1 s."""
        x = np.ascontiguousarray(audio, dtype=np.float32).reshape(-1)
        if x.size < MIN_SAMPLES:
            return ""
        out = ctypes.c_char_p(0)
        with self._handle() as handle:
            # ctypes releases the GIL for the call, so other sessions' Python work goes on meanwhile
            err = self._lib.moonshine_transcribe(
                handle, x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), x.size, ctypes.byref(out)
            )
        try:
            if err != 0:
                raise ModelError(f"moonshine_transcribe failed with error code {err}")
            return clean_text((out.value or b"").decode("utf-8", errors="replace"))
        finally:
            if out.value is not None:
                self._lib.moonshine_free_text(out)


class MoonshineAsrStage(SequentialBatchMixin[AsrState, AsrChunk, AsrOutput]):
    """Segment ASR stage: buffers the open segment, transcribes all of it on request.

    libmoonshine has no batched call, so `step_batch` transcribes sessions in turn.
    """

    kind = "asr"
    sample_rate = SAMPLE_RATE

    def __init__(self, model: MoonshineModel) -> None:
        self.model = model

    def init_state(self) -> AsrState:
        return AsrState()

    def step(self, state: AsrState, chunk: AsrChunk) -> tuple[AsrOutput, AsrState]:
        """Append `chunk.samples`; transcribe the whole segment if asked (`final` implies it).

        The input state is not modified.
        """
        x = np.asarray(chunk.samples, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"ASR expects mono 1-D float32 samples at 16 kHz, got shape {x.shape}")
        chunks = (*state.chunks, x.copy()) if x.size else state.chunks
        new_state = AsrState(chunks=chunks, n_samples=state.n_samples + x.size)
        seconds = new_state.n_samples / SAMPLE_RATE
        if not (chunk.transcribe or chunk.final):
            return AsrOutput(None, False, seconds, 0.0), new_state
        audio = new_state.audio()
        new_state = AsrState(chunks=(audio,) if audio.size else (), n_samples=audio.size)  # join once
        t0 = time.perf_counter()
        text = self.model.transcribe(audio)
        return AsrOutput(text, chunk.final, seconds, time.perf_counter() - t0), new_state


def load_asr_stage(cfg: ComponentConfig) -> MoonshineAsrStage:
    """Build the ASR stage from the models.yaml `asr` component (backend `moonshine`)."""
    if cfg.backend != "moonshine":
        raise ConfigError(f"component {cfg.name!r}: unknown ASR backend {cfg.backend!r} (known: moonshine)")
    package = cfg.weights.get("package", "moonshine_cpp")
    if package != "moonshine_cpp":
        raise ConfigError(f"component {cfg.name!r}: the moonshine backend loads only package moonshine_cpp")
    # `threads` in models.yaml is not settable through libmoonshine's C API; onnxruntime's default is used
    return MoonshineAsrStage(MoonshineModel(instances=int(cfg.options.get("instances", 1))))
