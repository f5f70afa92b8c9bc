"""Speech start / pause / end-of-turn decisions from VAD probabilities (pure, no I/O).

Hysteresis: speech starts after `min_speech` samples of windows at or above `threshold`, and
continues while P(speech) stays at or above `off_threshold`. The first quiet window is a *pause*
(the user may go on); `end_silence` samples of quiet end the turn; speech during a pause *resumes*
the same turn. Positions are sample indices of the 16 kHz input stream, so decisions depend only on
the audio, never on when it arrived.

A streaming ASR adds a second opinion (`decoder_silence` / `decoder_words`): once its decoder has
heard no word for a while (its end-of-utterance signal), windows count as quiet even where the VAD
still hears sound (a hum, a breath, a noisy room), so the pause and the end of the turn are timed from
the last word; only new words from the decoder resume the turn then.

The voice's energy adds a third (`speech_end`): Silero's probability stays near 1.0 to a word's end
and falls one 32 ms window later, so the first quiet window is declared 60-100 ms after the last word.
The pause is dated back to the last 10 ms frame within `speech_end_db` of the turn's loudest (at most
`max_backdate` samples back), so the hangover counts from where the words end. In a room whose noise
is within that range of the voice no frame is quiet and nothing moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FRAME = 160  # 10 ms at 16 kHz: the grain of `speech_end`


def speech_end(audio: np.ndarray, base: int, start: int, until: int, below_peak_db: float) -> int | None:
    """Where the voice's energy ends: the stream index just past the last 10 ms frame in
    [`start`, `until`) whose RMS is within `below_peak_db` of the loudest frame there. `audio` holds
    the stream's samples from index `base` on (frames are aligned to `start`). None when the span
    holds no complete frame or only digital silence."""
    lo = max(start, base)
    n = (until - lo) // FRAME
    if n <= 0 or until > base + len(audio):
        return None
    x = np.asarray(audio[lo - base : lo - base + n * FRAME], dtype=np.float64).reshape(n, FRAME)
    rms = np.sqrt((x * x).mean(axis=1))
    peak = float(rms.max())
    if peak <= 0.0:
        return None
    loud = np.flatnonzero(rms >= peak * 10.0 ** (-abs(below_peak_db) / 20.0))
    return lo + (int(loud[-1]) + 1) * FRAME


@dataclass(frozen=True)
class Edge:
    """A decision: kind is 'start', 'pause', 'resume' or 'end'; sample is where it happened."""

    kind: str
    sample: int


@dataclass
class Endpointer:
    threshold: float
    off_threshold: float
    min_speech: int  # samples
    end_silence: int  # samples
    in_speech: bool = False
    paused: bool = False
    run: int = 0  # samples of consecutive loud windows (not in speech) or quiet ones (paused)
    start_sample: int = 0
    pause_sample: int = 0
    speech_samples: int = 0  # loud samples since the segment started
    decoder_quiet_since: int | None = None  # the ASR decoder's last word ended here and none followed
    max_backdate: int = 0  # samples a pause may be dated back to the voice's end (`speech_end`)

    def feed(self, window_end: int, prob: float, window: int, voice_end: int | None = None) -> list[Edge]:
        """Consume one VAD window (ending at `window_end`); return the decisions it causes.
        `voice_end` (from `speech_end`, optional): where the voice's energy ended, to date a pause
        this window declares back to (by at most `max_backdate` samples)."""
        edges: list[Edge] = []
        if not self.in_speech:
            if prob >= self.threshold:
                self.run += window
                if self.run >= self.min_speech:
                    self.in_speech, self.paused = True, False
                    self.start_sample = window_end - self.run
                    self.speech_samples = self.run
                    self.run = 0
                    edges.append(Edge("start", self.start_sample))
            else:
                self.run = 0
            return edges
        by_decoder = self.decoder_quiet_since is not None  # only the decoder's words resume then
        if not by_decoder and prob >= (self.threshold if self.paused else self.off_threshold):
            self.speech_samples += window
            if self.paused:
                self.paused, self.run = False, 0
                edges.append(Edge("resume", window_end - window))
            return edges
        if not self.paused:
            self.paused = True
            self.pause_sample = window_end - window
            if self.decoder_quiet_since is not None:
                self.pause_sample = min(self.decoder_quiet_since, self.pause_sample)  # at the last word
            elif voice_end is not None and self.max_backdate > 0:
                earliest = max(self.start_sample, self.pause_sample - self.max_backdate)
                self.pause_sample = max(earliest, min(self.pause_sample, voice_end))
            self.run = window_end - window - self.pause_sample
            edges.append(Edge("pause", self.pause_sample))
        self.run += window
        if self.run >= self.end_silence:
            self._close()
            edges.append(Edge("end", self.pause_sample))
        return edges

    def decoder_silence(self, since_sample: int) -> bool:
        """The ASR decoder has heard no word since `since_sample` (its end-of-utterance signal): the
        next window pauses the turn there even if the VAD still hears sound. (In a pause the VAD
        already called, nothing changes: its own resume stays the faster one.) True if this is news."""
        if self.in_speech and not self.paused and self.decoder_quiet_since is None:
            self.decoder_quiet_since = since_sample
            return True
        return False

    def decoder_words(self, at_sample: int) -> list[Edge]:
        """The decoder heard words again after `decoder_silence`: the turn resumes."""
        if self.decoder_quiet_since is None:
            return []
        self.decoder_quiet_since = None
        if not (self.in_speech and self.paused):
            return []
        self.paused, self.run = False, 0
        return [Edge("resume", at_sample)]

    def force_end(self) -> list[Edge]:
        """The input ended (client said so): close an open segment now."""
        if not self.in_speech:
            return []
        end = self.pause_sample if self.paused else self.start_sample + self.speech_samples
        self._close()
        return [Edge("end", end)]

    def _close(self) -> None:
        self.in_speech, self.paused, self.run = False, False, 0
        self.decoder_quiet_since = None
