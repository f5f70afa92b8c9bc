"""The stage set a session core talks to (shared by all sessions; per-session state lives in the core)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from duplex.base.messages import (
    AsrChunk,
    AsrResult,
    TtsChunk,
    TtsInput,
)
from duplex.base.stage import StreamingStage
from duplex.base.turn_policy import TurnPolicy


@dataclass(frozen=True)
class Stages:
    """The stage objects a session uses (shared by all sessions; state lives in the core).

    The core talks to them only through the typed messages of duplex/base/messages.py.
    """

    vad: StreamingStage[Any, Any, list[tuple[int, float]]]
    asr: StreamingStage[Any, AsrChunk, AsrResult | None]
    llm: StreamingStage[Any, Any, Any]  # ListenStep/OverlapStep/RespondStep -> their outputs
    tts: StreamingStage[Any, TtsInput, list[TtsChunk]]
    #: the ASR transcribes as the audio arrives (words with times, end-of-utterance); False: it
    #: transcribes the whole segment on request (partials at intervals, a final at the pause)
    asr_streaming: bool = False
    #: learned turn-taking: the llm stage takes ListenStep and OverlapStep, and its heads decide by this
    #: policy; None: fixed VAD hangover and VAD barge-in
    policy: TurnPolicy | None = None
    #: an answer's first step decodes until it holds a first phrase of this many words (the TTS's rule);
    #: 0: a fixed number of tokens
    phrase_words: int = 0
    backchannel_text: str = "Mm-hmm."
