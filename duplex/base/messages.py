"""The typed contract between the session core and the stages: one input and one output type per call.

The core builds the inputs and reads the outputs; the stages (asr/, dialogue/, tts/) and the test fakes
(duplex/testing/fakes.py) take and return exactly these types, so a renamed field fails at import or at
type check, never silently. The VAD's call is plain: float32 samples in, [(sample_index, p_speech)] out.

| call | input | output |
|---|---|---|
| ASR chunk | `AsrChunk` | `AsrResult` (or None when not asked to transcribe) |
| listen step (user talking) | `ListenStep` | `ListenOutput` (turn probabilities) |
| overlap step (user over the answer) | `OverlapStep` | `OverlapOutput` (interruption or backchannel) |
| respond step (answer, first or next) | `RespondStep` | `RespondOutput` (text delta) |
| TTS input | `TtsInput` | `list[TtsChunk]` (audio with the text it speaks) |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# -- ASR --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AsrChunk:
    """New audio of the open segment (16 kHz float32); `transcribe`: return a transcript now;
    `final`: the segment ends here."""

    samples: Any  # np.ndarray (float32, 16 kHz); Any keeps this layer free of numpy
    transcribe: bool = False
    final: bool = False


@dataclass(frozen=True)
class Word:
    """A recognised word and when it was spoken, in seconds from the start of the segment."""

    word: str
    start: float
    end: float


@dataclass(frozen=True)
class AsrResult:
    """Transcript of the whole open segment so far.

    A streaming recogniser also gives its words with times and the decoder's end-of-utterance
    signal: `eou` once `trailing_silence_ms` of blank frames follow the last word; `no_words` while
    the segment has no word although that much of it was decoded (noise, a hum).
    """

    text: str | None
    is_final: bool
    audio_seconds: float
    compute_seconds: float = 0.0
    words: tuple[Word, ...] = ()
    eou: bool = False
    trailing_silence_ms: float = 0.0
    chunks: int = 0
    no_words: bool = False
    #: how the voice stopped, where the stage has an acoustic end-of-turn cue (`asr.end_of_turn`):
    #: P(the turn is complete) from the transcribed audio's prosody; None without one
    p_complete: float | None = None
    #: how much of the audio the transcript has heard: a streaming encoder's partial transcribes only
    #: the chunks it has encoded (the rest waits for a full chunk, or for the final's flush); None: all
    #: of `audio_seconds`
    heard_seconds: float | None = None


# -- dialogue ---------------------------------------------------------------------------------------

Messages = list[dict[str, str]]


@dataclass
class ListenStep:
    """The user is talking: `messages` is the history before this turn, `text` their words so far."""

    messages: Messages
    text: str
    #: also prefill the slow model (the live service does; evaluating the heads alone need not)
    prefill_slow: bool = True
    #: then also prefill, in the drafter only, the end of the user's turn and the answer header as if
    #: the turn ended here (the next slice rolls it back), so a draft decodes its first word at once;
    #: None: when the relay is on
    preclose: bool | None = None


@dataclass
class OverlapStep:
    """The user said `text` while the service was speaking."""

    text: str


@dataclass
class RespondStep:
    """First step of an answer (`messages` = history ending with the user turn) or a continuation."""

    messages: Messages | None = None
    max_tokens: int = 4
    #: None: the drafter's `relay` option decides
    relay: bool | None = None
    #: the relay's decision forced (evaluation): True commits any non-empty draft prefix, False
    #: discards every draft; None: the verifier decides
    commit: bool | None = None
    #: first step only: decode until the answer holds a first phrase of this many words (the TTS's
    #: rule, `duplex.base.phrases.first_phrase_ready`) instead of `max_tokens` tokens; 0: `max_tokens`
    phrase_words: int = 0
    #: who checks the draft: "exact" (the slow model keeps what it would say itself), "verifier" (the
    #: learned verifier commits a prefix) or "grounded" (the verifier, and only the prefix's head that
    #: restates the caller's words); None: the drafter's `relay_check` option
    relay_check: str | None = None


@dataclass
class ListenOutput:
    """The turn head's P(listen), P(backchannel), P(speak) for the words so far."""

    probs: tuple[float, float, float]
    prefill_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def decision(self) -> int:
        return max(range(3), key=lambda i: self.probs[i])


@dataclass
class OverlapOutput:
    """Speech over the answer: P(interruption) and the policy's verdict (True: stop talking)."""

    p_interrupt: float
    interrupt: bool
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class RelayInfo:
    """What the relay did on an answer's first step: the draft, the committed prefix, the verdict."""

    draft: str
    prefix: str
    p_accept: float
    committed: bool
    draft_s: float
    #: the drafter chose the end of turn (the draft is a whole answer)
    ended: bool = False
    #: the verifier threshold this draft was judged against
    threshold: float = 0.5
    #: why the draft may not be committed whatever its score (`verifier.draft_veto`), or None
    veto: str | None = None


@dataclass
class RespondOutput:
    """Text decoded in this step (complete characters only) and bookkeeping."""

    text: str
    done: bool
    n_tokens: int = 0
    prefill_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    relay: RelayInfo | None = None


# -- TTS --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TtsInput:
    """A text delta from the LLM; `final` marks the end of the response (flushes the rest). `whole`: produce
    all of it in this call (a backchannel), even from a stage that otherwise returns chunk by chunk."""

    text: str
    final: bool = False
    whole: bool = False


@dataclass(frozen=True)
class TtsChunk:
    """Audio (float32 at the stage's rate) and exactly the text it speaks (what was heard on barge-in)."""

    audio: Any  # np.ndarray
    text: str
