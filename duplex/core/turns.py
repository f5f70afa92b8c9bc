"""The core's bookkeeping of one user turn (`Segment`: the open speech segment) and one answer
(`Response`: its text, TTS state and marks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Response:
    rid: int
    turn_id: int
    user_text: str
    committed: bool = False
    text: str = ""
    llm_started: bool = False
    llm_done: bool = False
    tts_pending: str = ""  # text deltas not yet given to the TTS
    tts_final_sent: bool = False
    tts_done: bool = False
    tts_state: Any = None
    held_text: list[str] = field(default_factory=list)  # deltas produced while speculative
    held_audio: list[Any] = field(default_factory=list)  # TTS chunks produced while speculative
    audio_started: bool = False
    marks: dict[str, float] = field(default_factory=dict)
    relay: dict[str, Any] = field(default_factory=dict)  # what the relay did (first LLM step)
    early: bool = False  # started from a partial transcript while the user still talked


@dataclass
class Segment:
    """The user's open speech segment (one user turn, possibly with pauses)."""

    sid: int
    turn_id: int
    start_sample: int
    asr_state: Any
    audio: list[np.ndarray] = field(default_factory=list)  # the whole segment so far
    pending: list[np.ndarray] = field(default_factory=list)  # audio not yet lent to the partial ASR
    total_samples: int = 0  # samples in the segment so far
    last_transcribed: int = 0  # total_samples at the last transcription request
    partial_text: str = ""
    spec_final: str | None = None  # latest full transcript of the segment
    spec_at: int = -1  # total_samples that transcript covers
    spec_ready: float = 0.0  # when it arrived
    spec_p_complete: float | None = None  # the ASR's acoustic P(complete) for that transcript's audio
    pause_at: int = 0  # total_samples at the current pause (speech end so far)
    early_final_at: int | None = None  # stream sample of the voice's end an early final was started for
    ended: bool = False
    last_partial_cost: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)
    # learned turn-taking
    listened: str = ""  # the text last given to the turn head
    decision: str | None = None  # at the current pause: "speak", "listen", "backchannel"
    confident_end: bool = False  # ... and the turn head is sure it is over (predictive end of turn)
    #: where between the short (0.0) and the full (1.0) hangover this turn ends (graded end of turn)
    end_wait_share: float = 1.0
    #: the words sound finished but the voice does not (acoustic end-of-turn cue): wait longer
    acoustic_hold: bool = False
    overlap: bool = False  # started while the service was speaking
    overlap_class: str | None = None  # "backchannel", "interruption" or "noise" (no word in it), once known
    slice_probs: tuple[str, tuple[float, float, float]] | None = None  # the turn head on the last slice

    def spec_valid(self) -> bool:
        """The latest transcript covers all audio up to where the speech stopped."""
        return self.spec_final is not None and self.spec_at >= self.pause_at
