"""The loudspeaker side of live mode: a jitter buffer that PortAudio's thread plays from."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import numpy as np

from clients.talk.stream_clock import StreamClock, stream_time
from clients.talk.wire import FRAME_S


class Player:
    """The loudspeaker side (PortAudio's thread): a small jitter buffer that starts once
    `prebuffer_s` is queued (or has waited that long), is flushed at once on barge-in, and logs
    every block it played, silence included, as the echo canceller's reference."""

    def __init__(self, rate: int, prebuffer_s: float = 0.06) -> None:
        self.rate = rate
        self.prebuffer_s = prebuffer_s
        self.latency = 0.0  # the stream's output latency (s), once it is open
        self.clock = StreamClock(rate)
        self.played: deque[np.ndarray] = deque(maxlen=int(5 / FRAME_S))  # drained by the asyncio side
        self.first_sound: dict[int, float] = {}  # turn id -> when its first sample reached the speaker
        self.played_samples: dict[int, int] = {}
        self._lock = threading.Lock()
        self._queue: deque[list[Any]] = deque()  # [samples, turn id, offset]
        self._queued = 0
        self._playing = False
        self._waiting_since: float | None = None

    def push(self, samples: np.ndarray, turn_id: int) -> None:
        if not samples.size:
            return
        with self._lock:
            self._queue.append([samples, turn_id, 0])
            self._queued += samples.size
            if self._waiting_since is None:
                self._waiting_since = time.monotonic()

    def flush(self) -> None:
        with self._lock:
            self._queue.clear()
            self._queued, self._playing, self._waiting_since = 0, False, None

    def busy(self) -> bool:
        with self._lock:
            return self._queued > 0

    def callback(self, outdata: np.ndarray, frames: int, time_info: Any, status: Any) -> None:
        now = time.monotonic()
        times = stream_time(time_info, "outputBufferDacTime")
        dac = now + (times[1] - times[0]) if times else now + self.latency
        block = np.zeros(frames, np.float32)
        with self._lock:
            if not self._playing and self._queued:
                waited = now - (self._waiting_since or now)
                self._playing = self._queued >= self.prebuffer_s * self.rate or waited >= self.prebuffer_s
            pos = 0
            while self._playing and pos < frames and self._queue:
                item = self._queue[0]
                samples, turn, offset = item
                take = min(frames - pos, samples.size - offset)
                self.first_sound.setdefault(turn, dac + pos / self.rate)
                block[pos : pos + take] = samples[offset : offset + take]
                self.played_samples[turn] = self.played_samples.get(turn, 0) + take
                pos, item[2], self._queued = pos + take, offset + take, self._queued - take
                if item[2] >= samples.size:
                    self._queue.popleft()
            if self._playing and not self._queue:
                self._playing, self._waiting_since = False, None
        outdata[:] = block.reshape(-1, 1)
        self.clock.mark(dac, frames)
        self.played.append(block)
