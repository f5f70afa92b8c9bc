"""The native protocol (/v1/duplex), without a socket: client text and audio in, typed messages out."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from duplex.core.events import CLIENT_EVENT_TYPES, ErrorEvent, SessionStarted
from duplex.transports.native_protocol import (
    MAX_JSON_BYTES,
    NATIVE_PATH,
    SUPPORTED_RATES,
    ControlMessage,
    ProtocolError,
    SessionStart,
    decode_audio,
    encode_event,
    parse_text,
    route_of,
    static_name,
)
from duplex.transports.wire_audio import AudioIn


def text(message: Any) -> str:
    return json.dumps(message)


def test_session_start_carries_the_rate_and_options():
    parsed = parse_text(
        text({"type": "session.start", "sample_rate": 48000, "options": {"end_of_turn_silence_ms": 700}}),
        started=False,
    )
    assert parsed == SessionStart(48000, {"end_of_turn_silence_ms": 700})
    assert parse_text(text({"type": "session.start"}), started=False) == SessionStart(16000, {})
    assert parse_text(text({"type": "session.start", "options": None}), started=False) == SessionStart()
    assert all(
        parse_text(text({"type": "session.start", "sample_rate": r}), started=False).sample_rate == r
        for r in SUPPORTED_RATES
    )


def test_every_other_client_event_is_a_control_message_as_sent():
    for kind in CLIENT_EVENT_TYPES:
        if kind == "session.start":
            continue
        event = {"type": kind, "played_ms": 120}
        parsed = parse_text(text(event), started=True)
        assert parsed == ControlMessage(event) and parsed.type == kind
    # before any start too: the connection starts the session with the defaults first
    assert parse_text(text({"type": "input.end"}), started=False) == ControlMessage({"type": "input.end"})


@pytest.mark.parametrize(
    ("message", "started", "code", "error"),
    [
        (
            "{not json",
            False,
            "bad_json",
            "malformed JSON: Expecting property name enclosed in double quotes at position 1",
        ),
        ("[1, 2]", False, "bad_event", 'a JSON message must be an object with a string "type"'),
        (text({"type": 5}), False, "bad_event", 'with a string "type"'),
        (text({"kind": "session.start"}), False, "bad_event", 'with a string "type"'),
        (text({"type": "teleport"}), False, "unknown_event", "unknown event type 'teleport'; known: ["),
        ("x" * (MAX_JSON_BYTES + 1), False, "too_large", "JSON message of 16385 bytes exceeds 16384"),
        (
            text({"type": "session.start"}),
            True,
            "already_started",
            "session.start may only be sent once, first",
        ),
        (
            text({"type": "session.start", "sample_rate": "48000"}),
            False,
            "unsupported_sample_rate",
            "sample_rate must be an integer",
        ),
        (
            text({"type": "session.start", "sample_rate": True}),
            False,
            "unsupported_sample_rate",
            "sample_rate must be an integer",
        ),
        (
            text({"type": "session.start", "sample_rate": 12345}),
            False,
            "unsupported_sample_rate",
            "sample_rate 12345 not supported; use one of [8000, 11025, 16000",
        ),
        (text({"type": "session.start", "options": [1]}), False, "bad_option", "options must be an object"),
    ],
)
def test_malformed_client_messages_raise_protocol_errors(message: str, started: bool, code: str, error: str):
    with pytest.raises(ProtocolError) as caught:
        parse_text(message, started=started)
    assert caught.value.code == code
    assert error in str(caught.value)


def test_a_rule_broken_twice_reports_the_first_rule():
    # already started wins over a bad rate: the client sent session.start twice, whatever it holds
    with pytest.raises(ProtocolError) as caught:
        parse_text(text({"type": "session.start", "sample_rate": "x", "options": 3}), started=True)
    assert caught.value.code == "already_started"
    with pytest.raises(ProtocolError) as caught:
        parse_text(text({"type": "session.start", "sample_rate": 12345, "options": 3}), started=False)
    assert caught.value.code == "bad_option"  # the option's type is checked before the rate's value


def test_audio_frames_decode_or_raise_bad_audio():
    audio_in = AudioIn(16000)
    samples = decode_audio(audio_in, np.array([0, 16384, -16384], dtype="<i2").tobytes())
    assert samples.dtype == np.float32 and np.allclose(samples, [0.0, 0.5, -0.5])
    with pytest.raises(ProtocolError) as caught:
        decode_audio(audio_in, b"\x00\x01\x02")
    assert caught.value.code == "bad_audio"
    assert str(caught.value) == "audio frame: audio of 3 bytes: PCM16 needs an even byte count"


def test_server_events_are_their_wire_json():
    started = SessionStarted(
        session_id="s1",
        turn_id=0,
        t=1.5,
        input_sample_rate=48000,
        output_sample_rate=24000,
        profile="cpu",
        options={},
    )
    assert json.loads(encode_event(started)) == started.to_wire()
    error = ErrorEvent(session_id="s1", turn_id=2, t=3.0, code="bad_json", message="malformed JSON")
    wire = json.loads(encode_event(error))
    assert wire["type"] == "error" and wire["code"] == "bad_json" and wire["session_id"] == "s1"


def test_routes_and_static_names():
    assert route_of(NATIVE_PATH + "?token=1") == NATIVE_PATH == "/v1/duplex"
    assert route_of("/healthz") == "/healthz"
    assert static_name("/") == "index.html"
    assert static_name("/app.js") == "app.js"
    for unsafe in ("/../secret", "/.env", "/a/b.js", "//etc/passwd"):
        assert static_name(unsafe) is None, unsafe
