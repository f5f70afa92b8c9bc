"""Wav files in and out of file mode, at any rate: the user's side is read as 16 kHz mono."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from clients.talk.errors import TalkError
from clients.talk.wire import SEND_RATE
from codec.resample import SUPPORTED_RATES, resample


def load_wav(path: str | Path) -> np.ndarray:
    """Any file soundfile reads -> mono (channels averaged) float32 at 16 kHz."""
    import soundfile as sf

    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (OSError, RuntimeError, sf.LibsndfileError) as exc:
        raise TalkError(f"cannot read {path}: {exc}") from None
    mono = data.mean(axis=1).astype(np.float32)
    return to_rate(mono, int(rate), SEND_RATE)


def to_rate(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    if rate == target:
        return np.ascontiguousarray(x, np.float32)
    if rate in SUPPORTED_RATES and target in SUPPORTED_RATES:
        return resample(x, rate, target)
    import soxr

    return soxr.resample(np.ascontiguousarray(x, np.float32), rate, target, quality="HQ").astype(np.float32)


def write_wav(path: str | Path, audio: np.ndarray, rate: int, out_rate: int | None = None) -> int:
    """Write PCM16 mono at `out_rate` (default: `rate`); returns the rate written."""
    import soundfile as sf

    target = out_rate or rate
    try:
        sf.write(str(path), to_rate(audio, rate, target), target, subtype="PCM_16")
    except (OSError, RuntimeError, ValueError, sf.LibsndfileError) as exc:
        raise TalkError(f"cannot write {path}: {exc}") from None
    return target
