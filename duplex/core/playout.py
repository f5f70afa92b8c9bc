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
        self._held_at: float | None = None  # hold(): no frames are released until resume()

    @property
    def held(self) -> bool:
        return self._held_at is not None

    def hold(self, now: float) -> None:
        """Stop releasing frames (the user started talking over the answer and may only be saying
        "uh-huh"): the unsent rest waits, and `resume` continues from exactly there."""
        if self._held_at is not None:
            return
        self._held_at = now
        if self._chunks and 0 < self._chunks[0].sent < len(self._chunks[0].audio):
            # split the chunk being sent: what was released keeps its timing, the rest moves later
            c = self._chunks[0]
            cut = c.sent
            frac = cut / len(c.audio)
            words = c.text.split()
            k = int(len(words) * frac)
            self._chunks[0] = ScheduledChunk(c.audio[cut:], " ".join(words[k:]), c.start + cut / self.sr)
            self._done.append(ScheduledChunk(c.audio[:cut], " ".join(words[:k]), c.start, cut))

    def resume(self, now: float) -> None:
        """Release frames again; everything not yet sent is shifted by the time spent on hold."""
        if self._held_at is None:
            return
        # the listener heard the released audio, then silence for as long as the hold lasted
        shift = max(0.0, now - self._held_at)
        for c in self._chunks:
            c.start += shift
        if self._chunks:
            self._end += shift
        self._held_at = None

    def enqueue(self, now: float, audio: np.ndarray, text: str) -> None:
        start = max(now, self._end)
        chunk = ScheduledChunk(np.asarray(audio, dtype=np.float32), text, start)
        self._chunks.append(chunk)
        self._end = start + chunk.duration(self.sr)

    def due_frames(self, now: float) -> list[np.ndarray]:
        """Frames whose play time is within `lead` of now, in order."""
        frames: list[np.ndarray] = []
        if self._held_at is not None:
            return frames
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
        """Session time at which the next frame becomes due (None when nothing is queued or held)."""
        if not self._chunks or self._held_at is not None:
            return None
        chunk = self._chunks[0]
        return chunk.start + chunk.sent / self.sr - self.lead

    def buffered(self, now: float) -> float:
        """Seconds of audio queued ahead of `now` (0 while held: the hold's end is unknown)."""
        return 0.0 if self._held_at is not None else max(0.0, self._end - now)

    def pending(self) -> bool:
        """Audio is queued but not yet released."""
        return bool(self._chunks)

    def playing(self, now: float) -> bool:
        """The listener is still hearing (or about to hear) response audio."""
        return bool(self._chunks) or now < self._end

    def played(self, now: float, cap: float | None = None) -> tuple[float, str]:
        """Seconds heard so far and the words they carried (a partly heard phrase is cut).

        `cap` (seconds) bounds the answer from above when the client knows better, e.g. a telephony
        gateway whose playback marks show that its audio started later than the clock assumes.
        """
        timeline: list[tuple[float, str]] = []
        for chunk in [*self._done, *self._chunks]:
            heard = min(max(now - chunk.start, 0.0), chunk.duration(self.sr), chunk.sent / self.sr)
            if heard <= 0:
                break
            timeline.append((heard, chunk.text))
            if heard < chunk.duration(self.sr) - 1e-6:
                # a partly heard chunk: scale its words by the fraction heard
                timeline[-1] = (heard, _first_words(chunk.text, heard / chunk.duration(self.sr)))
                break
        seconds = sum(d for d, _ in timeline)
        if cap is not None and cap < seconds:
            return heard_within(self.timeline(), cap)
        return seconds, " ".join(t for _, t in timeline if t).strip()

    def timeline(self) -> list[tuple[float, str]]:
        """(duration seconds, text) of every chunk of the current response, queued or sent."""
        return [(c.duration(self.sr), c.text) for c in [*self._done, *self._chunks]]

    def reset(self) -> None:
        """Forget everything (barge-in or a new response); unsent audio is dropped."""
        self._chunks.clear()
        self._done.clear()
        self._end = 0.0
        self._held_at = None


def _first_words(text: str, fraction: float) -> str:
    words = text.split()
    return " ".join(words[: int(len(words) * fraction)])


def heard_within(timeline: list[tuple[float, str]], seconds: float) -> tuple[float, str]:
    """Seconds and words of a (duration, text) timeline that fit in its first `seconds`."""
    heard = 0.0
    words: list[str] = []
    for dur, text in timeline:
        take = min(dur, max(seconds - heard, 0.0))
        if take <= 0:
            break
        heard += take
        if take >= dur - 1e-6:
            words.extend(text.split())
        else:
            words.extend(_first_words(text, take / dur).split())
            break
    return heard, " ".join(words)
