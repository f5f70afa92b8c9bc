"""The native WebSocket protocol, end to end over a real socket, with the tiny tone stages."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from codec.resample import resample
from duplex.base.config import load_profile
from duplex.core.session import SR
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.fakes import decode_tones, fake_stages, scripted_answer, tone_speech
from duplex.transports.native import DuplexServer, ServerSettings

answer = scripted_answer


@pytest.fixture
async def server():
    service = DuplexService(load_profile("cpu"), fake_stages(answer), limits=ServiceLimits(max_sessions=3))
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    await srv.start()
    yield srv
    await srv.close()
    service.close()


def url(srv, path="/v1/duplex"):
    return f"ws://127.0.0.1:{srv.port}{path}"


async def send_audio(ws, audio: np.ndarray, rate: int = SR, speed: float = 4.0):
    """Send PCM16 in 20 ms frames, `speed` times faster than real time."""
    frame = rate // 50
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
    for i in range(0, len(pcm), frame):
        await ws.send(pcm[i : i + frame].tobytes())
        await asyncio.sleep(0.02 / speed)


async def collect(ws, until: str, limit_s: float = 10.0):
    """Receive until an event of type `until`; returns (events, audio float32)."""
    events, audio = [], []
    async with asyncio.timeout(limit_s):
        while True:
            msg = await ws.recv()
            if isinstance(msg, bytes):
                audio.append(np.frombuffer(msg, dtype="<i2"))
                continue
            ev = json.loads(msg)
            events.append(ev)
            if ev["type"] == until:
                break
    pcm = np.concatenate(audio).astype(np.float32) / 32767 if audio else np.zeros(0, np.float32)
    return events, pcm


def silence(s, rate=SR):
    return np.zeros(int(rate * s), dtype=np.float32)


async def test_http_routes(server):
    def get(path):
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as r:
            return r.status, r.headers.get("Content-Type"), r.read()

    status, ctype, body = await asyncio.to_thread(get, "/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, ctype, body = await asyncio.to_thread(get, "/")
    assert status == 200 and "text/html" in ctype and b"<html" in body.lower()
    with pytest.raises(urllib.error.HTTPError) as err:
        await asyncio.to_thread(get, "/nope.txt")
    assert err.value.code == 404


async def test_spoken_question_gets_spoken_answer(server):
    async with connect(url(server)) as ws:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": 16000}))
        started = json.loads(await ws.recv())
        assert started["type"] == "session.started" and started["output_sample_rate"] == 24000
        await send_audio(
            ws, np.concatenate([silence(0.3), tone_speech("what is the capital of france"), silence(1.0)])
        )
        events, audio = await collect(ws, "response.done")
        types = [e["type"] for e in events]
        assert "speech.started" in types and "turn.latency" in types
        final = next(e for e in events if e["type"] == "transcript.final")
        assert final["text"] == "what is the capital of france"
        assert events[-1]["status"] == "completed"
        assert all(e["session_id"] == started["session_id"] for e in events)
        # the rest of the audio arrives after response.done (it is paced); wait for it
        tail = []
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                while True:
                    tail.append(np.frombuffer(await ws.recv(), dtype="<i2"))
        heard = np.concatenate([audio, *(t.astype(np.float32) / 32767 for t in tail)])
        assert decode_tones(heard, 24000) == "paris is the capital of france".split()


async def test_client_rate_48k_is_resampled(server):
    async with connect(url(server)) as ws:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": 48000}))
        assert json.loads(await ws.recv())["type"] == "session.started"
        speech = resample(
            np.concatenate([silence(0.3), tone_speech("hello how are you"), silence(1.0)]), SR, 48000
        )
        await send_audio(ws, speech, rate=48000)
        events, _ = await collect(ws, "transcript.final")
        assert events[-1]["text"] == "hello how are you"


async def test_bad_input_gets_errors_while_a_parallel_session_works(server):
    async def good_session():
        async with connect(url(server)) as ws:
            await ws.send(json.dumps({"type": "session.start", "sample_rate": 16000}))
            await ws.recv()
            await send_audio(
                ws,
                np.concatenate([silence(0.3), tone_speech("what is the capital of france"), silence(1.0)]),
                speed=2,
            )
            events, _ = await collect(ws, "response.done", limit_s=15)
            return events

    async def bad_session():
        codes = []
        async with connect(url(server)) as ws:
            await ws.send(json.dumps({"type": "session.start", "sample_rate": 12345}))
            codes.append(json.loads(await ws.recv())["code"])
            await ws.send(json.dumps({"type": "session.start", "sample_rate": 16000}))
            assert json.loads(await ws.recv())["type"] == "session.started"
            for bad in [
                "{not json",
                json.dumps({"type": "teleport"}),
                json.dumps([1, 2]),
                json.dumps({"type": "session.start"}),
                json.dumps({"type": "session.update", "options": {"vad_threshold": 7}}),
            ]:
                await ws.send(bad)
                codes.append(json.loads(await ws.recv())["code"])
            await ws.send(b"\x01\x02\x03")  # odd byte count
            codes.append(json.loads(await ws.recv())["code"])
            # the session survived all of that and still works
            await send_audio(
                ws, np.concatenate([silence(0.2), tone_speech("hello how are you"), silence(1.0)]), speed=2
            )
            events, _ = await collect(ws, "transcript.final")
            assert events[-1]["text"] == "hello how are you"
        # an oversized frame closes only that connection, with 1009 (message too big)
        async with connect(url(server)) as ws:
            await ws.send(b"\x00" * (70 * 1024))
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            codes.append(closed.value.rcvd.code)
        return codes

    good, codes = await asyncio.gather(good_session(), bad_session())
    assert codes == [
        "unsupported_sample_rate",
        "bad_json",
        "unknown_event",
        "bad_event",
        "already_started",
        "bad_option",
        "bad_audio",
        1009,
    ]
    assert good[-1]["type"] == "response.done" and good[-1]["status"] == "completed"


async def test_abrupt_disconnect_mid_answer_frees_the_session(server):
    ws = await connect(url(server))
    await ws.send(json.dumps({"type": "session.start", "sample_rate": 16000}))
    await ws.recv()
    await send_audio(ws, np.concatenate([silence(0.3), tone_speech("tell me a story"), silence(0.8)]))
    await collect(ws, "response.audio.started")
    ws.transport.abort()  # no close handshake: the network went away
    for _ in range(100):
        if not server.service.sessions:
            break
        await asyncio.sleep(0.05)
    assert server.service.sessions == {}
    # and the server still serves
    async with connect(url(server)) as ws2:
        await ws2.send(json.dumps({"type": "session.start"}))
        assert json.loads(await ws2.recv())["type"] == "session.started"


async def test_capacity_is_refused_before_upgrade(server):
    conns = [await connect(url(server)) for _ in range(3)]
    try:
        for c in conns:
            await c.send(json.dumps({"type": "session.start"}))
            await c.recv()
        with pytest.raises(Exception) as err:
            await connect(url(server))
        assert "503" in str(err.value)
    finally:
        for c in conns:
            await c.close()


async def test_barge_in_over_the_wire_stops_audio(server):
    async with connect(url(server)) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        await ws.recv()
        await send_audio(
            ws, np.concatenate([silence(0.3), tone_speech("tell me a story"), silence(0.8)]), speed=1
        )
        await collect(ws, "response.audio.started")
        await asyncio.sleep(1.0)
        loop = asyncio.get_running_loop()
        t_speak = loop.time()
        sender = asyncio.create_task(
            send_audio(
                ws, np.concatenate([tone_speech("what is the capital of france"), silence(1.0)]), speed=1
            )
        )
        last_story_audio = None
        async with asyncio.timeout(10):
            while True:
                msg = await ws.recv()
                if isinstance(msg, bytes):
                    last_story_audio = loop.time()
                    continue
                ev = json.loads(msg)
                if ev["type"] == "response.interrupted":
                    break
        assert last_story_audio is not None and last_story_audio - t_speak < 0.3
        assert ev["played_text"]
        events, _ = await collect(ws, "response.done", limit_s=10)  # the interrupted one
        events, _ = await collect(ws, "response.done", limit_s=10)  # the answer to the new question
        assert events[-1]["text"] == "paris is the capital of france"
        await sender


async def test_session_start_options_are_applied_and_reported(server):
    async with connect(url(server)) as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "session.start",
                    "sample_rate": 16000,
                    "options": {"end_of_turn_silence_ms": 700, "vad_threshold": 0.6},
                }
            )
        )
        started = json.loads(await ws.recv())
        assert (
            started["options"]["end_of_turn_silence_ms"] == 700 and started["options"]["vad_threshold"] == 0.6
        )
        core = server.service.sessions[started["session_id"]]
        assert core.endpointer.end_silence == 16000 * 700 // 1000 and core.endpointer.threshold == 0.6
    async with connect(url(server)) as ws:
        await ws.send(json.dumps({"type": "session.start", "options": {"end_of_turn_silence_ms": "soon"}}))
        assert json.loads(await ws.recv())["code"] == "bad_option"
