"""Bad client input, one case per row, each with the error it must get; sent over real sockets while a
parallel session asks a question: every bad input is answered, the server never crashes, and the
parallel answer is unaffected. Then a seeded mutation fuzzer does the same with random messages.

Twilio cannot receive errors and AudioSocket has none for this, so their rows check the protocol
modules' documented refusal (logged and skipped, or the call hung up) instead.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import uuid
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import connect

from duplex.base.config import load_profile
from duplex.core.session import SR
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.fakes import fake_stages, scripted_answer, tone_speech
from duplex.transports.audiosocket_protocol import (
    KIND_AUDIO,
    KIND_DTMF,
    KIND_UUID,
    AudioSocketParser,
    Dtmf,
    FramingError,
    TruncatedMessage,
    Unknown,
    encode_message,
)
from duplex.transports.native import DuplexServer, ServerSettings
from duplex.transports.native_protocol import ERROR_CODES
from duplex.transports.realtime import mount_realtime
from duplex.transports.twilio_protocol import BadFrame, parse_message

QUESTION = "what is the capital of france"
ANSWER = "paris is the capital of france"


def j(obj: Any) -> str:
    return json.dumps(obj)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# (message, expected error code); sent after session.start on /v1/duplex
NATIVE_BAD: list[tuple[str | bytes, str]] = [
    ("{not json", "bad_json"),
    ("", "bad_json"),
    ('{"type": "input.text", "text": NaN}', "bad_json"),
    ('{"type": "playout.position", "played_ms": Infinity}', "bad_json"),
    ("[" * 3000 + "]" * 3000, "bad_json"),
    ("[1, 2]", "bad_event"),
    ("null", "bad_event"),
    ('"session.start"', "bad_event"),
    (j({"type": 5}), "bad_event"),
    (j({"kind": "input.end"}), "bad_event"),
    (j({"type": "nope"}), "unknown_event"),
    (j({"type": "SESSION.UPDATE"}), "unknown_event"),
    (j({"type": "session.start"}), "already_started"),
    (j({"type": "session.start", "sample_rate": 12345}), "already_started"),
    (j({"type": "session.update", "options": {"nope": 1}}), "bad_option"),
    (j({"type": "session.update", "options": {"vad_threshold": 2}}), "bad_option"),
    (j({"type": "session.update", "options": {"relay": "yes"}}), "bad_option"),
    (j({"type": "session.update", "options": {"end_of_turn_silence_ms": -5}}), "bad_option"),
    (j({"type": "session.update", "options": [1, 2]}), "bad_option"),
    (j({"type": "session.update", "options": "fast"}), "bad_option"),
    (j({"type": "input.text", "text": 5}), "bad_event"),
    (j({"type": "input.text", "text": "   "}), "bad_event"),
    (j({"type": "input.text"}), "bad_event"),
    (j({"type": "input.text", "text": "x" * 4001}), "text_too_long"),
    (j({"type": "playout.position", "played_ms": "x"}), "bad_event"),
    (j({"type": "playout.position", "played_ms": -1}), "bad_event"),
    (j({"type": "playout.position", "played_ms": 5, "turn_id": "abc"}), "bad_event"),
    (j({"type": "playout.position", "played_ms": 5, "turn_id": None}), "bad_event"),
    (j({"type": "response.truncate", "played_ms": True}), "bad_event"),
    (j({"type": "response.truncate", "played_ms": 100, "turn_id": [1]}), "bad_event"),
    (j({"type": "response.truncate", "played_ms": 100, "turn_id": 99}), "bad_event"),
    (j({"type": "input.text", "text": "y" * 20000}), "too_large"),
    (b"\x01", "bad_audio"),
    (b"\x00\x00\x00", "bad_audio"),
]
# a session.start that is first, but wrong
NATIVE_BAD_START: list[tuple[str, str]] = [
    (j({"type": "session.start", "sample_rate": 12345}), "unsupported_sample_rate"),
    (j({"type": "session.start", "sample_rate": "16000"}), "unsupported_sample_rate"),
    (j({"type": "session.start", "sample_rate": True}), "unsupported_sample_rate"),
    (j({"type": "session.start", "options": [1]}), "bad_option"),
    (j({"type": "session.start", "options": {"vad_threshold": "high"}}), "bad_option"),
]

_ITEM = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
# (message, expected error code) on /v1/realtime
REALTIME_BAD: list[tuple[str | bytes, str]] = [
    (b"\x00\x01", "invalid_event"),
    ("{bad", "invalid_json"),
    ('{"type": "response.create", "x": NaN}', "invalid_json"),
    ("[]", "invalid_event"),
    (j({"type": 1}), "invalid_event"),
    (j({"type": "nope"}), "invalid_value"),
    (j({"type": "conversation.item.delete", "item_id": "x"}), "unsupported_event"),
    (j({"type": "transcription_session.update"}), "unsupported_event"),
    (j({"type": "session.update"}), "missing_required_parameter"),
    (j({"type": "session.update", "session": {"tools": [{"type": "function"}]}}), "unsupported_value"),
    (j({"type": "session.update", "session": {"output_modalities": ["text"]}}), "unsupported_value"),
    (
        j({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/x"}}}}}),
        "invalid_value",
    ),
    (j({"type": "session.update", "session": {"instructions": "x" * 70000}}), "message_too_large"),
    (j({"type": "input_audio_buffer.append"}), "missing_required_parameter"),
    (j({"type": "input_audio_buffer.append", "audio": "***"}), "invalid_value"),
    (j({"type": "input_audio_buffer.append", "audio": b64(b"\x00\x01\x02")}), "invalid_value"),
    (j({"type": "input_audio_buffer.commit"}), "input_audio_buffer_commit_empty"),
    (j({"type": "conversation.item.create", "item": "hi"}), "missing_required_parameter"),
    (j({"type": "conversation.item.create", "item": {**_ITEM, "content": []}}), "missing_required_parameter"),
    (
        j(
            {
                "type": "conversation.item.create",
                "item": {**_ITEM, "content": [{"type": "input_text", "text": " "}]},
            }
        ),
        "invalid_value",
    ),
    (j({"type": "conversation.item.create", "item": {**_ITEM, "id": 5}}), "invalid_type"),
    (
        j(
            {
                "type": "conversation.item.create",
                "item": {**_ITEM, "content": [{"type": "input_text", "text": "z" * 4001}]},
            }
        ),
        "string_above_max_length",
    ),
    (
        j(
            {
                "type": "conversation.item.truncate",
                "item_id": "item_x",
                "content_index": 0,
                "audio_end_ms": 10,
            }
        ),
        "item_truncate_invalid_item_id",
    ),
    (j({"type": "response.create"}), "no_input_to_respond_to"),
    (j({"type": "response.cancel"}), "response_cancel_not_active"),
]

# (message, started, what the refusal says): Twilio's messages are logged and skipped
TWILIO_BAD: list[tuple[str | bytes, bool, str]] = [
    (b"\x00", True, "binary frame"),
    ("{", True, "malformed JSON"),
    (j({"event": 1}), True, 'string "event"'),
    (j({"event": "media", "media": {"payload": b64(b"\xff" * 160)}}), False, "media before start"),
    (j({"event": "media", "media": {"payload": "!!"}}), True, "not valid base64"),
    (j({"event": "media", "media": {"payload": ""}}), True, "empty media payload"),
    (j({"event": "media", "media": {"payload": b64(b"\x00"), "track": "outbound"}}), True, "inbound track"),
    (j({"event": "dtmf", "dtmf": {"digit": "Z"}}), True, "is not one of"),
    (j({"event": "start", "start": {}}), False, "without a streamSid"),
    (j({"event": "start", "start": {"streamSid": "MZ1"}}), True, "a second start"),
    (j({"event": "mark", "mark": {"name": 5}}), True, "without a string name"),
    (j({"event": "teleport"}), True, "unknown event"),
]

_UUID = encode_message(KIND_UUID, uuid.uuid4().bytes)
# (byte stream, eof, the exception or message kind it must give)
AUDIOSOCKET_BAD: list[tuple[bytes, bool, type]] = [
    (encode_message(KIND_AUDIO, b"\x00" * 320), False, FramingError),  # audio before the UUID
    (encode_message(KIND_UUID, b"\x00" * 5), False, FramingError),  # a short UUID
    (_UUID + bytes([KIND_AUDIO]) + (9000).to_bytes(2, "big"), False, FramingError),  # oversized audio
    (_UUID + encode_message(KIND_AUDIO, b"\x00" * 320)[:100], True, TruncatedMessage),
    (_UUID + encode_message(KIND_DTMF, b"Z"), False, Dtmf),  # digit None: logged and skipped
    (_UUID + encode_message(0x42, b"??"), False, Unknown),  # skipped
]


def test_at_least_fifty_distinct_bad_inputs() -> None:
    rows = (  # an input is distinct per transport and per point in the session (first or not)
        [("native", m) for m, _ in NATIVE_BAD]
        + [("native-first", m) for m, _ in NATIVE_BAD_START]
        + [("realtime", m) for m, _ in REALTIME_BAD]
        + [("twilio", m, s) for m, s, _ in TWILIO_BAD]
        + [("audiosocket", m, e) for m, e, _ in AUDIOSOCKET_BAD]
        + [("frame", f) for f, _ in BAD_FRAMES]
    )
    assert len(set(map(repr, rows))) == len(rows) >= 50
    assert {code for _, code in NATIVE_BAD + NATIVE_BAD_START} <= ERROR_CODES


@pytest.mark.parametrize(("message", "started", "says"), TWILIO_BAD)
def test_twilio_bad_messages(message: str | bytes, started: bool, says: str) -> None:
    with pytest.raises(BadFrame, match=says):
        parse_message(message, started=started)


@pytest.mark.parametrize(("stream", "eof", "expected"), AUDIOSOCKET_BAD)
def test_audiosocket_bad_streams(stream: bytes, eof: bool, expected: type) -> None:
    parser = AudioSocketParser()
    parser.feed(stream)
    if eof:
        parser.feed_eof()
    if issubclass(expected, Exception):
        with pytest.raises(expected):
            list(parser.messages())
    else:
        last = list(parser.messages())[-1]
        assert isinstance(last, expected)
        assert not isinstance(last, Dtmf) or last.digit is None


# -- over sockets, with a parallel session ---------------------------------------------------


@pytest.fixture
async def server():
    limits = ServiceLimits(max_sessions=6, control_per_s=1000, control_burst=1000)
    service = DuplexService(load_profile("cpu"), fake_stages(scripted_answer), limits=limits)
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    mount_realtime(srv)
    await srv.start()
    yield srv
    await srv.close()
    service.close()


async def bystander(port: int) -> str:
    """A normal session asking a question while the bad inputs arrive; returns its answer."""
    async with connect(f"ws://127.0.0.1:{port}/v1/duplex") as ws:
        await ws.send(j({"type": "session.start"}))
        audio = np.concatenate(
            [np.zeros(SR // 4, np.float32), tone_speech(QUESTION), np.zeros(SR, np.float32)]
        )
        pcm = (audio * 32767).astype("<i2")
        for i in range(0, len(pcm), SR // 50):
            await ws.send(pcm[i : i + SR // 50].tobytes())
            await asyncio.sleep(0.01)
        async with asyncio.timeout(20):
            while True:
                msg = await ws.recv()
                if isinstance(msg, str):
                    ev = json.loads(msg)
                    assert ev["type"] != "error", ev
                    if ev["type"] == "response.done":
                        return str(ev["text"])


async def next_error(ws, limit_s: float = 5.0) -> dict[str, Any]:
    async with asyncio.timeout(limit_s):
        while True:
            msg = await ws.recv()
            if isinstance(msg, str) and json.loads(msg)["type"] == "error":
                return json.loads(msg)


async def native_rows(port: int) -> list[tuple[str, str]]:
    got = []
    for message, _ in NATIVE_BAD_START:
        async with connect(f"ws://127.0.0.1:{port}/v1/duplex") as ws:
            await ws.send(message)
            got.append((message, (await next_error(ws))["code"]))
    async with connect(f"ws://127.0.0.1:{port}/v1/duplex") as ws:
        await ws.send(j({"type": "session.start"}))
        for message, _ in NATIVE_BAD:
            await ws.send(message)
            got.append((message, (await next_error(ws))["code"]))
        await ws.send(j({"type": "input.text", "text": "two plus two"}))  # the session still works
        async with asyncio.timeout(10):
            while True:
                msg = await ws.recv()
                if isinstance(msg, str) and json.loads(msg)["type"] == "response.done":
                    break
    return got


async def realtime_rows(port: int) -> list[tuple[str | bytes, str]]:
    got = []
    async with connect(f"ws://127.0.0.1:{port}/v1/realtime?model=x") as ws:
        for message, _ in REALTIME_BAD:
            await ws.send(message)
            got.append((message, (await next_error(ws, 8.0))["error"]["code"]))
    return got


async def test_bad_inputs_over_sockets_leave_a_parallel_session_unaffected(server) -> None:
    answer, native, realtime = await asyncio.gather(
        bystander(server.port), native_rows(server.port), realtime_rows(server.port)
    )
    assert answer == ANSWER
    assert [code for _, code in native] == [code for _, code in NATIVE_BAD_START + NATIVE_BAD]
    assert [code for _, code in realtime] == [code for _, code in REALTIME_BAD]
    assert json.loads(json.dumps(server.service.health()))["status"] == "ok"


def mutate(rng: random.Random, valid: list[dict[str, Any]]) -> str | bytes:
    """A random message: a valid event with a field removed, retyped or garbled, or raw garbage."""
    roll = rng.random()
    if roll < 0.1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
    ev = dict(rng.choice(valid))
    garbage: list[Any] = [None, -1, 1e308, "", "x" * rng.randrange(50), [], {}, True, {"a": [1, {"b": None}]}]
    key = rng.choice([*ev, "extra"])
    if rng.random() < 0.3 and key in ev and key != "type":
        del ev[key]
    else:
        ev[key] = rng.choice(garbage)
    text = json.dumps(ev)
    if roll > 0.9:
        cut = rng.randrange(len(text))
        text = text[:cut] + rng.choice(["", "\x00", "}", '"', "\\u"]) + text[cut + 1 :]
    return text


NATIVE_VALID = [
    {"type": "session.update", "options": {"vad_threshold": 0.5}},
    {"type": "input.text", "text": "hello"},
    {"type": "playout.position", "played_ms": 10, "turn_id": 1},
    {"type": "response.truncate", "played_ms": 10},
    {"type": "response.cancel"},
    {"type": "input.end"},
    {"type": "input.clear"},
]
REALTIME_VALID = [
    {
        "type": "session.update",
        "session": {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}},
    },
    {"type": "input_audio_buffer.append", "audio": b64(b"\x00\x00" * 240)},
    {"type": "input_audio_buffer.clear"},
    {"type": "conversation.item.create", "item": _ITEM},
    {"type": "conversation.item.truncate", "item_id": "item_1", "content_index": 0, "audio_end_ms": 5},
    {"type": "response.cancel"},
]


async def fuzz_native(port: int, rng: random.Random, n: int) -> set[str]:
    codes: set[str] = set()
    async with connect(f"ws://127.0.0.1:{port}/v1/duplex") as ws:
        await ws.send(j({"type": "session.start"}))
        for _ in range(n):
            await ws.send(mutate(rng, NATIVE_VALID))
            await asyncio.sleep(0.002)
        await ws.send(j({"type": "input.text", "text": "two plus two"}))
        async with asyncio.timeout(15):
            while True:
                msg = await ws.recv()
                if isinstance(msg, str):
                    ev = json.loads(msg)
                    if ev["type"] == "error":
                        codes.add(ev["code"])
                    if ev["type"] == "response.done" and "four" in ev["text"]:
                        return codes


async def fuzz_realtime(port: int, rng: random.Random, n: int) -> set[str]:
    codes: set[str] = set()
    async with connect(f"ws://127.0.0.1:{port}/v1/realtime?model=x") as ws:
        for _ in range(n):
            await ws.send(mutate(rng, REALTIME_VALID))
            await asyncio.sleep(0.002)
        await ws.send(j({"type": "input_audio_buffer.clear", "event_id": "last"}))
        async with asyncio.timeout(15):
            while True:
                ev = json.loads(await ws.recv())
                if ev["type"] == "error":
                    codes.add(ev["error"]["code"])
                if ev["type"] == "input_audio_buffer.cleared":
                    return codes


async def test_random_messages_over_sockets(server) -> None:
    rng = random.Random(23)
    answer, native_codes, realtime_codes = await asyncio.gather(
        bystander(server.port), fuzz_native(server.port, rng, 150), fuzz_realtime(server.port, rng, 150)
    )
    assert answer == ANSWER
    assert native_codes and native_codes <= ERROR_CODES - {"internal_error"}, native_codes
    from tests.duplex.transports.test_fuzz import REALTIME_CODES

    assert realtime_codes and realtime_codes <= REALTIME_CODES - {"server_error"}, realtime_codes


# -- WebSocket framing (what the Autobahn fuzzingclient checks; see docs/operations.md) ---------


def ws_frame(opcode: int, payload: bytes, *, fin: bool = True, rsv: int = 0, masked: bool = True) -> bytes:
    head = bytes([(0x80 if fin else 0) | rsv << 4 | opcode])
    n = len(payload)
    size = (
        bytes([n])
        if n < 126
        else bytes([126]) + n.to_bytes(2, "big")
        if n < 65536
        else bytes([127]) + n.to_bytes(8, "big")
    )
    if not masked:
        return head + size + payload
    key = b"\x11\x22\x33\x44"
    size = bytes([size[0] | 0x80]) + size[1:]
    return head + size + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


# (frame, the close code the server must answer with)
BAD_FRAMES: list[tuple[bytes, int]] = [
    (ws_frame(0x1, b"{}", rsv=0b100), 1002),  # a reserved bit, no extension negotiated
    (ws_frame(0x3, b"x"), 1002),  # a reserved opcode
    (ws_frame(0x1, b'{"type": "input.end"}', masked=False), 1002),  # clients must mask
    (ws_frame(0x1, b"\xff\xfe"), 1007),  # text that is not UTF-8
    (ws_frame(0x9, b"ping", fin=False), 1002),  # a fragmented control frame
    (ws_frame(0x9, b"p" * 126), 1002),  # a control frame over 125 bytes
    (ws_frame(0x0, b"x"), 1002),  # a continuation with nothing to continue
    (ws_frame(0x8, (999).to_bytes(2, "big")), 1002),  # a close code no one may send
    (ws_frame(0x2, b"\x00" * 70000), 1009),  # over the 64 KiB message limit
]


async def raw_close_code(port: int, frame: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(b"0123456789abcdef").decode()
    writer.write(
        (
            f"GET /v1/duplex HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    await writer.drain()
    assert b" 101 " in await reader.readuntil(b"\r\n\r\n")
    writer.write(frame)
    await writer.drain()
    try:
        async with asyncio.timeout(5):
            while True:  # skip what the session sends until the close frame
                b0, b1 = await reader.readexactly(2)
                n = b1 & 0x7F
                if n == 126:
                    n = int.from_bytes(await reader.readexactly(2), "big")
                elif n == 127:
                    n = int.from_bytes(await reader.readexactly(8), "big")
                payload = await reader.readexactly(n)
                if b0 & 0x0F == 0x8:
                    return int.from_bytes(payload[:2], "big")
    finally:
        writer.close()


async def test_bad_websocket_frames_close_only_their_connection(server) -> None:
    async def frames() -> list[int]:
        return [await raw_close_code(server.port, frame) for frame, _ in BAD_FRAMES]

    answer, codes = await asyncio.gather(bystander(server.port), frames())
    assert codes == [code for _, code in BAD_FRAMES]
    assert answer == ANSWER
