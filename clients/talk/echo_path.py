"""Keeps the client's own loudspeaker out of its microphone: the far end and the microphone aligned
on one clock, through the echo canceller of clients/echo.py."""

from __future__ import annotations

import numpy as np

from clients.echo import EchoCanceller, EchoChunk, EchoConfig, FarEndBuffer
from clients.talk.wire import SEND_RATE


class EchoPath:
    """Aligns the far end (what the speaker played) with the microphone on one 16 kHz clock and
    runs the echo canceller. The two sound streams have separate clocks; `lag` (the far-end sample
    that was playing when mic sample 0 was captured) comes from their timestamps. The reference is
    taken `margin_s` early so that timestamp error cannot put the echo before its reference."""

    def __init__(
        self,
        mode: str,
        rate: int = SEND_RATE,
        margin_s: float = 0.02,
        max_wait_s: float = 0.2,
        double_talk_ms: float = 400.0,
    ) -> None:
        self.canceller = EchoCanceller(
            EchoConfig.for_mode(mode, sample_rate=rate, double_talk_ms=double_talk_ms)
        )
        self.state = self.canceller.init_state()
        self.far = FarEndBuffer(rate * 4)
        self.rate = rate
        self.margin = int(rate * margin_s)
        self.max_wait = int(rate * max_wait_s)
        self.mic_index = 0  # mic samples handed to the canceller so far
        self.lag: int | None = None
        self._pending = np.zeros(0, np.float32)

    @property
    def latency(self) -> int:
        return self.canceller.latency

    def set_lag(self, lag: float) -> None:
        """Follow the clocks, but ignore sub-2 ms wobble: each change shifts the filter's view."""
        if self.lag is None or abs(lag - self.lag) > self.rate * 0.002:
            self.lag = int(round(lag))

    def process(self, mic: np.ndarray) -> np.ndarray:
        """Cleaned microphone samples (whole canceller blocks, `latency` late). Mic samples wait
        (up to `max_wait_s`) for their far-end reference to arrive."""
        self._pending = np.concatenate([self._pending, mic])
        n = len(self._pending)
        start = self.mic_index + (self.lag - self.margin if self.lag is not None else 0)
        if self.lag is not None and n <= self.max_wait:
            n = max(0, min(n, self.far.written - start))
        n -= n % self.canceller.n
        if n == 0:
            return np.zeros(0, np.float32)
        far = self.far.read(start, n) if self.lag is not None else np.zeros(n, np.float32)
        out, self.state = self.canceller.step(self.state, EchoChunk(self._pending[:n], far))
        self._pending = self._pending[n:]
        self.mic_index += n
        return out
