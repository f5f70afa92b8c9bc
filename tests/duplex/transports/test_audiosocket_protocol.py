"""Asterisk AudioSocket framing, without a socket: bytes in, typed messages out, and the bytes we send."""

from __future__ import annotations

import uuid

import pytest

from duplex.testing.audiosocket_sim import KIND_RATES, message
from duplex.transports.audiosocket_protocol import (
    AUDIO_KINDS,
    KIND_AUDIO,
    Audio,
    AudioSocketError,
    AudioSocketParser,
    CallUuid,
    Dtmf,
    ErrorReport,
    FramingError,
    Hangup,
    TruncatedMessage,
    Unknown,
    audio_messages,
    encode_message,
    frame_bytes,
    hangup_message,
)

CALL = uuid.UUID("12345678-1234-5678-1234-567812345678")
HELLO = message(0x01, CALL.bytes)


def parse(data: bytes, *, eof: bool = False) -> list:
    parser = AudioSocketParser()
    parser.feed(data)
    if eof:
        parser.feed_eof()
    return list(parser.messages())


def test_a_call_parses_into_typed_messages():
    pcm = bytes(range(256)) + bytes(64)
    stream = (
        HELLO
        + message(0x10, pcm)
        + message(0x12, bytes(640))
        + message(0x03, b"5")
        + message(0xFF, b"\x03")
        + message(0x42, b"?")
        + message(0x00)
    )
    assert parse(stream) == [
        CallUuid(CALL.bytes),
        Audio(0x10, pcm),
        Audio(0x12, bytes(640)),
        Dtmf(b"5"),
        ErrorReport(b"\x03"),
        Unknown(0x42, b"?"),
        Hangup(),
    ]
    messages = parse(stream)
    assert messages[0].call_uuid == CALL
    assert messages[1].rate == 8000 and messages[2].rate == 16000
    assert messages[3].digit == "5"
    assert messages[4].code == 3 and messages[4].names == [
        "hangup of calling party",
        "frame forwarding error",
    ]


def test_bytes_may_arrive_in_any_pieces():
    stream = HELLO + message(0x10, bytes(320)) + message(0x03, b"#") + message(0x00)
    parser = AudioSocketParser()
    got = []
    for i in range(len(stream)):  # one byte at a time: no message before it is complete
        parser.feed(stream[i : i + 1])
        got += parser.messages()
    assert got == parse(stream)
    assert parser.buffered == 0 and parser.ended


def test_the_simulators_independent_encoder_agrees():
    assert encode_message(0x10, b"\x01\x02") == message(0x10, b"\x01\x02") == b"\x10\x00\x02\x01\x02"
    assert hangup_message() == message(0x00) == b"\x00\x00\x00"
    assert AUDIO_KINDS == KIND_RATES


@pytest.mark.parametrize(
    ("first", "error"),
    [
        (message(0x10, bytes(320)), "protocol error: message type 0x10 before the call UUID"),
        (message(0x03, b"1"), "protocol error: message type 0x03 before the call UUID"),
        (b"GET / HTTP/1.1\r\n", "protocol error: message type 0x47 before the call UUID"),
        (message(0x01, b"\x01\x02\x03\x04"), "protocol error: call UUID of 4 bytes (expected 16)"),
        (message(0x01, bytes(17)), "protocol error: call UUID of 17 bytes (expected 16)"),
    ],
)
def test_a_wrong_first_message_is_a_framing_error(first: bytes, error: str):
    with pytest.raises(FramingError) as caught:
        parse(first)
    assert str(caught.value) == error


def test_framing_errors_are_decided_from_the_header_alone():
    # the payload of an oversized message never has to arrive: garbage is not waited on
    with pytest.raises(FramingError, match=r"audio message of 8002 bytes \(> 500 ms\)"):
        parse(HELLO + b"\x10" + (8002).to_bytes(2, "big"))
    assert parse(HELLO + message(0x10, bytes(8000))) == [
        CallUuid(CALL.bytes),
        Audio(0x10, bytes(8000)),
    ]  # 500 ms
    with pytest.raises(FramingError, match=r"audio message of 32002 bytes"):
        parse(HELLO + b"\x12" + (32002).to_bytes(2, "big"))  # 16 kHz: 500 ms is 16000 bytes
    with pytest.raises(FramingError, match="before the call UUID"):
        parse(b"\x10\xff\xff")
    with pytest.raises(AudioSocketError):  # both framing errors share a base class
        parse(b"\x01\x00\x05")


def test_good_messages_before_a_bad_one_are_delivered_first():
    parser = AudioSocketParser()
    parser.feed(HELLO + message(0x03, b"7") + b"\x10\xff\xff")
    messages = parser.messages()
    assert next(messages) == CallUuid(CALL.bytes)
    assert next(messages) == Dtmf(b"7")
    with pytest.raises(FramingError):
        next(messages)


def test_the_end_of_the_stream():
    parser = AudioSocketParser()
    parser.feed(HELLO)
    parser.feed_eof()
    assert list(parser.messages()) == [CallUuid(CALL.bytes)]
    assert parser.next_message() is None and parser.eof  # a clean end: between messages
    for cut in (1, 2, 3, 100):  # inside a header, or inside a payload
        with pytest.raises(TruncatedMessage, match="truncated message"):
            parse(HELLO + message(0x10, bytes(320))[:cut], eof=True)
    with pytest.raises(RuntimeError):
        parser.feed(b"\x00")


def test_hangups():
    # before the UUID: the call is over at once, whatever length the header claims
    assert parse(b"\x00\x00\x05") == [Hangup()]
    # after a hangup nothing more is parsed
    assert parse(HELLO + message(0x00) + message(0x10, bytes(320))) == [CallUuid(CALL.bytes), Hangup()]


def test_odd_payloads_are_delivered_for_the_connection_to_judge():
    later = parse(HELLO + message(0x01, b"\x01\x02") + message(0x10, bytes(321)) + message(0x10))
    assert (
        later[1] == CallUuid(b"\x01\x02") and later[1].call_uuid is None
    )  # a later UUID: ignored, not fatal
    assert later[2] == Audio(0x10, bytes(321)) and later[3] == Audio(0x10, b"")
    for payload in (b"xy", b"x", b"", b"\xff"):
        assert Dtmf(payload).digit is None, payload
    assert [Dtmf(d.encode()).digit for d in "0123456789*#abcdABCD"] == list("0123456789*#ABCDABCD")
    assert ErrorReport(b"").code is None
    assert ErrorReport(b"\x08").names == ["unknown"]
    assert ErrorReport(b"\x04").names == ["memory error"]


def test_outgoing_audio_is_cut_into_20ms_messages():
    assert frame_bytes(8000) == 320 and frame_bytes(16000) == 640 and frame_bytes(44100) == 1764
    pcm = bytes(range(256)) * 5  # 1280 bytes: four 20 ms frames at 8 kHz
    data = audio_messages(KIND_AUDIO, pcm, 320)
    assert len(data) == 4 * (3 + 320)
    assert parse(HELLO + data)[1:] == [Audio(0x10, pcm[i : i + 320]) for i in range(0, 1280, 320)]
    assert audio_messages(KIND_AUDIO, b"", 320) == b""
    with pytest.raises(ValueError, match="not a whole number of 320-byte frames"):
        audio_messages(KIND_AUDIO, bytes(321), 320)
