"""The playout clock: what the listener has heard, so barge-in keeps only played words.

Audio chunks are scheduled back to back on the session clock from the moment they are queued;
frames are released to the transport `lead` seconds ahead of their play time (the client's jitter
buffer). At any time `played()` says how many samples, and which words, the listener has heard.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass
class ScheduledChunk:
    audio: np.ndarray  # float32 at the output rate
    text: str
    start: float  # session clock time at which it starts playing
    sent: int = 0  # samples already released to the transport

    def duration(self, sr: int) -> float:
        return len(self.audio) / sr


class Playout:
    """Schedules response audio in real time and answers 'what was heard by now?'."""

    def __init__(self, sample_rate: int, lead: float, frame_samples: int) -> None:
        self.sr = sample_rate
        self.lead = lead
        self.frame = frame_samples
        self._chunks: deque[ScheduledChunk] = deque()
        self._done: list[ScheduledChunk] = []  # fully released chunks of the current response
        self._end = 0.0  # time the last queued chunk stops playing

    def enqueue(self, now: float, audio: np.ndarray, text: str) -> None:
        start = max(now, self._end)
        chunk = ScheduledChunk(np.asarray(audio, dtype=np.float32), text, start)
        self._chunks.append(chunk)
        self._end = start + chunk.duration(self.sr)

    def due_frames(self, now: float) -> list[np.ndarray]:
        """Frames whose play time is within `lead` of now, in order."""
        frames: list[np.ndarray] = []
        while self._chunks:
            chunk = self._chunks[0]
            while chunk.sent < len(chunk.audio):
                t = chunk.start + chunk.sent / self.sr
                if t > now + self.lead:
                    return frames
                frames.append(chunk.audio[chunk.sent : chunk.sent + self.frame])
                chunk.sent += self.frame
            self._done.append(self._chunks.popleft())
        return frames

    def next_due(self) -> float | None:
        """Session time at which the next frame becomes due (None when nothing is queued)."""
        if not self._chunks:
            return None
        chunk = self._chunks[0]
        return chunk.start + chunk.sent / self.sr - self.lead

    def pending(self) -> bool:
        """Audio is queued but not yet released."""
        return bool(self._chunks)

    def playing(self, now: float) -> bool:
        """The listener is still hearing (or about to hear) response audio."""
        return bool(self._chunks) or now < self._end

    def played(self, now: float) -> tuple[float, str]:
        """Seconds heard so far and the words they carried (a partly heard phrase is cut)."""
        seconds = 0.0
        words: list[str] = []
        for chunk in [*self._done, *self._chunks]:
            dur = chunk.duration(self.sr)
            heard = min(max(now - chunk.start, 0.0), dur, chunk.sent / self.sr)
            if heard <= 0:
                break
            seconds += heard
            chunk_words = chunk.text.split()
            n = len(chunk_words) if heard >= dur - 1e-6 else int(len(chunk_words) * heard / dur)
            words.extend(chunk_words[:n])
            if heard < dur - 1e-6:
                break
        return seconds, " ".join(words)

    def reset(self) -> None:
        """Forget everything (barge-in or a new response); unsent audio is dropped."""
        self._chunks.clear()
        self._done.clear()
        self._end = 0.0
