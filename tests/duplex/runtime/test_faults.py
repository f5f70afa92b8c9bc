"""Fault isolation: a stage that raises, runs out of memory, hangs past its budget or returns NaN for
one session fails only that session's turn (an `error` event) or that session (1011), never the
server or a parallel session; a worker that dies is replaced. Tiny tone stages, no models."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplex.base.config import load_profile
from duplex.base.stage import SequentialBatchMixin
from duplex.core.jobs import Job
from duplex.core.session import SR
from duplex.runtime.executor import DeviceExecutor, StageOutputError, StageTimeout, WorkerDied
from duplex.runtime.metrics import sample
from duplex.runtime.service import DuplexService, ServiceLimits, check_tts
from duplex.testing.fakes import fake_stages, scripted_answer, tone_speech
from duplex.testing.faults import FAULTS, asks, loud, says, with_fault
from duplex.transports.native import DuplexServer, ServerSettings

QUESTION = "what is the capital of france"
ANSWER = "paris is the capital of france"

# per stage: what the victim says (amplitude, words) so that only its jobs hit the fault
VICTIM = {
    "vad": (0.9, QUESTION, loud),
    "asr": (0.9, QUESTION, loud),
    # not words of the bystander's question: its speculative answers to partial transcripts
    # ("what is the" -> small talk) must not trip the fault
    "llm": (0.3, "tell me a story", asks("story")),
    "tts": (0.3, "tell me a story", says("once")),
}


# -- the executor alone --------------------------------------------------------------------


class Echo(SequentialBatchMixin[int, Any, Any]):
    """Returns its chunk; `"boom"` raises, `"exit"` raises SystemExit, `"sleep"` sleeps, `"nan"` NaN audio."""

    kind = "echo"

    def __init__(self) -> None:
        self.batches: list[int] = []

    def init_state(self) -> int:
        return 0

    def step(self, state: int, chunk: Any) -> tuple[Any, int]:
        if chunk == "boom":
            raise RuntimeError("boom")
        if chunk == "exit":
            raise SystemExit("exit")
        if chunk == "sleep":
            time.sleep(1.0)
        if chunk == "nan":
            from duplex.base.messages import TtsChunk

            return [TtsChunk(np.array([np.nan], dtype=np.float32), "x")], state
        return chunk, state + 1

    def step_batch(self, items):
        self.batches.append(len(items))
        return super().step_batch(items)


def job(session: str, chunk: Any, deadline: float = 1e9) -> Job:
    return Job("echo", "echo", session, 0, 0, chunk, deadline)


def result(fut: Future) -> Any:
    return fut.result(timeout=5)


def test_a_failing_batch_fails_only_the_session_that_broke_it() -> None:
    stage = Echo()
    gate = threading.Event()
    ex = DeviceExecutor(realtime_stages=(), on_thread_start=gate.wait)  # hold workers until all are queued
    ex.register(stage, name="echo")
    futs = [ex.submit(job(f"s{i}", "boom" if i == 1 else i)) for i in range(3)]
    gate.set()
    assert result(futs[0])[0] == 0 and result(futs[2])[0] == 2
    with pytest.raises(RuntimeError, match="boom"):
        result(futs[1])
    assert stage.batches[0] == 3  # they were batched, then re-run one by one
    ex.close()


def test_output_checks_fail_the_job_not_the_worker() -> None:
    failures: list[tuple[str, str]] = []
    ex = DeviceExecutor(on_failure=lambda stage, kind: failures.append((stage, kind)))
    ex.register(Echo(), name="echo", check=check_tts)
    with pytest.raises(StageOutputError):
        result(ex.submit(job("a", "nan")))
    assert result(ex.submit(job("a", [])))[0] == []
    assert failures == [("echo", "bad_output")]
    ex.close()


def test_a_hung_job_times_out_and_its_worker_is_replaced() -> None:
    restarts: list[str] = []
    ex = DeviceExecutor(stage_timeout_s=0.2, on_restart=restarts.append)
    ex.register(Echo(), name="echo")
    hung = ex.submit(job("a", "sleep"))
    t0 = time.monotonic()
    with pytest.raises(StageTimeout):
        result(hung)
    assert time.monotonic() - t0 < 0.9  # the watchdog, not the sleep, ended it
    assert result(ex.submit(job("b", 7)))[0] == 7  # the replacement worker serves others at once
    assert restarts == ["hang"] and ex.restarts == 1
    ex.close()


def test_a_dead_worker_is_replaced() -> None:
    restarts: list[str] = []
    ex = DeviceExecutor(on_restart=restarts.append)
    ex.register(Echo(), name="echo")
    with pytest.raises(WorkerDied):
        result(ex.submit(job("a", "exit")))
    assert result(ex.submit(job("b", 5)))[0] == 5
    assert restarts == ["died"]
    ex.close()


# -- end to end: one session's stage fails, a parallel session is unaffected --------------


async def converse(
    url: str, audio: np.ndarray, limit_s: float = 15.0
) -> tuple[list[dict[str, Any]], int | None]:
    """Send a turn and read events until response.done (completed) or the connection closes."""
    events: list[dict[str, Any]] = []
    code: int | None = None
    async with connect(url) as ws:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": SR}))

        async def send() -> None:
            pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
            with __import__("contextlib").suppress(ConnectionClosed):
                for i in range(0, len(pcm), SR // 50):
                    await ws.send(pcm[i : i + SR // 50].tobytes())
                    await asyncio.sleep(0.005)

        sender = asyncio.create_task(send())
        try:
            async with asyncio.timeout(limit_s):
                while True:
                    msg = await ws.recv()
                    if isinstance(msg, bytes):
                        continue
                    ev = json.loads(msg)
                    events.append(ev)
                    if ev["type"] == "response.done" and ev.get("status") == "completed":
                        break
                    if ev["type"] == "error" and ev.get("code") == "stage_failed":
                        # give the session a moment: it may go on (turn failed) or be closed (1011)
                        with __import__("contextlib").suppress(TimeoutError):
                            async with asyncio.timeout(3.0):
                                async for more in ws:
                                    if isinstance(more, str):
                                        events.append(json.loads(more))
                        break
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd else None
        finally:
            sender.cancel()
        if code is None and ws.close_code is not None and ws.close_code != 1000:
            code = ws.close_code
    return events, code


def speech(text: str, amplitude: float) -> np.ndarray:
    quiet = np.zeros(int(0.3 * SR), dtype=np.float32)
    return np.concatenate(
        [quiet, tone_speech(text, amplitude=amplitude), np.zeros(int(1.2 * SR), np.float32)]
    )


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("stage", list(VICTIM))
async def test_injected_fault_fails_only_its_session(stage: str, fault: str) -> None:
    amplitude, words, trigger = VICTIM[stage]
    # the budget is generous: a loaded 2-core CI machine once took 0.3 s for a fake llm step
    stages = with_fault(fake_stages(scripted_answer), stage, fault, trigger, hang_s=3.0)
    limits = ServiceLimits(max_sessions=4, stage_timeout_s=1.0, max_stage_failures=3)
    service = DuplexService(load_profile("cpu"), stages, limits=limits)
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    await srv.start()
    url = f"ws://127.0.0.1:{srv.port}/v1/duplex"
    try:
        (victim, code), (bystander, _) = await asyncio.gather(
            converse(url, speech(words, amplitude)), converse(url, speech(QUESTION, 0.3))
        )
        errors = [e for e in victim if e["type"] == "error"]
        assert errors and errors[0]["code"] == "stage_failed", [e["type"] for e in victim]
        assert code in (None, 1011)
        if code == 1011:
            assert any(e.get("code") == "session_failed" for e in errors)
        assert not any(e["type"] == "response.done" and e["status"] == "completed" for e in victim)
        # the parallel session: its answer, whole, and no error
        assert [e["type"] for e in bystander if e["type"] == "error"] == []
        assert next(e for e in bystander if e["type"] == "response.done")["text"] == ANSWER
        # and the server still serves a new session
        again, _ = await converse(url, speech(QUESTION, 0.3))
        assert next(e for e in again if e["type"] == "response.done")["text"] == ANSWER
        kind = {"raise": "exception", "oom": "memory", "hang": "timeout", "nan": "bad_output"}[fault]
        assert (
            sample(service.metrics.render().decode(), "duplex_stage_failures_total", stage=stage, kind=kind)
            or 0
        ) >= 1
    finally:
        await srv.close()
        service.close()
