"""Property tests (hypothesis) over every parser of client input: whatever arrives, a parser returns
a message or raises its documented error with a documented code, never anything else.

Bounded example counts keep them fast in CI (`FUZZ` below; set HYPOTHESIS_PROFILE=long for more).
The same inputs over real sockets, with a parallel session, are in test_bad_inputs.py.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duplex.base.config import load_profile
from duplex.core.events import CLIENT_EVENT_TYPES
from duplex.transports.audiosocket_protocol import AudioSocketError, AudioSocketParser, encode_message
from duplex.transports.native_protocol import (
    ERROR_CODES,
    SUPPORTED_RATES,
    ProtocolError,
    decode_audio,
    parse_text,
)
from duplex.transports.realtime_protocol import (
    CLIENT_EVENTS,
    RealtimeConfig,
    RealtimeError,
    append_audio,
    check_event,
    check_truncate_content_index,
    parse_event,
    parse_session_update,
    parse_user_text,
    session_update_body,
    truncate_request,
)
from duplex.transports.twilio_protocol import BadFrame, parse_message
from duplex.transports.wire_audio import AudioFormatError, AudioIn

settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

#: the Realtime error codes this server sends (docs/realtime.md)
REALTIME_CODES = frozenset(
    {
        "invalid_event",
        "invalid_json",
        "invalid_value",
        "invalid_type",
        "unsupported_event",
        "message_too_large",
        "missing_required_parameter",
        "string_above_max_length",
        "unknown_parameter",
        "unsupported_parameter",
        "unsupported_value",
        "item_truncate_invalid_item_id",
        "input_audio_buffer_commit_empty",
        "conversation_already_has_active_response",
        "no_input_to_respond_to",
        "response_cancel_not_active",
        "rate_limited",
        "server_error",
    }
)

# -- strategies: JSON values near the real events ---------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
native_types = st.sampled_from([*CLIENT_EVENT_TYPES, "session.start", "nope", "", "SESSION.START"])
native_fields = st.sampled_from(["sample_rate", "options", "text", "played_ms", "turn_id", "type", "x"])
realtime_types = st.sampled_from([*CLIENT_EVENTS, "conversation.item.delete", "nope", ""])
realtime_fields = st.sampled_from(
    ["session", "audio", "item", "item_id", "content_index", "audio_end_ms", "event_id", "response", "x"]
)


def events(
    types: st.SearchStrategy[str], fields: st.SearchStrategy[str]
) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda t, extra: {"type": t, **extra}, types, st.dictionaries(fields, json_values, max_size=4)
    )


def text_frames(types, fields) -> st.SearchStrategy[str]:
    """Valid-looking events, JSON of any shape, and arbitrary text (including broken JSON)."""
    return (
        events(types, fields).map(json.dumps)
        | json_values.map(json.dumps)
        | st.text(max_size=200)
        | events(types, fields).map(lambda e: json.dumps(e)[: len(json.dumps(e)) // 2])
        | st.sampled_from(["NaN", '{"type": "input.text", "text": Infinity}', "[" * 5000, '{"a":' * 3000])
    )


# -- native --------------------------------------------------------------------------------


@given(text_frames(native_types, native_fields), st.booleans())
def test_native_text_frames(message: str, started: bool) -> None:
    try:
        parsed = parse_text(message, started=started)
    except ProtocolError as exc:
        assert exc.code in ERROR_CODES, exc.code
        return
    assert isinstance(parsed.__class__.__name__, str)


@given(st.binary(max_size=4000), st.sampled_from(SUPPORTED_RATES))
def test_pcm_frames_of_any_length(frame: bytes, rate: int) -> None:
    audio_in = AudioIn(rate)
    try:
        samples = decode_audio(audio_in, frame)
    except ProtocolError as exc:
        assert exc.code == "bad_audio" and len(frame) % 2 == 1
        return
    assert (
        samples.dtype == np.float32
        and np.isfinite(samples).all()
        and np.abs(samples).max(initial=0) <= 2.0  # resampling may overshoot a full-scale click
    )


@given(
    st.lists(st.binary(max_size=600), max_size=8),
    st.sampled_from(["pcm16", "ulaw", "alaw"]),
    st.sampled_from([8000, 16000, 24000, 48000]),
)
def test_wire_audio_streams(frames: list[bytes], encoding: str, rate: int) -> None:
    audio_in = AudioIn(rate, encoding)
    for frame in frames:
        try:
            out = audio_in.decode(frame)
        except AudioFormatError:
            assert encoding == "pcm16" and len(frame) % 2
            continue
        assert np.isfinite(out).all()


# -- Realtime ------------------------------------------------------------------------------

_DEFAULTS = load_profile("cpu").session
_CONFIG = RealtimeConfig.initial("gpt-realtime", _DEFAULTS, "moonshine")


def realtime_validate(message: str | bytes) -> None:
    """What the Realtime connection runs before it touches the session (its sans-I/O part)."""
    ev = parse_event(message)
    kind = check_event(ev, len(message))
    if kind == "session.update":
        parse_session_update(session_update_body(ev), _CONFIG, _DEFAULTS)
    elif kind == "input_audio_buffer.append":
        AudioIn(24000).decode(append_audio(ev)) if len(append_audio(ev)) % 2 == 0 else None
    elif kind == "conversation.item.create":
        parse_user_text(ev.get("item"))
    elif kind == "conversation.item.truncate":
        truncate_request(ev)
        check_truncate_content_index(ev)


@given(text_frames(realtime_types, realtime_fields) | st.binary(max_size=50))
def test_realtime_events(message: str | bytes) -> None:
    try:
        realtime_validate(message)
    except RealtimeError as exc:
        assert exc.code in REALTIME_CODES, exc.code


session_bodies = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["realtime", "transcription", 3]),
        "audio": st.fixed_dictionaries(
            {},
            optional={
                "input": st.fixed_dictionaries(
                    {},
                    optional={
                        "format": json_values
                        | st.fixed_dictionaries(
                            {
                                "type": st.sampled_from(["audio/pcm", "audio/pcmu", "audio/pcma", "audio/x"]),
                                "rate": json_values,
                            }
                        ),
                        "turn_detection": json_values
                        | st.fixed_dictionaries(
                            {
                                "type": st.sampled_from(["server_vad", "semantic_vad", "x"]),
                                "silence_duration_ms": json_values,
                                "threshold": json_values,
                            }
                        ),
                        "transcription": json_values,
                    },
                ),
                "output": st.fixed_dictionaries(
                    {}, optional={"format": json_values, "voice": json_values, "speed": json_values}
                ),
            },
        ),
        "instructions": json_values,
        "tools": json_values,
        "output_modalities": json_values,
        "turn_detection": json_values,
        "input_audio_format": json_values,
    },
)


@given(session_bodies)
def test_realtime_session_update_bodies(body: dict[str, Any]) -> None:
    try:
        new = parse_session_update(body, _CONFIG, _DEFAULTS)
    except RealtimeError as exc:
        assert exc.code in REALTIME_CODES, exc.code
        return
    new.core_overrides(_DEFAULTS)  # what the session applies: in range by construction
    _DEFAULTS.with_overrides(new.core_overrides(_DEFAULTS))


# -- Twilio --------------------------------------------------------------------------------

twilio_events = st.builds(
    lambda kind, body: {"event": kind, **body},
    st.sampled_from(["connected", "start", "media", "dtmf", "mark", "stop", "nope"]),
    st.dictionaries(
        st.sampled_from(["start", "media", "dtmf", "mark", "streamSid", "sequenceNumber"]),
        json_values
        | st.fixed_dictionaries(
            {},
            optional={
                "payload": st.binary(max_size=300).map(lambda b: base64.b64encode(b).decode())
                | st.text(max_size=20),
                "track": st.sampled_from(["inbound", "outbound", "x"]),
                "digit": st.text(max_size=2),
                "name": json_values,
                "streamSid": json_values,
                "mediaFormat": json_values,
                "customParameters": json_values,
            },
        ),
        max_size=3,
    ),
)


@given(st.one_of(twilio_events.map(json.dumps), st.text(max_size=100), st.binary(max_size=20)), st.booleans())
def test_twilio_messages(message: str | bytes, started: bool) -> None:
    try:
        parse_message(message, started=started)
    except BadFrame:
        pass  # documented: logged and skipped (Twilio cannot receive errors); 100 in a row close 1008


# -- AudioSocket ---------------------------------------------------------------------------

frames = st.one_of(
    st.builds(
        lambda k, p: encode_message(k, p),
        st.sampled_from([0x00, 0x01, 0x03, 0x10, 0x11, 0x13, 0x18, 0xFF, 0x42]),
        st.binary(max_size=400),
    ),
    st.binary(max_size=40),
)


@given(st.lists(frames, max_size=8), st.lists(st.integers(1, 64), min_size=1, max_size=8), st.booleans())
def test_audiosocket_byte_streams(messages: list[bytes], cuts: list[int], eof: bool) -> None:
    """Any bytes, split anywhere: messages or AudioSocketError, never another exception."""
    stream = b"".join(messages)
    parser = AudioSocketParser()
    pos, i = 0, 0
    try:
        while pos < len(stream):
            step = cuts[i % len(cuts)]
            parser.feed(stream[pos : pos + step])
            pos, i = pos + step, i + 1
            for message in parser.messages():
                assert message is not None
        if eof:
            parser.feed_eof()
            list(parser.messages())
    except AudioSocketError:
        pass
