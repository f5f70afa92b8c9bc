"""The Asterisk AudioSocket gateway over real TCP, driven by the Asterisk peer simulator and tone stages."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from duplex.base.config import load_profile
from duplex.core.events import (
    DtmfReceived,
    Interrupted,
    ResponseAudioStarted,
    ResponseDone,
    ServerEvent,
    SessionStarted,
)
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.audiosocket_sim import AudioSocketPeer, message
from duplex.testing.fakes import decode_tones, fake_stages, scripted_answer, tone_speech
from duplex.transports import audiosocket
from duplex.transports.audiosocket import AudioSocketServer

PARIS = "paris is the capital of france".split()
FINE = "i am fine thanks".split()


@dataclass
class Harness:
    service: DuplexService
    server: AudioSocketServer
    events: list[tuple[float, ServerEvent]] = field(default_factory=list)  # (loop time, event)

    @property
    def port(self) -> int:
        return self.server.port

    def call(self, call_uuid: uuid.UUID | None = None, **kw) -> AudioSocketPeer:
        return AudioSocketPeer("127.0.0.1", self.port, call_uuid, **kw)

    def of(self, cls: type, session_id: str | None = None) -> list:
        return [e for _, e in self.events if isinstance(e, cls) and session_id in (None, e.session_id)]

    def session_of(self, call: AudioSocketPeer) -> str:
        return next(sid for sid, u in self.server.calls.items() if u == call.call_uuid)


async def make_harness(max_sessions: int = 3, **kw) -> Harness:
    service = DuplexService(
        load_profile("cpu"), fake_stages(scripted_answer), limits=ServiceLimits(max_sessions=max_sessions)
    )
    h = Harness(service, None)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    h.server = AudioSocketServer(
        service, "127.0.0.1", 0, on_event=lambda e: h.events.append((loop.time(), e)), **kw
    )
    await h.server.start()
    return h


@pytest.fixture
async def gw():
    h = await make_harness()
    yield h
    await h.server.close()
    h.service.close()


async def until(predicate: Callable[[], bool], limit_s: float = 5.0) -> None:
    """Poll `predicate` (e.g. the service's session table, which has no event) for up to `limit_s`."""
    for _ in range(int(limit_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    assert predicate(), f"not true within {limit_s} s"


async def ask(call: AudioSocketPeer, text: str, lead_s: float = 0.2) -> list[str]:
    """Say `text` as tones, wait for the whole answer to play out; returns the words heard after it."""
    await call.pause(lead_s)
    await call.say(tone_speech(text))
    return decode_tones(await call.wait_for_answer(quiet_s=0.5, limit_s=8), call.rate)


async def test_question_gets_a_spoken_answer_in_paced_320_byte_frames(gw):
    async with gw.call() as call:
        await call.pause(0.2)
        said = await call.say(tone_speech("what is the capital of france"))
        await call.wait_audio(after=said.end, limit_s=5)
        sid = gw.session_of(call)
        await call.wait_quiet(0.5)
        assert decode_tones(call.played_audio(), 8000) == PARIS
        assert {len(f.pcm) for f in call.frames} == {320}
        assert call.protocol_errors == [] and call.dropped_frames == 0
        # paced in real time: never more than the core's lead (~120 ms) plus a frame or two ahead
        arrivals = np.array([f.received for f in call.frames])
        sent_audio = 0.02 * np.arange(1, len(arrivals) + 1)
        assert np.max(sent_audio - (arrivals - arrivals[0])) < 0.3
        assert arrivals[-1] - arrivals[0] > sent_audio[-1] - 0.3
        # the simulated phone played it without gaps
        gaps = [b.start - a.end for a, b in zip(call.frames, call.frames[1:], strict=False)]
        assert sum(g for g in gaps if g > 0) < 0.1
        onset = call.first_played_after(said.end)
        assert onset is not None and 0.3 < onset - said.end < 2.0  # the 500 ms hangover, then the answer
    started = gw.of(SessionStarted, sid)
    assert started and started[0].input_sample_rate == 8000 and started[0].output_sample_rate == 8000
    done = gw.of(ResponseDone, sid)
    assert [d.status for d in done] == ["completed"] and done[0].text == " ".join(PARIS)
    await until(lambda: not gw.service.sessions, 2)


async def test_slin16_call_is_answered_at_16k():
    h = await make_harness()
    try:
        async with h.call(rate=16000) as call:
            assert await ask(call, "what is the capital of france") == PARIS
            assert {len(f.pcm) for f in call.frames} == {640} and {f.rate for f in call.frames} == {16000}
            assert call.protocol_errors == []
            sid = h.session_of(call)
        assert h.of(SessionStarted, sid)[0].input_sample_rate == 16000
    finally:
        await h.server.close()
        h.service.close()


async def test_talking_over_the_answer_stops_the_audio(gw):
    loop = asyncio.get_running_loop()
    async with gw.call() as call:
        await call.pause(0.2)
        said = await call.say(tone_speech("tell me a story"))
        await call.wait_audio(after=said.end, limit_s=5)
        sid = gw.session_of(call)
        await call.pause(1.0)
        t_barge = loop.time()
        await call.say(tone_speech("what is the capital of france"))
        await until(lambda: gw.of(ResponseAudioStarted, sid)[1:], 6)  # the answer to the new question
        await call.wait_quiet(0.5)
    interrupted = gw.of(Interrupted, sid)
    assert len(interrupted) == 1 and interrupted[0].played_text
    t_int = next(t for t, e in gw.events if isinstance(e, Interrupted))
    t_next = next(
        t
        for t, e in gw.events
        if isinstance(e, ResponseAudioStarted) and e.turn_id == interrupted[0].turn_id + 1
    )
    assert t_barge < t_int < t_barge + 0.6  # barge-in needs ~100 ms of speech, plus VAD windows
    # no story audio after the interruption (one in-flight write of slack), until the new answer
    late = [f for f in call.frames if t_int + 0.05 < f.received < t_next]
    assert late == []
    statuses = [d.status for d in gw.of(ResponseDone, sid)]
    assert statuses == ["interrupted", "completed"]
    story_heard = decode_tones(call.played_audio(t1=t_int + 0.05), 8000)
    story = scripted_answer([{"content": "story"}]).split()
    assert 2 <= len(story_heard) < len(story) and story_heard == story[: len(story_heard)]
    assert decode_tones(call.played_audio(t0=t_next), 8000) == PARIS


@pytest.mark.parametrize("how", ["terminate", "close", "abort", "truncated"])
async def test_hangup_mid_answer_frees_the_session(gw, how, caplog):
    caplog.set_level(logging.INFO, logger="duplex.transports.audiosocket")
    call = gw.call()
    await call.connect()
    await call.pause(0.2)
    said = await call.say(tone_speech("tell me a story"))
    await call.wait_audio(after=said.end, limit_s=5)
    assert len(gw.service.sessions) == 1
    if how == "terminate":
        await call.hangup(terminate=True)  # 0x00, then close
    elif how == "close":
        await call.hangup()  # what Asterisk does when the caller hangs up: close the socket
    elif how == "abort":
        call.abort()  # connection reset
    else:
        await call.send_truncated(length=320, sent=100)  # EOF in the middle of a message
    await until(lambda: not gw.service.sessions, 0.5)  # at once, not at the end of the answer
    await call.close()
    # A close while our audio sits unread in the caller's buffer makes the caller's kernel send a
    # reset instead of a FIN (RFC 1122 4.2.2.13), so "close" may read as either.
    reasons = {
        "terminate": ("peer hung up",),
        "close": ("peer closed the connection", "connection lost"),
        "abort": ("connection",),
        "truncated": ("truncated message",),
    }[how]
    ended = [r.getMessage() for r in caplog.records if " ended: " in r.getMessage()]
    assert any("ended: " + reason in msg for msg in ended for reason in reasons), ended
    # and the server still answers the next call
    async with gw.call() as again:
        assert await ask(again, "hello how are you") == FINE


async def test_only_allowed_uuids_get_a_session():
    expected = uuid.uuid4()
    h = await make_harness(allowed_uuids=[expected])
    try:
        async with h.call(uuid.uuid4()) as stranger:
            assert await stranger.wait_closed(2) == "server-hangup"
        assert h.service.sessions_total == 0 and h.events == []
        async with h.call(expected) as call:
            assert await ask(call, "hello how are you") == FINE
        assert h.service.sessions_total == 1
    finally:
        await h.server.close()
        h.service.close()


async def test_malformed_input_is_survived_while_a_parallel_call_answers(gw, caplog):
    caplog.set_level(logging.WARNING, logger="duplex.transports.audiosocket")

    async def good_call() -> list[str]:
        async with gw.call(jitter_ms=10, seed=1) as call:
            return await ask(call, "what is the capital of france")

    async def bad_calls() -> list[str]:
        outcomes = []
        # a call with a session: junk is skipped, the call goes on, oversized audio ends it
        async with gw.call() as call:
            await call.send_raw(message(0x42, b"what is this"))  # unknown type: skipped
            await call.send_raw(message(0x10, bytes(321)))  # odd-length audio: dropped
            await call.send_error(0x02)  # Asterisk reports a frame forwarding error: logged
            await call.send_raw(message(0x03, b"xy"))  # bad DTMF: ignored
            await call.send_raw(message(0x01, uuid.uuid4().bytes))  # a second UUID: ignored
            assert await ask(call, "hello how are you") == FINE
            await call.send_raw(message(0x10, bytes(8002)))  # oversized audio: not Asterisk
            outcomes.append(await call.wait_closed(2))
        # no session for these: audio before the UUID, a UUID of the wrong size, garbage
        async with gw.call(send_uuid=False, send_silence=False) as call:
            await call.send_raw(message(0x10, bytes(320)))
            outcomes.append(await call.wait_closed(2))
        async with gw.call(send_uuid=False, send_silence=False) as call:
            await call.send_raw(message(0x01, b"\x01\x02\x03\x04"))
            outcomes.append(await call.wait_closed(2))
        garbage = random.Random(3).randbytes(2000)
        async with gw.call(send_uuid=False, send_silence=False) as call:
            await call.send_raw(b"\xfe" + garbage)
            outcomes.append(await call.wait_closed(2))
        # garbage after a valid UUID: whatever it parses as, the server survives and frees the session
        async with gw.call(send_silence=False) as call:
            await call.send_raw(garbage)
            await asyncio.sleep(0.2)
        return outcomes

    good, bad = await asyncio.gather(good_call(), bad_calls())
    assert good == PARIS
    assert bad == ["server-hangup"] * 4
    await until(lambda: not gw.service.sessions, 2)
    assert gw.service.sessions_total == 3  # the good call, the junk call and the garbage-after-UUID call
    text = "\n".join(r.getMessage() for r in caplog.records)
    for expected in [
        "unknown message type 0x42",
        "even byte count",
        "error 0x02 (frame forwarding error)",
        "bad DTMF",
        "second call UUID",
        "8002 bytes",
        "type 0x10 before the call UUID",
        "call UUID of 4 bytes",
    ]:
        assert expected in text


async def test_dtmf_reaches_on_event_with_the_session_id(gw, caplog):
    caplog.set_level(logging.INFO, logger="duplex.transports.audiosocket")
    async with gw.call() as call:
        await until(lambda: gw.server.calls, 2)
        sid = gw.session_of(call)
        for digit in "5#a":
            await call.dtmf(digit)
        await call.send_raw(message(0x03, b"x"))  # not a keypad digit
        await until(lambda: len(gw.of(DtmfReceived)) == 3, 2)
    dtmf = gw.of(DtmfReceived)
    assert [(d.digit, d.source, d.session_id) for d in dtmf] == [(x, "audiosocket", sid) for x in "5#A"]
    assert any("DTMF #" in r.getMessage() for r in caplog.records)


async def test_jitter_and_bunching_still_give_the_right_answer(gw):
    async with gw.call(jitter_ms=40, bunching=0.3, max_bunch=5, seed=11) as call:
        assert await ask(call, "what is the capital of france") == PARIS
        assert call.protocol_errors == [] and call.dropped_frames == 0


async def test_a_call_beyond_capacity_is_hung_up_cleanly(gw):
    calls = [gw.call() for _ in range(3)]
    for c in calls:
        await c.connect()
    await until(lambda: len(gw.service.sessions) == 3, 2)
    async with gw.call() as extra:
        assert await extra.wait_closed(2) == "server-hangup"
    assert len(gw.service.sessions) == 3 and gw.service.sessions_total == 3
    await calls[0].close()
    await until(lambda: len(gw.service.sessions) == 2, 2)
    async with gw.call() as late:
        assert await ask(late, "hello how are you") == FINE
    for c in calls[1:]:
        await c.close()


async def test_no_uuid_in_time_closes_the_connection(gw, monkeypatch):
    monkeypatch.setattr(audiosocket, "UUID_TIMEOUT_S", 0.3)
    async with gw.call(send_uuid=False, send_silence=False) as call:
        assert await call.wait_closed(2) == "server-hangup"
    assert gw.service.sessions_total == 0


async def test_a_peer_that_stops_reading_is_dropped(gw, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="duplex.transports.audiosocket")
    monkeypatch.setattr(audiosocket, "DRAIN_TIMEOUT_S", 0.5)
    monkeypatch.setattr(audiosocket, "WRITE_BUFFER_BYTES", 2048)
    monkeypatch.setattr(audiosocket, "SEND_BUFFER_BYTES", 4096)
    async with gw.call(recv_buffer_bytes=4096) as call:
        await call.pause(0.2)
        said = await call.say(tone_speech("tell me a story"))
        await call.wait_audio(after=said.end, limit_s=5)
        call.stop_reading()  # Asterisk stuck: it keeps sending audio but reads nothing
        await until(lambda: not gw.service.sessions, 10)
    assert any("has not read for 0.5 s" in r.getMessage() for r in caplog.records)


async def test_close_hangs_up_every_call(gw):
    calls = [gw.call() for _ in range(2)]
    for c in calls:
        await c.connect()
    await until(lambda: len(gw.service.sessions) == 2, 2)
    await gw.server.close()
    assert [await c.wait_closed(2) for c in calls] == ["server-hangup"] * 2
    assert gw.service.sessions == {}
    for c in calls:
        await c.close()


async def test_a_failing_on_event_callback_does_not_end_the_call():
    service = DuplexService(load_profile("cpu"), fake_stages(scripted_answer))

    def broken(event: ServerEvent) -> None:
        raise RuntimeError("bug in the callback")

    server = AudioSocketServer(service, "127.0.0.1", 0, on_event=broken)
    await server.start()
    try:
        async with AudioSocketPeer("127.0.0.1", server.port) as call:
            assert await ask(call, "hello how are you") == FINE
    finally:
        await server.close()
        service.close()


@pytest.mark.parametrize(
    ("host", "allowed", "warned"),
    [
        ("0.0.0.0", None, True),
        ("0.0.0.0", [uuid.uuid4()], False),
        ("127.0.0.1", None, False),
    ],
)
async def test_an_open_listener_without_allow_list_is_warned_about(host, allowed, warned, caplog):
    caplog.set_level(logging.WARNING, logger="duplex.transports.audiosocket")
    service = DuplexService(load_profile("cpu"), fake_stages(scripted_answer))
    server = AudioSocketServer(service, host, 0, allowed_uuids=allowed)
    await server.start()
    await server.close()
    service.close()
    assert any("ANY call UUID" in r.getMessage() for r in caplog.records) == warned
