"""Test speech synthesised on the fly with hibari (the voice shipped in the package), cached per process."""

from __future__ import annotations

import functools

import numpy as np

from codec.resample import resample
from tts.hibari_tts import SAMPLE_RATE as HIBARI_RATE
from tts.hibari_tts import HibariSynth


@functools.cache
def _voice(seed: int) -> HibariSynth:
    return HibariSynth(threads=1, seed=seed)


@functools.lru_cache(maxsize=256)
def _synthesize(text: str, sample_rate: int, seed: int) -> np.ndarray:
    audio = _voice(seed).synthesize(text)
    if sample_rate != HIBARI_RATE:
        audio = resample(audio, HIBARI_RATE, sample_rate)
    audio = np.ascontiguousarray(audio, dtype=np.float32)
    audio.flags.writeable = False  # the cached copy must never be changed by a test
    return audio


def synthesize(text: str, sample_rate: int = 16000, seed: int = 0) -> np.ndarray:
    """Speak `text` with hibari's af_heart voice; float32 mono at `sample_rate`, bit-identical per seed."""
    return _synthesize(text, sample_rate, seed).copy()


def silence(seconds: float, sr: int = 16000) -> np.ndarray:
    """`seconds` of digital silence as float32."""
    return np.zeros(round(seconds * sr), np.float32)
