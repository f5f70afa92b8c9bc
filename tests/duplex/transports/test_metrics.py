"""`GET /metrics` scraped after real turns (a completed answer, a barge-in, a refused message), and
JSON log lines that carry the session and turn ids."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request

import numpy as np
from websockets.asyncio.client import connect

from duplex.base.config import load_profile
from duplex.core.session import SR
from duplex.runtime.logs import JsonFormatter, SessionFilter
from duplex.runtime.metrics import sample
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.fakes import fake_stages, scripted_answer, tone_speech
from duplex.transports.native import DuplexServer, ServerSettings


async def send_audio(ws, audio: np.ndarray) -> None:
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
    for i in range(0, len(pcm), SR // 50):
        await ws.send(pcm[i : i + SR // 50].tobytes())
        await asyncio.sleep(0.005)


async def until(ws, event_type: str) -> dict:
    async with asyncio.timeout(15):
        while True:
            msg = await ws.recv()
            if isinstance(msg, str) and json.loads(msg)["type"] == event_type:
                return json.loads(msg)


async def test_metrics_are_scraped_and_logs_carry_session_ids() -> None:
    service = DuplexService(load_profile("cpu"), fake_stages(scripted_answer), limits=ServiceLimits())
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    await srv.start()
    lines: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    capture = Capture()
    capture.addFilter(SessionFilter())
    capture.setFormatter(JsonFormatter())
    duplex_log = logging.getLogger("duplex")
    level = duplex_log.level
    duplex_log.setLevel(logging.INFO)
    duplex_log.addHandler(capture)
    try:
        quiet = np.zeros(SR // 4, np.float32)
        async with connect(f"ws://127.0.0.1:{srv.port}/v1/duplex") as ws:
            await ws.send(json.dumps({"type": "session.start"}))
            started = await until(ws, "session.started")
            await ws.send("{not json")
            await send_audio(
                ws, np.concatenate([quiet, tone_speech("what is the capital of france"), np.zeros(SR)])
            )
            assert (await until(ws, "response.done"))["status"] == "completed"
            # a long answer, interrupted
            await send_audio(ws, np.concatenate([tone_speech("tell me a story"), np.zeros(SR)]))
            await until(ws, "response.audio.started")
            await asyncio.sleep(0.5)
            await send_audio(ws, np.concatenate([tone_speech("stop stop"), np.zeros(SR // 2)]))
            await until(ws, "response.interrupted")

        def scrape() -> tuple[int, str, str]:
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=5) as r:
                return r.status, r.headers["Content-Type"], r.read().decode()

        status, ctype, text = await asyncio.to_thread(scrape)
    finally:
        duplex_log.removeHandler(capture)
        duplex_log.setLevel(level)
        await srv.close()
        service.close()
    assert status == 200 and ctype.startswith("text/plain")
    assert sample(text, "duplex_sessions_total", transport="native") == 1
    assert (sample(text, "duplex_turns_total") or 0) >= 1
    assert (sample(text, "duplex_onset_seconds_count") or 0) >= 1
    assert (sample(text, "duplex_barge_in_seconds_count") or 0) >= 1
    assert (sample(text, "duplex_responses_total", status="completed") or 0) >= 1
    assert (sample(text, "duplex_responses_total", status="interrupted") or 0) >= 1
    assert sample(text, "duplex_errors_total", code="bad_json") == 1
    for label in ("vad", "asr.final", "llm.first", "tts"):
        assert (sample(text, "duplex_stage_run_seconds_count", label=label) or 0) >= 1, label
    assert "duplex_budget_overruns" in text and "duplex_stage_failures" in text
    assert sample(text, "duplex_draining") == 0
    records = [json.loads(line) for line in lines]
    opened = [r for r in records if "opened" in r["message"]]
    assert opened and opened[0]["session_id"] == started["session_id"] and opened[0]["turn_id"] == 0
    assert all({"ts", "level", "logger", "message", "session_id", "turn_id"} <= set(r) for r in records)
    per_turn = [r for r in records if r["session_id"] == started["session_id"] and (r["turn_id"] or 0) >= 1]
    assert per_turn, records  # the core's logs during a turn carry its turn id
