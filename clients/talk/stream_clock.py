"""When a sound stream's samples were captured or played, on the local monotonic clock, from
PortAudio's callback timestamps."""

from __future__ import annotations

import statistics
import threading
from collections import deque
from typing import Any


def stream_time(time_info: Any, name: str) -> tuple[float, float] | None:
    """(currentTime, the named buffer time) from PortAudio's callback times, if it gives them."""
    cur = float(getattr(time_info, "currentTime", 0.0) or 0.0)
    at = float(getattr(time_info, name, 0.0) or 0.0)
    return (cur, at) if cur > 0 and at > 0 else None


class StreamClock:
    """When (time.monotonic) sample 0 of a stream was captured or played, from the callbacks'
    timestamps: the median of the recent estimates, which drops callback scheduling jitter."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.count = 0
        self._estimates: deque[float] = deque(maxlen=64)
        self._lock = threading.Lock()

    def mark(self, first_sample_at: float, frames: int) -> None:
        with self._lock:
            self._estimates.append(first_sample_at - self.count / self.rate)
            self.count += frames

    def origin(self) -> float | None:
        with self._lock:
            return statistics.median(self._estimates) if self._estimates else None
