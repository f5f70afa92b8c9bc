"""Wire shapes of the OpenAI Realtime API (GA) for `duplex.transports.realtime`: ids, objects, session config.

Pure functions and frozen dataclasses, no I/O, so the shapes can be checked against the `openai`
package's pydantic types in tests. The adapter in `duplex.transports.realtime` decides *when* to send what;
this module only knows *what it looks like*:

- client events: `parse_event` / `check_event` (JSON, known type, size) and the validation of each
  event's fields (`append_audio`, `parse_user_text`, `truncate_request`, ...); a refused one raises
  `RealtimeError`, which becomes an `error` event.
- `RealtimeConfig`: the session configuration a client sees in `session.created` / `session.updated`
  and changes with `session.update` (GA nested `audio.input/output` and the beta top-level names).
- builders for events, conversation items, responses and errors.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import Any

from duplex.base.config import SessionOptions

REALTIME_PATH = "/v1/realtime"
# The server's WebSocket limit (64 KiB) is below what Realtime clients send in one append (OpenAI
# allows 15 MiB); this route raises it for its own connections. Larger messages close with 1009.
MAX_MESSAGE_BYTES = 1024 * 1024  # ~21 s of 24 kHz PCM16 as base64
MAX_EVENT_BYTES = 64 * 1024  # any event but an append
MAX_TEXT_CHARS = 4000  # a typed user turn; longer ones would swamp the dialogue model's context

VOICE = "hibari"  # the one packaged voice; `voice` in session.update is accepted and ignored
MAX_VAD_MS = 10_000  # the core's limit for end_of_turn_silence_ms / barge_in_min_speech_ms
SEMANTIC_EAGERNESS_MS = {"low": 1000, "medium": None, "auto": None, "high": 300}  # None: the profile default


class RealtimeError(ValueError):
    """A client event was refused; becomes an `error` event, and the session goes on."""

    def __init__(
        self, code: str, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.code = code
        self.param = param
        self.kind = kind


# -- client events -------------------------------------------------------------------------

#: the client events this server serves
CLIENT_EVENTS = (
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "conversation.item.create",
    "conversation.item.truncate",
    "response.create",
    "response.cancel",
)
#: client events of the API this server refuses, and why
UNSUPPORTED_EVENTS = {
    "conversation.item.delete": "deleting items is not supported",
    "conversation.item.retrieve": "retrieving items is not supported",
    "output_audio_buffer.clear": "output_audio_buffer.clear is WebRTC/SIP only; use response.cancel",
    "transcription_session.update": "transcription sessions are not supported",
}


def parse_event(message: str | bytes) -> dict[str, Any]:
    """One client frame as a JSON object with a string `type` (its type not yet checked)."""
    if isinstance(message, bytes):
        raise RealtimeError(
            "invalid_event", "binary frames are not part of the Realtime API: send JSON text events"
        )
    try:
        ev = json.loads(message, parse_constant=_no_constant)  # NaN / Infinity are not JSON
    except (ValueError, RecursionError) as exc:
        raise RealtimeError("invalid_json", f"malformed JSON: {exc}") from None
    if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
        raise RealtimeError("invalid_event", 'an event must be a JSON object with a string "type"', "type")
    return ev


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def client_event_id(ev: dict[str, Any]) -> str | None:
    """The client's `event_id`, which an `error` caused by the event names."""
    value = ev.get("event_id")
    return value if isinstance(value, str) else None


def check_event(ev: dict[str, Any], size: int) -> str:
    """The type of a parsed event of `size` characters, if this server serves it; else RealtimeError."""
    kind = str(ev["type"])
    if kind not in CLIENT_EVENTS:
        if kind in UNSUPPORTED_EVENTS:
            raise RealtimeError("unsupported_event", UNSUPPORTED_EVENTS[kind], "type")
        raise RealtimeError(
            "invalid_value",
            f"unknown event type {kind!r}; supported: {sorted(CLIENT_EVENTS)}",
            "type",
        )
    if kind != "input_audio_buffer.append" and size > MAX_EVENT_BYTES:
        raise RealtimeError("message_too_large", f"{kind} of {size} bytes exceeds {MAX_EVENT_BYTES}")
    return kind


def session_update_body(ev: dict[str, Any]) -> dict[str, Any]:
    """The `session` object of a session.update (see `parse_session_update` for its fields)."""
    session = ev.get("session")
    if not isinstance(session, dict):
        raise RealtimeError("missing_required_parameter", "session.update needs a session object", "session")
    return session


def append_audio(ev: dict[str, Any]) -> bytes:
    """The audio bytes of an input_audio_buffer.append (in the session's input format)."""
    audio = ev.get("audio")
    if not isinstance(audio, str):
        raise RealtimeError(
            "missing_required_parameter", "input_audio_buffer.append needs base64 audio", "audio"
        )
    try:
        return base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError("invalid_value", "audio is not valid base64", "audio") from None


def parse_user_text(item: Any, max_chars: int = MAX_TEXT_CHARS) -> tuple[str | None, str]:
    """(id or None, text) of a user message item made of input_text parts; anything else is refused."""
    if not isinstance(item, dict):
        raise RealtimeError(
            "missing_required_parameter", "conversation.item.create needs an item object", "item"
        )
    if item.get("type", "message") != "message":
        raise RealtimeError(
            "unsupported_value",
            f"item type {item.get('type')!r} is not supported (no function calling): only user messages",
            "item.type",
        )
    if item.get("role") != "user":
        raise RealtimeError(
            "unsupported_value",
            f"{item.get('role')!r} messages are not supported: only user "
            "messages with input_text (session instructions are not applied)",
            "item.role",
        )
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise RealtimeError(
            "missing_required_parameter", "item.content must be a non-empty list", "item.content"
        )
    texts = []
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") != "input_text"
            or not isinstance(part.get("text"), str)
        ):
            raise RealtimeError(
                "unsupported_value",
                "only input_text content parts with a string text are supported",
                "item.content",
            )
        texts.append(part["text"])
    text = " ".join(texts).strip()
    if not text:
        raise RealtimeError("invalid_value", "the message text is empty", "item.content")
    if len(text) > max_chars:
        raise RealtimeError(
            "string_above_max_length",
            f"a message of {len(text)} characters exceeds {max_chars}",
            "item.content",
        )
    item_id = item.get("id")
    if item_id is not None and (not isinstance(item_id, str) or not item_id):
        raise RealtimeError("invalid_type", "item.id must be a non-empty string", "item.id")
    return item_id, text


def truncate_request(ev: dict[str, Any]) -> tuple[str, int]:
    """(item_id, audio_end_ms) of a conversation.item.truncate (whether the item exists is not checked)."""
    item_id, audio_end_ms = ev.get("item_id"), ev.get("audio_end_ms")
    if not isinstance(item_id, str):
        raise RealtimeError(
            "missing_required_parameter", "conversation.item.truncate needs item_id", "item_id"
        )
    if not isinstance(audio_end_ms, int) or isinstance(audio_end_ms, bool) or audio_end_ms < 0:
        raise RealtimeError("invalid_value", "audio_end_ms must be an integer >= 0", "audio_end_ms")
    return item_id, audio_end_ms


def check_truncate_content_index(ev: dict[str, Any]) -> None:
    """An answer has one content part: a truncate may only name content_index 0."""
    if ev.get("content_index", 0) != 0:
        raise RealtimeError(
            "invalid_value", "an answer has one content part: content_index must be 0", "content_index"
        )


# -- server events -------------------------------------------------------------------------


def encode_event(payload: dict[str, Any]) -> str:
    """A server event as the compact JSON text frame the client receives."""
    return json.dumps(payload, separators=(",", ":"))


def new_id(prefix: str) -> str:
    """An OpenAI-style id (`event_...`, `item_...`, `resp_...`): unique without coordination."""
    return f"{prefix}_{uuid.uuid4().hex[:22]}"


def event(type_: str, **fields: Any) -> dict[str, Any]:
    """A server event with a fresh `event_id`."""
    return {"type": type_, "event_id": new_id("event"), **fields}


def error_event(
    code: str,
    message: str,
    *,
    param: str | None = None,
    kind: str = "invalid_request_error",
    client_event_id: str | None = None,
) -> dict[str, Any]:
    """`error` as OpenAI sends it: `error.event_id` names the client event that caused it, if any."""
    return event(
        "error",
        error={"type": kind, "code": code, "message": message, "param": param, "event_id": client_event_id},
    )


# -- audio formats -----------------------------------------------------------------------


@dataclass(frozen=True)
class AudioFormat:
    """A Realtime audio format and what it means on the wire for `AudioIn` / `AudioOut`."""

    type: str  # "audio/pcm", "audio/pcmu", "audio/pcma"
    encoding: str  # duplex.transports.common encoding: "pcm16", "ulaw", "alaw"
    rate: int

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "rate": self.rate} if self.type == "audio/pcm" else {"type": self.type}


PCM = AudioFormat("audio/pcm", "pcm16", 24000)
FORMATS = {
    f.type: f for f in (PCM, AudioFormat("audio/pcmu", "ulaw", 8000), AudioFormat("audio/pcma", "alaw", 8000))
}
BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}


def parse_format(value: Any, param: str) -> AudioFormat:
    """GA `{"type": "audio/pcmu"}` (PCM only at rate 24000) or a beta name like `"g711_ulaw"`."""
    if isinstance(value, str):
        name = BETA_FORMATS.get(value, value)
        rate = None
    elif isinstance(value, dict):
        name, rate = value.get("type", "audio/pcm"), value.get("rate")
    else:
        raise RealtimeError("invalid_type", f'{param} must be an object like {{"type": "audio/pcm"}}', param)
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        known = sorted(FORMATS) + sorted(BETA_FORMATS)
        raise RealtimeError("invalid_value", f"unsupported audio format {name!r}; use one of {known}", param)
    if rate is not None and rate != fmt.rate:
        raise RealtimeError(
            "invalid_value", f"{fmt.type} is only supported at rate {fmt.rate}, not {rate!r}", param
        )
    return fmt


# -- turn detection ----------------------------------------------------------------------


@dataclass(frozen=True)
class TurnDetection:
    """Server VAD settings; `semantic_vad` is served by the same VAD with eagerness as a hangover."""

    type: str = "server_vad"
    threshold: float = 0.5
    silence_duration_ms: int = 500
    prefix_padding_ms: int = 200
    create_response: bool = True
    interrupt_response: bool = True
    eagerness: str = "auto"

    def to_wire(self) -> dict[str, Any]:
        common = {
            "type": self.type,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
        }
        if self.type == "semantic_vad":
            return {**common, "eagerness": self.eagerness}
        return {
            **common,
            "threshold": self.threshold,
            "silence_duration_ms": self.silence_duration_ms,
            "prefix_padding_ms": self.prefix_padding_ms,
            "idle_timeout_ms": None,
        }


def default_turn_detection(defaults: SessionOptions) -> TurnDetection:
    return TurnDetection(
        threshold=defaults.vad_threshold,
        silence_duration_ms=defaults.end_of_turn_silence_ms,
        prefix_padding_ms=defaults.pre_roll_ms,
    )


def parse_turn_detection(value: Any, defaults: SessionOptions, param: str) -> TurnDetection | None:
    """`null` = manual turns; else a whole new setting: missing fields take the defaults, as at OpenAI."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RealtimeError("invalid_type", f"{param} must be an object or null", param)
    base = default_turn_detection(defaults)
    kind = value.get("type", "server_vad")
    if kind not in ("server_vad", "semantic_vad"):
        raise RealtimeError(
            "invalid_value",
            f"{param}.type must be 'server_vad' or 'semantic_vad', not {kind!r}",
            f"{param}.type",
        )
    flags = {
        name: _bool(value, name, getattr(base, name), param)
        for name in ("create_response", "interrupt_response")
    }
    if kind == "semantic_vad":
        eagerness = value.get("eagerness", "auto")
        if eagerness not in SEMANTIC_EAGERNESS_MS:
            raise RealtimeError(
                "invalid_value",
                f"{param}.eagerness must be one of {list(SEMANTIC_EAGERNESS_MS)}",
                f"{param}.eagerness",
            )
        silence = SEMANTIC_EAGERNESS_MS[eagerness] or base.silence_duration_ms
        return dataclasses.replace(base, type=kind, eagerness=eagerness, silence_duration_ms=silence, **flags)
    threshold = value.get("threshold", base.threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise RealtimeError(
            "invalid_value", f"{param}.threshold must be a number in [0, 1]", f"{param}.threshold"
        )
    silence = _ms(value, "silence_duration_ms", base.silence_duration_ms, param)
    _ms(value, "prefix_padding_ms", base.prefix_padding_ms, param)  # checked; the core's pre-roll is fixed
    # the VAD's usable range is [0.05, 0.95]: the ends would mean "always" / "never speech"
    threshold = min(max(float(threshold), 0.05), 0.95)
    return dataclasses.replace(base, threshold=threshold, silence_duration_ms=silence, **flags)


def _bool(obj: dict[str, Any], name: str, default: bool, param: str) -> bool:
    value = obj.get(name, default)
    if not isinstance(value, bool):
        raise RealtimeError("invalid_type", f"{param}.{name} must be a boolean", f"{param}.{name}")
    return value


def _ms(obj: dict[str, Any], name: str, default: int, param: str) -> int:
    value = obj.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_VAD_MS:
        raise RealtimeError(
            "invalid_value", f"{param}.{name} must be an integer in [0, {MAX_VAD_MS}]", f"{param}.{name}"
        )
    return value


# -- session configuration ---------------------------------------------------------------


@dataclass(frozen=True)
class RealtimeConfig:
    """What a Realtime client may configure, as this server applies it."""

    model: str = "duplex"
    instructions: str = ""  # accepted and reported, not applied (the dialogue model has its own prompt)
    input_format: AudioFormat = PCM
    output_format: AudioFormat = PCM
    turn_detection: TurnDetection | None = None
    transcription_model: str = "moonshine"

    @classmethod
    def initial(cls, model: str, defaults: SessionOptions, transcription_model: str) -> RealtimeConfig:
        return cls(
            model=model,
            turn_detection=default_turn_detection(defaults),
            transcription_model=transcription_model,
        )

    @property
    def manual(self) -> bool:
        """turn_detection null: the client ends turns with input_audio_buffer.commit."""
        return self.turn_detection is None

    def core_overrides(self, defaults: SessionOptions) -> dict[str, Any]:
        """The session core's options that realise this configuration.

        The core always endpoints with its VAD; manual turns and `interrupt_response: false` are
        approximated with the longest hangover / barge-in span the core allows (10 s).
        """
        td = self.turn_detection
        if td is None:
            return {
                "end_of_turn_silence_ms": MAX_VAD_MS,
                "barge_in_min_speech_ms": MAX_VAD_MS,
                "vad_threshold": defaults.vad_threshold,
            }
        barge_in = defaults.barge_in_min_speech_ms if td.interrupt_response else MAX_VAD_MS
        return {
            "end_of_turn_silence_ms": td.silence_duration_ms,
            "vad_threshold": td.threshold,
            "barge_in_min_speech_ms": barge_in,
            # Realtime clients expect speech_started to cancel the response (reason turn_detected):
            # no holding the answer while the overlap head tells a backchannel from an interruption
            "max_backchannel_ms": barge_in,
        }

    def to_wire(self, session_id: str) -> dict[str, Any]:
        """The GA session object (`type: realtime`) of session.created / session.updated."""
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": session_id,
            "model": self.model,
            "output_modalities": ["audio"],
            "instructions": self.instructions,
            "audio": {
                "input": {
                    "format": self.input_format.to_wire(),
                    "transcription": {"model": self.transcription_model},
                    "noise_reduction": None,
                    "turn_detection": None if self.turn_detection is None else self.turn_detection.to_wire(),
                },
                "output": {"format": self.output_format.to_wire(), "voice": VOICE, "speed": 1.0},
            },
            "tools": [],
            "tool_choice": "auto",
            "max_output_tokens": "inf",
            "tracing": None,
            "truncation": "auto",
            "prompt": None,
        }


def parse_session_update(
    session: dict[str, Any], cfg: RealtimeConfig, defaults: SessionOptions
) -> RealtimeConfig:
    """Apply a `session.update` body to `cfg`; raises RealtimeError and changes nothing if any field is bad.

    Understands the GA shape (`audio.input.format`, `audio.input.turn_detection`, ...) and the beta
    top-level names (`input_audio_format: "g711_ulaw"`, `turn_detection`, `modalities`). Fields this
    server cannot honour in a way a client would notice (voice, speed, noise reduction, tracing,
    ...) are ignored; the ones whose absence would break a client (tools, text-only output, a
    transcription session) are refused.
    """
    kind = session.get("type", "realtime")
    if kind != "realtime":
        raise RealtimeError(
            "unsupported_value", f"session.type {kind!r} is not supported; only 'realtime'", "session.type"
        )
    changes: dict[str, Any] = {}
    audio = _obj(session, "audio", "session.audio")
    audio_in = _obj(audio, "input", "session.audio.input")
    audio_out = _obj(audio, "output", "session.audio.output")
    for obj, key, param, field in (
        (session, "input_audio_format", "session.input_audio_format", "input_format"),
        (audio_in, "format", "session.audio.input.format", "input_format"),
        (session, "output_audio_format", "session.output_audio_format", "output_format"),
        (audio_out, "format", "session.audio.output.format", "output_format"),
    ):
        if obj.get(key) is not None:
            changes[field] = parse_format(obj[key], param)
    for obj, param in ((session, "session.turn_detection"), (audio_in, "session.audio.input.turn_detection")):
        if "turn_detection" in obj:
            changes["turn_detection"] = parse_turn_detection(obj["turn_detection"], defaults, param)
    if "instructions" in session:
        if not isinstance(session["instructions"], str):
            raise RealtimeError(
                "invalid_type", "session.instructions must be a string", "session.instructions"
            )
        changes["instructions"] = session["instructions"]
    _check_unsupported(session)
    return dataclasses.replace(cfg, **changes)


def _obj(parent: dict[str, Any], key: str, param: str) -> dict[str, Any]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RealtimeError("invalid_type", f"{param} must be an object", param)
    return value


def _check_unsupported(session: dict[str, Any]) -> None:
    for key in ("output_modalities", "modalities"):
        modalities = session.get(key)
        if modalities is not None and (not isinstance(modalities, list) or "audio" not in modalities):
            raise RealtimeError(
                "unsupported_value",
                f"session.{key} must include 'audio': this server always "
                "answers with audio and its transcript",
                f"session.{key}",
            )
    tools = session.get("tools")
    if tools:
        raise RealtimeError(
            "unsupported_value",
            "function calling is not supported: session.tools must be empty",
            "session.tools",
        )


# -- conversation items and responses ----------------------------------------------------


def user_audio_item(item_id: str, transcript: str | None) -> dict[str, Any]:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "user",
        "status": "completed",
        "content": [{"type": "input_audio", "transcript": transcript}],
    }


def user_text_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "user",
        "status": "completed",
        "content": [{"type": "input_text", "text": text}],
    }


def assistant_item(item_id: str, status: str, transcript: str | None = None) -> dict[str, Any]:
    """An answer; while in progress it has no content yet (as OpenAI announces it)."""
    content = [] if transcript is None else [{"type": "output_audio", "transcript": transcript}]
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def audio_part(transcript: str) -> dict[str, Any]:
    return {"type": "audio", "transcript": transcript}


def response_status(core_status: str, by_client: bool) -> tuple[str, dict[str, Any] | None]:
    """The core's completed / interrupted / cancelled / failed as a response's status and status_details.

    `by_client`: an interrupted or cancelled answer was stopped by the client (cancel / truncate),
    not by the user talking over it (turn_detected).
    """
    if core_status == "completed":
        return "completed", None
    if core_status == "failed":
        error = {"type": "server_error", "code": "stage_failed", "message": "a model stage failed"}
        return "failed", {"type": "failed", "error": error}
    return "cancelled", {
        "type": "cancelled",
        "reason": "client_cancelled" if by_client else "turn_detected",
    }


def response_object(
    response_id: str,
    status: str,
    output: list[dict[str, Any]],
    output_format: AudioFormat,
    status_details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `response` of response.created / response.done. Token usage is not counted: zeros."""
    return {
        "object": "realtime.response",
        "id": response_id,
        "status": status,
        "status_details": status_details,
        "output": output,
        "output_modalities": ["audio"],
        "audio": {"output": {"format": output_format.to_wire(), "voice": VOICE}},
        "max_output_tokens": "inf",
        "metadata": None,
        "usage": {"total_tokens": 0, "input_tokens": 0, "output_tokens": 0}
        if status != "in_progress"
        else None,
    }
