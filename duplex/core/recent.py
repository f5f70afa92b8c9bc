"""The last few seconds of a session's input, kept contiguous and appended in place (pure, no I/O).

`np.concatenate([recent, frame])[-keep:]` on every 20 ms frame copied (and allocated) the whole 3 s
window 50 times a second on the event loop, holding the GIL that the model threads need between their
ops: 7.5 % of the event loop's time for one caller (py-spy, docs/results/2026-11-27.md). Here the window
lives in a buffer twice its size and is moved to the front once per `capacity` samples.
"""

from __future__ import annotations

import numpy as np


class RecentAudio:
    """The last `capacity` samples appended (fewer at the start); `base` is the stream index of the first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"RecentAudio needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
        self._buf = np.zeros(2 * capacity, dtype=np.float32)
        self._end = 0  # samples written into _buf
        self.total = 0  # samples ever appended

    def append(self, x: np.ndarray) -> None:
        n = int(x.size)
        if n == 0:
            return
        self.total += n
        if n >= self.capacity:
            self._buf[: self.capacity] = x[-self.capacity :]
            self._end = self.capacity
            return
        if self._end + n > self._buf.size:
            keep = min(self._end, self.capacity)
            self._buf[:keep] = self._buf[self._end - keep : self._end]
            self._end = keep
        self._buf[self._end : self._end + n] = x
        self._end += n

    @property
    def samples(self) -> np.ndarray:
        """The window (a view: copy what must outlive the next `append`)."""
        return self._buf[max(0, self._end - self.capacity) : self._end]

    @property
    def base(self) -> int:
        return self.total - min(self._end, self.capacity)
