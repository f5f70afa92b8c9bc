"""Sample-rate conversion with soxr: a streaming stage (state wraps `soxr.ResampleStream`) and an offline call."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from duplex.base.stage import SequentialBatchMixin

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


class LowLatencyResampler:
    """Streaming rational resampler (polyphase windowed-sinc FIR) that holds nothing back.

    soxr's streaming mode buffers 37 ms (16 -> 24 kHz) to 115 ms (8 -> 16 kHz) of audio per stream
    before it emits anything: on a phone call that is most of a latency budget. This filter emits
    every output sample as soon as the input it depends on has arrived; its only delay is the
    filter's group delay (about 1-2 ms at the rates used here). Kaiser-windowed sinc, ~70 dB
    stopband, transition band 15 % of the lower rate below its Nyquist frequency (speech above
    3.4 kHz survives 8 kHz, as on any phone line).

    State is explicit (`init_state` / `step`), and any split of the input into chunks gives
    exactly the same output as one call with all of it.
    """

    def __init__(self, sr_in: int, sr_out: int, transition: float = 0.15, atten_db: float = 70.0) -> None:
        import math

        self.sr_in, self.sr_out = check_rate(sr_in), check_rate(sr_out)
        g = math.gcd(self.sr_in, self.sr_out)
        self.up, self.down = self.sr_out // g, self.sr_in // g
        fs_up = self.sr_in * self.up
        f_low = min(self.sr_in, self.sr_out)
        width = transition * f_low
        n_taps = math.ceil((atten_db - 7.95) / (14.36 * width / fs_up))
        self.taps_per_phase = max(2, math.ceil(n_taps / self.up))
        n_taps = self.taps_per_phase * self.up
        cutoff = (f_low / 2 - width / 2) / fs_up  # cycles per (upsampled) sample
        t = np.arange(n_taps) - (n_taps - 1) / 2
        h = 2 * cutoff * np.sinc(2 * cutoff * t) * np.kaiser(n_taps, 0.1102 * (atten_db - 8.7))
        h *= self.up / h.sum()  # unity gain at DC after zero-stuffing by `up`
        # bank[p, k] = h[p + k * up]; reversed along k so a window of past inputs is a dot product
        self._bank = h.reshape(self.taps_per_phase, self.up).T[:, ::-1].astype(np.float64).copy()
        self.delay_s = (n_taps - 1) / 2 / fs_up

    def init_state(self) -> LowLatencyState:
        return LowLatencyState(history=np.zeros(self.taps_per_phase - 1, np.float32))

    def step(self, state: LowLatencyState, chunk: np.ndarray) -> tuple[np.ndarray, LowLatencyState]:
        x = _mono_float32(chunk)
        if self.up == self.down:
            return x.copy(), state
        k = self.taps_per_phase
        buf = np.concatenate([state.history, x])
        total = state.n_in + x.size  # input samples seen, this chunk included
        n_end = -(-total * self.up // self.down)  # outputs n with n * down < total * up
        n = np.arange(state.n_out, n_end, dtype=np.int64)
        out = np.zeros(0, np.float32)
        if n.size:
            pos = n * self.down
            phase = pos % self.up
            base = pos // self.up - (state.n_in - (k - 1))  # index in buf of the newest input used
            windows = np.lib.stride_tricks.sliding_window_view(buf, k)[base - (k - 1)]
            out = np.einsum("nk,nk->n", windows, self._bank[phase]).astype(np.float32)
        state = LowLatencyState(history=buf[buf.size - (k - 1) :].copy(), n_in=total, n_out=int(n_end))
        return out, state

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Offline: the whole signal in one step (same samples as any streaming split)."""
        return self.step(self.init_state(), x)[0]


@dataclass
class LowLatencyState:
    history: np.ndarray  # the last taps_per_phase - 1 input samples
    n_in: int = 0
    n_out: int = 0
