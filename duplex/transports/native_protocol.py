"""The native protocol (`/v1/duplex`) as data: what a client may send, what the server answers.

Sans-I/O: text and bytes in, typed messages and text out, so every rule can be tested without a
socket. `duplex.transports.native` owns the connection and decides *when*; this module knows
*what it looks like*. The protocol is documented in docs/protocol.md.

- Binary frames are PCM16 audio at the client's rate (`decode_audio`).
- Text frames are JSON objects with a string `type`: `session.start` (first, optional) becomes a
  `SessionStart`; every other client event type of `duplex.core.events` a `ControlMessage` for
  `SessionRunner.control`. A message that breaks a rule raises `ProtocolError`, whose `code` goes
  into the `error` event the server sends back; the session goes on.
- Server messages are the core's events as JSON (`encode_event`) and PCM16 binary frames.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplex.base.audio import SAMPLE_RATE as SR
from duplex.core.events import (
    CLIENT_EVENT_TYPES,
    CLIENT_INPUT_TEXT,
    CLIENT_PLAYOUT,
    CLIENT_RESPONSE_TRUNCATE,
    CLIENT_SESSION_START,
    CLIENT_SESSION_UPDATE,
    ServerEvent,
)
from duplex.transports.wire_audio import AudioFormatError, AudioIn

# HTTP routes on the server's port (besides the browser client's static files)
NATIVE_PATH = "/v1/duplex"
HEALTH_PATH = "/healthz"
READY_PATH = "/readyz"  # 503 while draining or full: what a load balancer's health check asks
STATS_PATH = "/stats"
METRICS_PATH = "/metrics"  # Prometheus
CLIENT_SECRETS_PATH = "/v1/realtime/client_secrets"  # POST with the API key: a browser's single-use secret
MAX_TEXT_CHARS = 4000  # default for input.text (the server's limit `max_text_chars` overrides it)

SUPPORTED_RATES = (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000)
MAX_FRAME_BYTES = 64 * 1024  # 0.68 s at 48 kHz; larger frames are refused by the library (1009)
MAX_JSON_BYTES = 16 * 1024

# WebSocket close codes used by the native protocol (and the other WebSocket transports)
CLOSE_POLICY = 1008  # e.g. the client stopped reading its audio
CLOSE_OVERLOAD = 1013  # try again later


class ProtocolError(ValueError):
    """A client message broke the protocol; `code` goes into the error event."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class SessionStart:
    """`session.start`: the client's audio rate (one of `SUPPORTED_RATES`) and session options."""

    sample_rate: int = SR
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ControlMessage:
    """Any other client event, as the JSON object `SessionRunner.control` takes."""

    event: dict[str, Any]

    @property
    def type(self) -> str:
        return str(self.event["type"])


ClientMessage = SessionStart | ControlMessage


def parse_text(message: str, *, started: bool, max_text_chars: int = MAX_TEXT_CHARS) -> ClientMessage:
    """One JSON text frame; `started`: whether the session has started (explicitly or by audio).

    Raises ProtocolError: too_large, bad_json, bad_event, unknown_event, already_started,
    unsupported_sample_rate, bad_option, text_too_long.
    """
    event = parse_json(message)
    kind = event["type"]
    if kind == CLIENT_SESSION_UPDATE and not isinstance(event.get("options") or {}, dict):
        raise ProtocolError("bad_option", "options must be an object")
    if kind in (CLIENT_PLAYOUT, CLIENT_RESPONSE_TRUNCATE):
        turn = event.get("turn_id")
        if "turn_id" in event and (isinstance(turn, bool) or not isinstance(turn, int)):
            raise ProtocolError("bad_event", f"{kind}: turn_id must be an integer")
    if kind == CLIENT_INPUT_TEXT:
        text = event.get("text")
        if isinstance(text, str) and len(text) > max_text_chars:  # the core checks the rest
            raise ProtocolError(
                "text_too_long", f"input.text of {len(text)} characters exceeds {max_text_chars}"
            )
    if event["type"] != CLIENT_SESSION_START:
        return ControlMessage(event)
    if started:
        raise ProtocolError("already_started", "session.start may only be sent once, first")
    rate = event.get("sample_rate", SR)
    if not isinstance(rate, int) or isinstance(rate, bool):
        raise ProtocolError("unsupported_sample_rate", "sample_rate must be an integer")
    options = event.get("options") or {}
    if not isinstance(options, dict):
        raise ProtocolError("bad_option", "options must be an object")
    return SessionStart(check_rate(rate), options)


def parse_json(message: str) -> dict[str, Any]:
    """A client JSON event with a known string `type` (not yet checked further)."""
    if len(message) > MAX_JSON_BYTES:
        raise ProtocolError("too_large", f"JSON message of {len(message)} bytes exceeds {MAX_JSON_BYTES}")
    try:
        event = json.loads(message, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ProtocolError("bad_json", f"malformed JSON: {exc.msg} at position {exc.pos}") from None
    except (RecursionError, ValueError) as exc:  # nesting too deep; NaN / Infinity, which JSON has not
        raise ProtocolError("bad_json", f"malformed JSON: {exc}") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise ProtocolError("bad_event", 'a JSON message must be an object with a string "type"')
    if event["type"] not in CLIENT_EVENT_TYPES:
        raise ProtocolError(
            "unknown_event", f"unknown event type {event['type']!r}; known: {list(CLIENT_EVENT_TYPES)}"
        )
    return event


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: every error code the native protocol sends (docs/protocol.md); the fuzz tests check against it
ERROR_CODES = frozenset(
    {
        "bad_json",
        "bad_event",
        "unknown_event",
        "too_large",
        "already_started",
        "unsupported_sample_rate",
        "bad_option",
        "bad_audio",
        "text_too_long",
        "stage_failed",
        "internal_error",
        "rate_limited",
        "audio_too_fast",
        "session_expired",
        "idle_timeout",
        "session_failed",
        "server_shutdown",
    }
)


def check_rate(rate: int) -> int:
    """The client's sample rate if the server takes it, else ProtocolError (unsupported_sample_rate)."""
    if rate not in SUPPORTED_RATES:
        raise ProtocolError(
            "unsupported_sample_rate",
            f"sample_rate {rate!r} not supported; use one of {list(SUPPORTED_RATES)}",
        )
    return rate


def decode_audio(audio_in: AudioIn, frame: bytes) -> np.ndarray:
    """A binary frame (PCM16 at the client's rate) as 16 kHz float32; ProtocolError (bad_audio) if odd."""
    try:
        return audio_in.decode(frame)
    except AudioFormatError as exc:
        raise ProtocolError("bad_audio", f"audio frame: {exc}") from None


def encode_event(event: ServerEvent) -> str:
    """A server event as the JSON text frame the client receives."""
    return json.dumps(event.to_wire())


def route_of(target: str) -> str:
    """The route of a request target: its path without the query string."""
    return target.split("?", 1)[0]


def static_name(route: str) -> str | None:
    """The browser client's file a GET route asks for (`/` is index.html); None for names never served."""
    name = "index.html" if route == "/" else route.lstrip("/")
    if "/" in name or name.startswith("."):
        return None
    return name
