"""Twilio Media Streams protocol, without a socket: messages in and out, marks, framing, signatures."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from codec.g711 import ulaw_to_float
from codec.pcm import float_to_pcm16
from duplex.testing.fakes import decode_tones, tone_speech
from duplex.testing.twilio_sim import twilio_signature as peer_signature
from duplex.transports.twilio_protocol import (
    FRAME_BYTES,
    MAX_MESSAGE_CHARS,
    MAX_PAYLOAD_BYTES,
    BadFrame,
    Connected,
    Dtmf,
    Mark,
    MarkBook,
    Media,
    OutgoingAudio,
    Start,
    Stop,
    clear_message,
    encode_message,
    mark_message,
    media_message,
    parameter_value,
    parse_message,
    short_repr,
    signature_problem,
    signed_url,
    twilio_signature,
    url_variants,
)

PARIS = "paris is the capital of france".split()
MULAW_FORMAT = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}


def text(message: dict[str, Any]) -> str:
    return json.dumps(message)


def start(**body: Any) -> str:
    return text({"event": "start", "streamSid": "MZ1", "start": {"streamSid": "MZ1", **body}})


def media(payload: Any, **fields: Any) -> str:
    return text({"event": "media", "streamSid": "MZ1", "media": {"payload": payload, **fields}})


# -- Twilio -> us ------------------------------------------------------------------------------


def test_a_call_parses_into_typed_messages():
    assert parse_message(
        text({"event": "connected", "protocol": "Call", "version": "1.0.0"}), started=False
    ) == (Connected("Call", "1.0.0"))
    parsed = parse_message(
        start(
            callSid="CA1", accountSid="AC1", mediaFormat=MULAW_FORMAT, customParameters={"lang": "en", "n": 7}
        ),
        started=False,
    )
    assert parsed == Start("MZ1", "CA1", "AC1", {"lang": "en", "n": "7"}, ())
    audio = bytes(range(160))
    assert parse_message(media(base64.b64encode(audio).decode(), track="inbound"), started=True) == Media(
        audio
    )
    assert parse_message(media("//8=", track="inbound_track"), started=True) == Media(b"\xff\xff")
    assert parse_message(text({"event": "dtmf", "dtmf": {"digit": "a"}}), started=True) == Dtmf("A")
    assert parse_message(text({"event": "mark", "mark": {"name": "t1:40:1"}}), started=True) == Mark(
        "t1:40:1"
    )
    assert parse_message(text({"event": "stop", "stop": {}}), started=True) == Stop()


def test_start_takes_the_stream_sid_from_the_envelope_and_warns_about_odd_fields():
    message = text({"event": "start", "streamSid": "MZ9", "start": {"customParameters": ["x"]}})
    parsed = parse_message(message, started=False)
    assert isinstance(parsed, Start)
    assert parsed.stream_sid == "MZ9" and parsed.call_sid == "" and parsed.custom_parameters == {}
    assert len(parsed.warnings) == 2
    assert "mediaFormat None is not" in parsed.warnings[0]
    assert parsed.warnings[1] == "start: customParameters is list, not an object; ignored"
    wrong = parse_message(start(mediaFormat={"encoding": "audio/x-l16", "sampleRate": 16000}), started=False)
    assert isinstance(wrong, Start) and "treating the audio as mu-law 8 kHz" in wrong.warnings[0]


@pytest.mark.parametrize(
    ("message", "started", "error"),
    [
        (b"\x00\x01binary", True, "binary frame of 8 bytes"),
        ("x" * (MAX_MESSAGE_CHARS + 1), True, "characters (> 65536)"),
        (
            "{not json",
            True,
            "malformed JSON (Expecting property name enclosed in double quotes at position 1)",
        ),
        ("[1, 2]", True, 'not a JSON object with a string "event"'),
        ('"media"', True, 'not a JSON object with a string "event"'),
        (text({"event": 5}), True, 'not a JSON object with a string "event"'),
        (text({"event": "teleport"}), True, "unknown event 'teleport'"),
        (start(), True, "a second start message"),
        (text({"event": "start", "start": "MZ1"}), False, "start message without a 'start' object"),
        (text({"event": "start", "start": {}}), False, "start without a streamSid"),
        (text({"event": "start", "start": {"streamSid": 7}}), False, "start without a streamSid"),
        (media("//8="), False, "media before start"),
        (text({"event": "media", "streamSid": "MZ1"}), True, "media message without a 'media' object"),
        (media("//8=", track="outbound"), True, "media on track 'outbound'"),
        (media(7), True, "media without a string payload"),
        (media("not base64!"), True, "media payload is not valid base64"),
        (media(""), True, "empty media payload"),
        (
            media(base64.b64encode(bytes(MAX_PAYLOAD_BYTES + 3)).decode()),
            True,
            "base64 characters (> 8000 bytes)",
        ),
        (text({"event": "dtmf", "dtmf": {"digit": "1"}}), False, "dtmf before start"),
        (text({"event": "dtmf", "dtmf": {"digit": "Z"}}), True, "dtmf digit 'Z' is not one of"),
        (text({"event": "dtmf", "dtmf": {"digit": "12"}}), True, "dtmf digit '12'"),
        (text({"event": "dtmf"}), True, "dtmf message without a 'dtmf' object"),
        (text({"event": "mark", "mark": {"name": 3}}), True, "mark without a string name"),
    ],
)
def test_malformed_messages_raise_bad_frame(message: str | bytes, started: bool, error: str):
    with pytest.raises(BadFrame) as caught:
        parse_message(message, started=started)
    assert error in str(caught.value)


def test_connected_mark_and_stop_need_no_start():
    assert isinstance(parse_message(text({"event": "connected"}), started=False), Connected)
    assert isinstance(parse_message(text({"event": "mark", "mark": {"name": "x"}}), started=False), Mark)
    assert isinstance(parse_message(text({"event": "stop"}), started=False), Stop)


def test_custom_parameters_become_option_values():
    assert parameter_value("700") == 700 and isinstance(parameter_value("700"), int)
    assert parameter_value("0.6") == 0.6
    assert parameter_value("true") == "true"
    assert short_repr("x" * 200) == repr("x" * 200)[:117] + "..."
    assert short_repr({"a": 1}) == "{'a': 1}"


# -- us -> Twilio ------------------------------------------------------------------------------


def test_outgoing_messages_are_compact_json_with_the_stream_sid():
    payload = bytes([0xFF]) * FRAME_BYTES
    assert encode_message(media_message("MZ1", payload)) == (
        '{"event":"media","streamSid":"MZ1","media":{"payload":"' + base64.b64encode(payload).decode() + '"}}'
    )
    assert encode_message(mark_message("MZ1", "t3:40:1")) == (
        '{"event":"mark","streamSid":"MZ1","mark":{"name":"t3:40:1"}}'
    )
    assert encode_message(clear_message("MZ1")) == '{"event":"clear","streamSid":"MZ1"}'


def test_outgoing_audio_repacketises_into_exact_20ms_payloads():
    answer = tone_speech("paris is the capital of france", sr=24000)
    out = OutgoingAudio(24000)
    out.start(turn_id=3)
    rng = np.random.default_rng(0)
    payloads, i = [], 0
    while i < len(answer):  # the core's frames, at odd sizes, so remainders must carry over
        n = int(rng.integers(100, 2000))
        payloads += out.encode(float_to_pcm16(answer[i : i + n]))
        i += n
    payloads += out.flush()
    assert payloads and all(len(p) == FRAME_BYTES for p in payloads)
    assert abs(len(payloads) * FRAME_BYTES - len(answer) / 3) < FRAME_BYTES
    assert out.sent_ms == len(payloads) * 20 and out.turn_id == 3
    assert decode_tones(ulaw_to_float(b"".join(payloads)), 8000) == PARIS
    # barge-in: the partial frame of the old answer never leaks into the next one
    assert len(out.encode(float_to_pcm16(answer[:700]))) == 1  # 233 bytes: one payload, 73 held
    out.drop()
    assert out.flush() == []
    out.start(turn_id=4)
    assert out.sent_ms == 0


def test_mark_book_ignores_marks_dropped_by_clear():
    book = MarkBook()
    a, b, c = book.new(1, 40), book.new(1, 80), book.new(1, 120)
    assert a.startswith("t1:40:") and len({a, b, c}) == 3
    assert book.echoed(a) == (1, 40)
    assert book.clear() == 2  # b and c were still queued at Twilio
    d = book.new(2, 40)
    assert book.echoed(b) is None and book.echoed(c) is None  # echoed at once after the clear: not heard
    assert book.echoed(d) == (2, 40)
    with pytest.raises(BadFrame, match="never sent"):
        book.echoed(a)  # twice
    with pytest.raises(BadFrame):
        book.echoed("forged")


def test_signature_and_signed_url():
    # the example from Twilio's webhook-security docs (URL + sorted POST params; a WebSocket has none)
    uri = "https://mycompany.com/myapp.php?foo=1&bar=2"
    params = {
        "CallSid": "CA1234567890ABCDE",
        "Caller": "+14158675309",
        "Digits": "1234",
        "From": "+14158675309",
        "To": "+18005551212",
    }
    data = uri + "".join(k + params[k] for k in sorted(params))
    assert twilio_signature("12345", data) == "RSOYDt4T1cUTdK1PDd93/VVr8B8="
    assert peer_signature("12345", data) == "RSOYDt4T1cUTdK1PDd93/VVr8B8="  # the peer's own copy
    assert signed_url(None, "h.example:8443", "/v1/twilio?a=1") == "wss://h.example:8443/v1/twilio?a=1"
    assert signed_url("wss://v.example/", "ignored", "/v1/twilio") == "wss://v.example/v1/twilio"
    assert signed_url("wss://v.example/v1/twilio", None, "/v1/twilio?a=1") == "wss://v.example/v1/twilio?a=1"
    assert signed_url(None, None, "/v1/twilio") is None
    assert url_variants("wss://v.example/v1/twilio") == [
        "wss://v.example/v1/twilio",
        "wss://v.example:443/v1/twilio",
    ]
    assert url_variants("wss://v.example:443/x") == ["wss://v.example:443/x", "wss://v.example/x"]
    assert url_variants("wss://v.example:8443/x") == ["wss://v.example:8443/x"]


def test_outgoing_audio_pads_the_last_frame_with_mulaw_silence():
    out = OutgoingAudio(24000)
    out.start(turn_id=1)
    assert out.encode(bytes(2 * 240)) == []  # 10 ms at 24 kHz: 80 bytes of mu-law, held
    (last,) = out.flush()
    assert len(last) == FRAME_BYTES and last[80:] == bytes([0xFF]) * 80
    assert out.sent_ms == 20 and out.flush() == []


def test_mark_book_forgets_the_oldest_marks_beyond_its_limit():
    book = MarkBook(limit=2)
    a, b, c = book.new(1, 20), book.new(1, 40), book.new(1, 60)
    with pytest.raises(BadFrame):
        book.echoed(a)
    assert book.echoed(b) == (1, 40) and book.echoed(c) == (1, 60)


def test_signature_problem_names_what_is_wrong():
    url = "wss://voice.example.com/v1/twilio"
    good = twilio_signature("s3cret", url)
    assert good == peer_signature("s3cret", url)
    ok = {"public_url": None, "host": "voice.example.com", "path": "/v1/twilio"}
    assert signature_problem("s3cret", good, **ok) is None
    # the URL with its default port is signed the same way by some Twilio libraries
    assert (
        signature_problem("s3cret", twilio_signature("s3cret", "wss://voice.example.com:443/v1/twilio"), **ok)
        is None
    )
    assert signature_problem("s3cret", good, public_url=url, host="10.0.0.5:8765", path="/v1/twilio") is None
    assert signature_problem("s3cret", None, **ok) == "no X-Twilio-Signature header"
    assert signature_problem("s3cret", "", **ok) == "no X-Twilio-Signature header"
    assert "no Host header" in signature_problem(
        "s3cret", good, public_url=None, host=None, path="/v1/twilio"
    )
    assert "does not match wss://voice.example.com/v1/twilio?x=1" in signature_problem(
        "s3cret", good, public_url=None, host="voice.example.com", path="/v1/twilio?x=1"
    )
    assert "does not match" in signature_problem("other", good, **ok)
    assert "does not match" in signature_problem("s3cret", "ünïcode", **ok)  # non-ASCII header: no crash
