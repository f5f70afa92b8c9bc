"""The virtual speaker of file mode: where each stretch of answer audio falls on the conversation's clock."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Run:
    """Answer audio played back to back: started at `wall` (loop time), placed at `at` (s)."""

    wall: float
    at: float
    chunks: list[np.ndarray] = field(default_factory=list)
    samples: int = 0
    closed: bool = False


class Timeline:
    """The virtual speaker of file mode: plays frames in order, in real time, like a sound card,
    and remembers where each stretch of sound falls on the conversation's clock (0 = the start of
    the input file; wall seconds times `speed`). A flush cuts the stretch where playback was."""

    def __init__(self, rate: int, speed: float, t0: float) -> None:
        self.rate = rate
        self.speed = speed
        self.t0 = t0
        self.runs: list[Run] = []

    def conv_time(self, wall: float) -> float:
        return (wall - self.t0) * self.speed

    def _end(self, run: Run) -> float:
        return run.wall + run.samples / self.rate

    def feed(self, samples: np.ndarray, wall: float) -> float:
        """Queue a frame that arrived at `wall`; returns where (s) on the timeline it starts."""
        last = self.runs[-1] if self.runs else None
        if last is None or last.closed or wall > self._end(last):  # the speaker had gone quiet
            at = self.conv_time(wall)
            if last is not None:
                at = max(at, last.at + last.samples / self.rate)
            last = Run(wall, at)
            self.runs.append(last)
        start = last.at + last.samples / self.rate
        last.chunks.append(samples)
        last.samples += len(samples)
        return start

    def flush(self, wall: float) -> None:
        """Barge-in: what had not been played by `wall` is dropped."""
        if not self.runs or self.runs[-1].closed:
            return
        last = self.runs[-1]
        keep = max(0, min(last.samples, int(round((wall - last.wall) * self.rate))))
        audio = np.concatenate(last.chunks)[:keep] if last.chunks else np.zeros(0, np.float32)
        last.chunks, last.samples, last.closed = [audio], keep, True

    def playing(self, wall: float) -> bool:
        return bool(self.runs) and not self.runs[-1].closed and wall < self._end(self.runs[-1])

    def render(self, seconds: float) -> np.ndarray:
        """The listener's audio from 0 to `seconds` (longer if an answer goes on), float32."""
        end = max(
            [int(round(r.at * self.rate)) + r.samples for r in self.runs] + [int(round(seconds * self.rate))]
        )
        out = np.zeros(end, np.float32)
        for r in self.runs:
            if r.samples:
                start = int(round(r.at * self.rate))
                out[start : start + r.samples] = np.concatenate(r.chunks)
        return out
