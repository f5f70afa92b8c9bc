"""The turn-taking rule: from the turn head's probabilities to LISTEN / BACKCHANNEL / SPEAK, and from the
overlap head's P(interruption) to stop or go on. One rule, used by the session core, the dialogue engine,
the training recipes and the evaluation; its thresholds ship with the heads' weights."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

LISTEN, BACKCHANNEL, SPEAK = 0, 1, 2
LABELS = ("listen", "backchannel", "speak")


@dataclass
class TurnPolicy:
    """Decision thresholds, tuned on validation data at training time and shipped in the metadata.

    The session core calls `decide_turn` at each pause; training and evaluation tune the thresholds. With a `take_threshold` (heads trained
    since 2026-11-25 evening): the turn is taken if 1 - P(listen) >= take_threshold, as SPEAK if
    P(speak) >= P(backchannel), else as BACKCHANNEL ("mm-hmm", then answer if they do not go on); else
    LISTEN. Without one (older heads): SPEAK if P(speak) >= speak_threshold, else BACKCHANNEL if
    P(backchannel) >= backchannel_threshold and >= P(listen), else LISTEN. The take rule does not
    leave a finished statement that is half "mm-hmm" point, half answer point ("I live in Paris.":
    listen 0.03, backchannel 0.51, speak 0.46) unanswered because neither class alone is sure.
    """

    speak_threshold: float = 0.5
    backchannel_threshold: float = 0.5
    interrupt_threshold: float = 0.5
    take_threshold: float | None = None
    #: predictive end of turn: a SPEAK with P(take) at or above this ends the turn after the short
    #: hangover (`fast_turn_silence_ms`); calibrated by `duplex eval eot --write`; None: never
    fast_take_threshold: float | None = None
    #: graded end of turn: a SPEAK with P(take) between this and `fast_take_threshold` waits a hangover
    #: between the short and the full one, growing as P(take) falls; calibrated by `duplex eval eot
    #: --write`; None: two steps (short at `fast_take_threshold` and above, full below)
    graded_take_threshold: float | None = None
    #: acoustic end of turn: a SPEAK or BACKCHANNEL whose voice did not sound finished (the ASR's acoustic P(complete)
    #: below this) waits `acoustic_hold_silence_ms`; calibrated by `duplex eval eot --write`; None: off
    acoustic_hold_threshold: float | None = None
    #: acoustic end of turn, the other way: a SPEAK the head is less sure of (P(take) below
    #: `fast_take_threshold`) whose voice sounded finished (the ASR's acoustic P(complete) at or above
    #: this) also ends after the short hangover: two cues agree; calibrated by `duplex eval eot
    #: --write-acoustic`; None: off
    voice_fast_threshold: float | None = None

    @staticmethod
    def p_take(probs: Sequence[float] | Any) -> float:
        """P(the user has finished, for now) = 1 - P(listen)."""
        return 1.0 - float(probs[0])

    def confident_end(self, probs: Sequence[float] | Any, p_complete: float | None = None) -> bool:
        """The head is sure enough the turn is over to take it after the short hangover, or it judged
        the words complete and the voice (`p_complete`, the ASR's acoustic cue) sounded finished."""
        if self.fast_take_threshold is None or self.decide_turn(probs) != SPEAK:
            return False
        if self.p_take(probs) >= self.fast_take_threshold:
            return True
        return (
            self.voice_fast_threshold is not None
            and p_complete is not None
            and p_complete >= self.voice_fast_threshold
        )

    def end_wait_share(self, probs: Sequence[float] | Any, p_complete: float | None = None) -> float:
        """Where between the short hangover (0.0) and the full one (1.0) a turn the head judged over ends."""
        if self.confident_end(probs, p_complete):
            return 0.0
        hi, lo = self.fast_take_threshold, self.graded_take_threshold
        if hi is None or lo is None or not lo < hi or self.decide_turn(probs) != SPEAK:
            return 1.0
        p = self.p_take(probs)
        return 1.0 if p < lo else (hi - p) / (hi - lo)

    def acoustic_hold(self, probs: Sequence[float] | Any, p_complete: float | None) -> bool:
        """The words end the turn (SPEAK, or BACKCHANNEL: answer if they do not go on) but the voice did
        not sound finished: wait longer."""
        if self.acoustic_hold_threshold is None or p_complete is None:
            return False
        return self.decide_turn(probs) != LISTEN and p_complete < self.acoustic_hold_threshold

    def decide_turn(self, probs: Sequence[float] | Any) -> int:
        """LISTEN, BACKCHANNEL or SPEAK for one turn-head output (p_listen, p_backchannel, p_speak)."""
        p_listen, p_bc, p_speak = (float(p) for p in probs)
        if self.take_threshold is not None:
            if 1.0 - p_listen < self.take_threshold:
                return LISTEN
            return SPEAK if p_speak >= p_bc else BACKCHANNEL
        if p_speak >= self.speak_threshold:
            return SPEAK
        if p_bc >= self.backchannel_threshold and p_bc >= p_listen:
            return BACKCHANNEL
        return LISTEN

    def decide_overlap(self, p_interrupt: float | Any) -> bool:
        """True: the user interrupts (stop talking); False: a backchannel (go on)."""
        return float(p_interrupt) >= self.interrupt_threshold
