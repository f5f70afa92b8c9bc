"""What callers say to cut the service off ("Stop, ...", "Wait.", "Hold on, ..."): one list for the whole
service. The session core does not answer a turn that is only a cue (more follows: "Stop, ... what is
two plus two?"); the relay's verifier vetoes a draft that, after a cue, goes on about the answer the
caller cut off; the training conversations open barge-ins with them."""

from __future__ import annotations

INTERRUPTION_CUES: tuple[str, ...] = (
    "stop", "wait", "hold on", "sorry", "no no", "okay stop", "actually", "hang on",
    "excuse me", "sorry to interrupt", "stop stop", "wait a second",
    "wait wait", "one second", "hold on a second",
)  # fmt: skip
#: the cues the shipped training conversations were generated with (dialogue/training/multi_turn.py
#: draws from them with a seeded rng): rebuilding the shipped data needs exactly these, in this order
TRAINING_CUES = INTERRUPTION_CUES[:12]


def cue_words(text: str) -> str:
    """Lower case words, punctuation dropped, apostrophes kept: "Stop, WAIT!" -> "stop wait"."""
    return " ".join("".join(c if c.isalnum() or c in " '" else " " for c in text.lower()).split())


def is_bare_cue(text: str) -> bool:
    """The turn so far is only a cue such as "Stop," or "Wait.": at a pause it is not yet a turn to
    answer (the turn head scores it close to SPEAK after a barge-in; answering "Stop," is never right)."""
    return cue_words(text) in INTERRUPTION_CUES


def opens_with_cue(text: str) -> bool:
    """The turn opens with a cue ("Stop.", "Wait,", "Hold on, ...")."""
    words = cue_words(text).split()
    return any(words[: len(c.split())] == c.split() for c in INTERRUPTION_CUES)
