"""Limits: each one over a real socket with the tiny tone stages, answered with its documented error
event and close code; and the sans-I/O rules (token bucket, audio pacer) on a fake clock."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from duplex.base.config import ConfigError, load_profile
from duplex.base.limits import (
    AudioPacer,
    ClientCounts,
    ControlLimiter,
    ServerLimits,
    TokenBucket,
    load_limits,
)
from duplex.core.session import SR
from duplex.runtime.metrics import sample
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.fakes import fake_stages, scripted_answer, tone_speech
from duplex.testing.replay import FakeClock
from duplex.transports.native import DuplexServer, ServerSettings
from duplex.transports.realtime import mount_realtime

# -- sans-I/O --------------------------------------------------------------------------------


def test_token_bucket_and_control_limiter() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2, burst=3, clock=clock)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    clock.t += 0.5
    assert bucket.take() and not bucket.take()
    limiter = ControlLimiter(rate=1, burst=2, clock=clock)
    verdicts = [limiter.check() for _ in range(6)]
    assert verdicts == ["accept", "accept", "drop", "drop", "close", "close"]
    clock.t += 10
    assert limiter.check() == "accept"


def test_audio_pacer() -> None:
    clock = FakeClock()
    pacer = AudioPacer(speed=1.0, burst_s=2.0, close_s=5.0, clock=clock)
    assert pacer.add(1.5) == 0.0  # within the burst
    assert pacer.add(1.0) == pytest.approx(0.5)  # 2.5 s ahead: wait 0.5 s
    clock.t += 0.5
    assert pacer.add(0.5) == pytest.approx(0.5) and not pacer.too_fast()
    pacer.add(3.0)
    assert pacer.too_fast()
    real_time = AudioPacer(speed=1.0, burst_s=0.1, close_s=1.0, clock=clock)
    for _ in range(100):  # exactly real time: never waits
        assert real_time.add(0.02) == 0.0
        clock.t += 0.02


def test_client_counts() -> None:
    counts = ClientCounts(2)
    assert counts.acquire("a") and counts.acquire("a") and not counts.acquire("a") and counts.acquire("b")
    counts.release("a")
    assert counts.count("a") == 1 and counts.acquire("a")


def test_limits_config(tmp_path) -> None:
    # models.yaml states the defaults, except that it asks for the measured capacity
    assert load_limits() == ServerLimits(max_sessions_auto=True)
    path = tmp_path / "m.yaml"
    path.write_text("profiles: {}\nlimits: {idle_timeout_s: 5, max_text_chars: 100}\n")
    limits = load_limits(path)
    assert (
        limits.idle_timeout_s == 5.0
        and limits.max_text_chars == 100
        and isinstance(limits.max_text_chars, int)
    )
    for bad in (
        "limits: {nope: 1}",
        "limits: {idle_timeout_s: -1}",
        "limits: {max_text_chars: yes}",
        "limits: 3",
    ):
        path.write_text("profiles: {}\n" + bad + "\n")
        with pytest.raises(ConfigError):
            load_limits(path)
    assert (
        ServiceLimits(max_sessions=3)
        .with_overrides({"max_session_s": 9, "control_burst": None})
        .max_session_s
        == 9
    )


# -- over sockets ----------------------------------------------------------------------------


async def serve(**limits: Any) -> tuple[DuplexServer, DuplexService]:
    service = DuplexService(load_profile("cpu"), fake_stages(scripted_answer), limits=ServiceLimits(**limits))
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    mount_realtime(srv)
    await srv.start()
    return srv, service


async def until_closed(ws, limit_s: float = 10.0) -> tuple[list[dict[str, Any]], int | None, str]:
    events: list[dict[str, Any]] = []
    try:
        async with asyncio.timeout(limit_s):
            async for msg in ws:
                if isinstance(msg, str):
                    events.append(json.loads(msg))
    except ConnectionClosed:
        pass
    return events, ws.close_code, ws.close_reason or ""


def errors(events: list[dict[str, Any]]) -> list[str]:
    return [e["code"] for e in events if e["type"] == "error"]


@pytest.fixture
async def limited(request):
    srv, service = await serve(**request.param)
    yield srv
    await srv.close()
    service.close()


def url(srv: DuplexServer, path: str = "/v1/duplex") -> str:
    return f"ws://127.0.0.1:{srv.port}{path}"


@pytest.mark.parametrize("limited", [{"max_connections_per_client": 2}], indirect=True)
async def test_connections_per_client_address(limited) -> None:
    async with connect(url(limited)), connect(url(limited)):
        with pytest.raises(InvalidStatus) as err:
            async with connect(url(limited)):
                pass
        assert err.value.response.status_code == 429
        assert b"too_many_connections" in err.value.response.body
    async with connect(url(limited)) as ws:  # freed when they closed
        await ws.send(json.dumps({"type": "session.start"}))
        assert json.loads(await ws.recv())["type"] == "session.started"


@pytest.mark.parametrize("limited", [{"max_session_s": 0.6}], indirect=True)
async def test_session_duration(limited) -> None:
    async with connect(url(limited)) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.4:  # active, not idle
            await ws.send(np.zeros(320, "<i2").tobytes())
            await asyncio.sleep(0.02)
        events, code, reason = await until_closed(ws)
    assert errors(events) == ["session_expired"] and code == 1000 and reason == "session expired"


@pytest.mark.parametrize("limited", [{"idle_timeout_s": 0.4}], indirect=True)
async def test_idle_timeout(limited) -> None:
    async with connect(url(limited)) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        events, code, reason = await until_closed(ws)
    assert errors(events) == ["idle_timeout"] and code == 1000 and reason == "idle"


@pytest.mark.parametrize("limited", [{"control_per_s": 2, "control_burst": 3}], indirect=True)
async def test_control_message_rate(limited) -> None:
    update = json.dumps({"type": "session.update", "options": {"vad_threshold": 0.5}})
    async with connect(url(limited)) as ws:
        for _ in range(5):  # 3 accepted, 2 dropped: one rate_limited error
            await ws.send(update)
        for _ in range(10):  # a sustained flood: closed
            await ws.send(update)
        events, code, reason = await until_closed(ws)
    assert errors(events) == ["rate_limited", "rate_limited"] and code == 1008 and reason == "message flood"
    assert [e["type"] for e in events].count("session.updated") == 3


@pytest.mark.parametrize("limited", [{"max_text_chars": 20}], indirect=True)
async def test_text_length(limited) -> None:
    async with connect(url(limited)) as ws:
        await ws.send(json.dumps({"type": "input.text", "text": "x" * 21}))
        ev = json.loads(await ws.recv())
        ev = ev if ev["type"] == "error" else json.loads(await ws.recv())
        assert ev["code"] == "text_too_long"
    async with connect(url(limited, "/v1/realtime")) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "y" * 21}]}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        ev = json.loads(await ws.recv())
        assert ev["type"] == "error" and ev["error"]["code"] == "string_above_max_length"


@pytest.mark.parametrize("limited", [{"audio_burst_s": 0.5, "audio_close_s": 30}], indirect=True)
async def test_audio_faster_than_real_time_is_throttled(limited) -> None:
    speech = np.concatenate([tone_speech("what is the capital of france"), np.zeros(SR, np.float32)])
    pcm = (speech * 32767).astype("<i2")
    async with connect(url(limited)) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        t0 = time.monotonic()
        for i in range(0, len(pcm), SR // 50):  # as fast as the socket takes it
            await ws.send(pcm[i : i + SR // 50].tobytes())
        final = None
        async with asyncio.timeout(20):
            while final is None:
                msg = await ws.recv()
                if isinstance(msg, str) and json.loads(msg)["type"] == "transcript.final":
                    final = json.loads(msg)
        elapsed = time.monotonic() - t0
    # the final needs ~2 s of the audio (1.5 s of words + the 0.5 s hangover): read at real time after
    # a 0.5 s burst that is ~1.5 s; unthrottled, the tone stages take ~0.1 s
    assert final["text"] == "what is the capital of france" and elapsed > 1.0
    hits = sample(limited.service.metrics.render().decode(), "duplex_limit_hits_total", limit="audio_rate")
    assert hits and hits >= 1


@pytest.mark.parametrize("limited", [{"audio_burst_s": 0.2, "audio_close_s": 1.0}], indirect=True)
async def test_audio_far_ahead_is_closed(limited) -> None:
    async with connect(url(limited)) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        await ws.send(np.zeros(int(SR * 1.5), "<i2").tobytes())  # 1.5 s in one frame, at once
        events, code, reason = await until_closed(ws)
    assert errors(events) == ["audio_too_fast"] and code == 1008


@pytest.mark.parametrize("limited", [{"max_sessions": 1}], indirect=True)
async def test_sessions_in_total(limited) -> None:
    async with connect(url(limited)) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        await ws.recv()
        with pytest.raises(InvalidStatus) as err:
            async with connect(url(limited, "/v1/realtime")):
                pass
        assert err.value.response.status_code == 503


def test_a_true_or_false_limit_takes_only_true_or_false() -> None:
    from duplex.base.config import ConfigError
    from duplex.base.limits import ServerLimits

    assert ServerLimits().llm_process is True
    assert ServerLimits().with_overrides({"llm_process": False}).llm_process is False
    with pytest.raises(ConfigError, match="true or false"):
        ServerLimits().with_overrides({"llm_process": 0})
    assert ServerLimits().engine_lane is False
    assert ServerLimits().with_overrides({"engine_lane": True}).engine_lane is True
