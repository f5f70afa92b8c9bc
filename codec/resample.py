"""Sample-rate conversion with soxr: a streaming stage (state wraps `soxr.ResampleStream`) and an offline call."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from duplex.stage import SequentialBatchMixin

#: rates a client may send or ask for; anything else is probably a bug (e.g. a rate in kHz)
SUPPORTED_RATES: tuple[int, ...] = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
QUALITY = "HQ"


def check_rate(rate: int) -> int:
    """Return `rate` if it is supported, else raise ValueError listing the supported rates."""
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or int(rate) not in SUPPORTED_RATES:
        raise ValueError(
            f"unsupported sample rate {rate!r}; supported: {', '.join(str(r) for r in SUPPORTED_RATES)}"
        )
    return int(rate)


def _mono_float32(x: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(x, dtype=np.float32)
    if arr.ndim != 1:
        raise ValueError(f"expected mono 1-D samples, got shape {arr.shape}")
    return arr


def resample(x: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Offline resampling of mono float32 samples; equals the streaming stage fed all chunks then flushed."""
    sr_in, sr_out = check_rate(sr_in), check_rate(sr_out)
    arr = _mono_float32(x)
    if sr_in == sr_out:
        return arr.copy()
    import soxr

    return soxr.resample(arr, sr_in, sr_out, quality=QUALITY).astype(np.float32, copy=False)


@dataclass
class ResampleState:
    """One stream's resampler. soxr's filter state cannot be copied, so `step` advances it in place."""

    stream: object | None  # soxr.ResampleStream, or None when the rates are equal
    flushed: bool = False


class StreamingResampler(SequentialBatchMixin[ResampleState, np.ndarray, np.ndarray]):
    """Streaming stage: float32 chunks at `sr_in` in, float32 chunks at `sr_out` out; `flush` ends a stream."""

    kind = "resample"

    def __init__(self, sr_in: int, sr_out: int) -> None:
        self.sr_in = check_rate(sr_in)
        self.sr_out = check_rate(sr_out)

    def init_state(self) -> ResampleState:
        if self.sr_in == self.sr_out:
            return ResampleState(stream=None)
        import soxr

        return ResampleState(
            stream=soxr.ResampleStream(self.sr_in, self.sr_out, 1, dtype="float32", quality=QUALITY)
        )

    def step(self, state: ResampleState, chunk: np.ndarray) -> tuple[np.ndarray, ResampleState]:
        """Resample one chunk; output lags input by the filter delay until `flush`."""
        if state.flushed:
            raise ValueError("resampler stream already flushed; start a new one with init_state()")
        x = _mono_float32(chunk)
        if state.stream is None:
            return x.copy(), state
        return state.stream.resample_chunk(x), state  # type: ignore[attr-defined]

    def flush(self, state: ResampleState) -> tuple[np.ndarray, ResampleState]:
        """Emit the samples still held in the filter; the stream cannot be used afterwards."""
        if state.flushed:
            return np.zeros(0, np.float32), state
        state.flushed = True
        if state.stream is None:
            return np.zeros(0, np.float32), state
        return state.stream.resample_chunk(np.zeros(0, np.float32), last=True), state  # type: ignore[attr-defined]
