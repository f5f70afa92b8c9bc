"""Graceful drain, end to end: `duplex serve --tones` in a child process, real signals.

SIGTERM: new connections get 503 and /readyz turns false, the answer in progress finishes, then
the session is closed with 1001 and the process exits 0. A second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from duplex.core.session import SR
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.fakes import fake_stages, scripted_answer, tone_speech

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("DUPLEX_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "duplex.cli", "serve", "--tones", "--port", str(port), *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "listening on" in line:
            return proc
    proc.kill()
    raise AssertionError(f"server did not start: {proc.stdout.read()}")


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


async def ask(ws, text: str) -> None:
    await ws.send(json.dumps({"type": "session.start", "sample_rate": SR}))
    audio = np.concatenate([np.zeros(SR // 4, np.float32), tone_speech(text), np.zeros(SR, np.float32)])
    pcm = (audio * 32767).astype("<i2")
    for i in range(0, len(pcm), SR // 50):
        await ws.send(pcm[i : i + SR // 50].tobytes())
        await asyncio.sleep(0.004)


async def read_until(ws, event_type: str, events: list[dict], limit_s: float = 20.0) -> dict:
    async with asyncio.timeout(limit_s):
        while True:
            msg = await ws.recv()
            if isinstance(msg, str):
                ev = json.loads(msg)
                events.append(ev)
                if ev["type"] == event_type:
                    return ev


async def test_sigterm_drains_answer_then_503_then_1001() -> None:
    port = free_port()
    proc = start_server(port, "--drain-timeout-s", "20", "--log-format", "json")
    try:
        events: list[dict] = []
        async with connect(f"ws://127.0.0.1:{port}/v1/duplex") as ws:
            await ask(ws, "what is the capital of france")
            await read_until(ws, "response.audio.started", events)
            assert (await asyncio.to_thread(get, port, "/readyz"))[0] == 200
            proc.send_signal(signal.SIGTERM)  # an answer is in progress
            await asyncio.sleep(0.3)
            status, body = await asyncio.to_thread(get, port, "/readyz")
            assert status == 503 and json.loads(body) == {"ready": False, "reason": "draining"}
            with pytest.raises(InvalidStatus) as refused:
                async with connect(f"ws://127.0.0.1:{port}/v1/duplex"):
                    pass
            assert refused.value.response.status_code == 503
            done = await read_until(ws, "response.done", events)
            assert done["status"] == "completed" and done["text"] == "paris is the capital of france"
            with pytest.raises(ConnectionClosed) as closed:
                await read_until(ws, "never", events)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
            assert events[-1]["type"] == "error" and events[-1]["code"] == "server_shutdown"
        assert await asyncio.to_thread(proc.wait, 15) == 0
        # --log-format json: one object per line, the session's lines carry its id
        assert proc.stdout is not None
        logs = [json.loads(line) for line in proc.stdout.read().splitlines() if line.startswith("{")]
        sid = events[0]["session_id"]
        assert any(r["session_id"] == sid and "opened" in r["message"] for r in logs), logs
        assert any(r["session_id"] == sid and (r["turn_id"] or 0) >= 1 for r in logs)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def test_second_sigint_exits_at_once() -> None:
    port = free_port()
    proc = start_server(port, "--drain-timeout-s", "60")
    try:
        events: list[dict] = []
        async with connect(f"ws://127.0.0.1:{port}/v1/duplex") as ws:
            await ask(ws, "tell me a story")  # a long answer: the drain would wait for it
            await read_until(ws, "response.audio.started", events)
            proc.send_signal(signal.SIGINT)
            await asyncio.sleep(0.3)
            assert proc.poll() is None  # draining
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            rc = await asyncio.to_thread(proc.wait, 10)
            assert time.monotonic() - t0 < 8 and rc == 0
            with pytest.raises(ConnectionClosed):
                await read_until(ws, "never", events, limit_s=5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def test_drain_deadline_cuts_a_long_answer_with_1001() -> None:
    from duplex.base.config import load_profile
    from duplex.transports.native import DuplexServer, ServerSettings

    service = DuplexService(load_profile("cpu"), fake_stages(scripted_answer), limits=ServiceLimits())
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    await srv.start()
    try:
        events: list[dict] = []
        async with connect(f"ws://127.0.0.1:{srv.port}/v1/duplex") as ws:
            await ask(ws, "tell me a story")
            await read_until(ws, "response.audio.started", events)
            t0 = time.monotonic()
            drain = asyncio.create_task(service.drain(0.5))
            with pytest.raises(ConnectionClosed) as closed:
                await read_until(ws, "never", events, limit_s=5)
            await drain
            assert time.monotonic() - t0 < 3
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
            assert not any(e["type"] == "response.done" and e["status"] == "completed" for e in events)
    finally:
        await srv.close()
        service.close()
