"""Typed events of a conversation. Every wire message name of the native protocol lives here.

Server events carry the session id, the turn id they belong to and the session clock time `t`
(seconds). `to_wire()` gives the JSON object sent to clients (documented in docs/protocol.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ServerEvent:
    """Base of every event the service sends; subclasses set `type` (the wire name)."""

    type: ClassVar[str] = ""
    session_id: str
    turn_id: int
    t: float

    def to_wire(self) -> dict[str, Any]:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        body["t"] = round(self.t, 4)
        return {"type": self.type, **body}


@dataclass(frozen=True)
class SessionStarted(ServerEvent):
    type: ClassVar[str] = "session.started"
    input_sample_rate: int = 16000
    output_sample_rate: int = 24000
    profile: str = ""
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SessionUpdated(ServerEvent):
    type: ClassVar[str] = "session.updated"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SpeechStarted(ServerEvent):
    """The VAD heard the user start speaking; `audio_ms` is the position in the input stream."""

    type: ClassVar[str] = "speech.started"
    audio_ms: int = 0


@dataclass(frozen=True)
class SpeechStopped(ServerEvent):
    """The user's turn ended (silence lasted the hangover); `audio_ms` is where speech stopped."""

    type: ClassVar[str] = "speech.stopped"
    audio_ms: int = 0


@dataclass(frozen=True)
class TranscriptPartial(ServerEvent):
    type: ClassVar[str] = "transcript.partial"
    text: str = ""


@dataclass(frozen=True)
class TranscriptFinal(ServerEvent):
    type: ClassVar[str] = "transcript.final"
    text: str = ""


@dataclass(frozen=True)
class ResponseStarted(ServerEvent):
    type: ClassVar[str] = "response.started"


@dataclass(frozen=True)
class ResponseTextDelta(ServerEvent):
    type: ClassVar[str] = "response.text.delta"
    delta: str = ""


@dataclass(frozen=True)
class ResponseAudioStarted(ServerEvent):
    """The first audio of the response is being sent (the client should start playing)."""

    type: ClassVar[str] = "response.audio.started"


@dataclass(frozen=True)
class ResponseDone(ServerEvent):
    """The response ended: status `completed`, `interrupted`, `cancelled` or `failed`.

    `text` is what the model generated, `played_text` what the user actually heard.
    """

    type: ClassVar[str] = "response.done"
    status: str = "completed"
    text: str = ""
    played_text: str = ""


@dataclass(frozen=True)
class Interrupted(ServerEvent):
    """The user barged in: the client must drop any queued audio at once."""

    type: ClassVar[str] = "response.interrupted"
    played_ms: int = 0
    played_text: str = ""


#: the keys of `turn.latency`'s `stages`, in the order they happen: ms from the end of the user's speech
LATENCY_STAGES = ("end_of_turn", "final_transcript", "first_llm_token", "first_tts_chunk", "first_audio")


@dataclass(frozen=True)
class TurnLatency(ServerEvent):
    """Per-turn latency breakdown in milliseconds from the end of the user's speech."""

    type: ClassVar[str] = "turn.latency"
    stages: dict[str, float] = field(default_factory=dict)
    #: what the relay did for this answer: {"committed": bool, "p": verifier score, "draft": text}
    relay: dict[str, Any] = field(default_factory=dict)
    #: the answer was prepared from the user's words while they still talked (session option
    #: `early_answer`), and the final transcript said the same words
    early: bool = False


@dataclass(frozen=True)
class TurnDecision(ServerEvent):
    """The turn head judged the user's words at a pause: `decision` is listen (incomplete, keep
    waiting), backchannel or speak (complete: answer after the short hangover)."""

    type: ClassVar[str] = "turn.decision"
    decision: str = "listen"
    probs: dict[str, float] = field(default_factory=dict)
    text: str = ""


@dataclass(frozen=True)
class Backchannel(ServerEvent):
    """The service gave a short backchannel ("mm-hmm") during a long user turn, without taking it;
    `source` is "service". For user backchannels heard while the service spoke, `source` is "user"
    and the answer goes on."""

    type: ClassVar[str] = "backchannel"
    text: str = ""
    source: str = "service"


@dataclass(frozen=True)
class DtmfReceived(ServerEvent):
    """A telephone keypad digit from a telephony gateway (0-9, *, #, A-D)."""

    type: ClassVar[str] = "input.dtmf"
    digit: str = ""
    source: str = ""  # the transport: "twilio", "audiosocket"


@dataclass(frozen=True)
class ErrorEvent(ServerEvent):
    """Something the client sent was refused, or a stage failed; the session goes on."""

    type: ClassVar[str] = "error"
    code: str = "bad_request"
    message: str = ""


# Client -> server message names of the native protocol.
CLIENT_SESSION_START = "session.start"
CLIENT_SESSION_UPDATE = "session.update"
CLIENT_RESPONSE_CANCEL = "response.cancel"
CLIENT_RESPONSE_TRUNCATE = "response.truncate"  # {"played_ms": N}: the client stopped playback there
CLIENT_PLAYOUT = "playout.position"  # optional: {"played_ms": N} heard so far of the current answer
CLIENT_INPUT_END = "input.end"  # optional: end the user's turn now (e.g. no more audio will follow)
CLIENT_INPUT_CLEAR = "input.clear"  # drop the user's unfinished turn
CLIENT_INPUT_TEXT = "input.text"  # {"text": "..."}: a typed user turn, answered at once
CLIENT_EVENT_TYPES = (
    CLIENT_SESSION_START,
    CLIENT_SESSION_UPDATE,
    CLIENT_RESPONSE_CANCEL,
    CLIENT_RESPONSE_TRUNCATE,
    CLIENT_PLAYOUT,
    CLIENT_INPUT_END,
    CLIENT_INPUT_CLEAR,
    CLIENT_INPUT_TEXT,
)
