"""What a session creates is freed by reference counting alone, never left for the cycle collector.

With the models loaded, Python's collector starts a full pass only after minutes of new objects, so
anything in a reference cycle (a finished job and its future held each other, and with them the job's
dialogue state: KV caches, logits) stayed alive that long: the soak's ~40 MB a minute. Tiny tone stages."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

from duplex.base.config import load_profile
from duplex.core.jobs import Job
from duplex.core.session import SessionCore
from duplex.runtime.heap import GcPauses, freeze_loaded
from duplex.runtime.runner import SessionRunner
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.fakes import fake_stages, scripted_answer
from duplex.transports.native import DuplexServer, ServerSettings

from .test_faults import QUESTION, converse, speech


def count(kind: type) -> int:
    # type(), not isinstance: a dead weak proxy among the objects raises on isinstance
    return sum(1 for o in gc.get_objects() if issubclass(type(o), kind))


@contextlib.asynccontextmanager
async def fake_server() -> AsyncIterator[tuple[DuplexService, str]]:
    """A native server on the fake stages (2 sessions at most): the service and its WebSocket URL."""
    service = DuplexService(
        load_profile("cpu"), fake_stages(scripted_answer), limits=ServiceLimits(max_sessions=2)
    )
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    await srv.start()
    try:
        yield service, f"ws://127.0.0.1:{srv.port}/v1/duplex"
    finally:
        await srv.close()
        service.close()


@pytest.fixture
def no_cycle_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def test_finished_jobs_and_closed_sessions_need_no_cycle_collector(no_cycle_collector: None) -> None:
    before = {kind: count(kind) for kind in (Job, SessionCore, SessionRunner)}
    async with fake_server() as (service, url):
        events, code = await converse(url, speech(QUESTION, 0.3))
        assert any(e["type"] == "response.done" and e["status"] == "completed" for e in events)
        assert code is None
        jobs_run = sum(s["jobs"] for s in service.executor.stats().values())
        assert jobs_run > 50  # VAD, ASR, LLM and TTS jobs of a whole turn ran
        # /stats counts the LLM tokens generated (the load bench's tokens/s): the answer's words at least,
        # speculative answers to partial transcripts included
        assert service.stats()["llm"]["tokens"] >= len("paris is the capital of france".split())
    # the session's runner, core and every job it submitted are gone without a collection
    assert {kind: count(kind) - n for kind, n in before.items()} == {Job: 0, SessionCore: 0, SessionRunner: 0}


def test_gc_pauses_are_reported_and_freeze_keeps_objects_alive() -> None:
    seen: list[tuple[int, float, int]] = []
    pauses = GcPauses(lambda gen, s, n: seen.append((gen, s, n)))
    pauses.install()
    try:
        a: list[object] = []
        a.append(a)  # a cycle for the collector to free
        del a
        gc.collect()
    finally:
        pauses.remove()
    assert seen and seen[-1][0] == 2 and seen[-1][1] >= 0 and seen[-1][2] >= 1
    kept = [object()]
    try:
        assert freeze_loaded() >= 1
        assert gc.get_freeze_count() >= 1 and kept
    finally:
        gc.unfreeze()


async def test_a_session_whose_transport_failed_stops_all_its_tasks_on_close(
    no_cycle_collector: None,
) -> None:
    """A send that fails (the caller hung up mid-answer) stops the runner from inside; closing it must
    still cancel its ticker and its idle/duration guard, which would otherwise sleep on with the session
    (the guard for up to `idle_timeout_s`) and be destroyed pending when the loop closes."""
    import asyncio

    from duplex.core.events import ErrorEvent
    from duplex.transports.common import open_session

    before = count(SessionRunner)
    service = DuplexService(
        load_profile("cpu"), fake_stages(scripted_answer), limits=ServiceLimits(max_sessions=2)
    )

    async def hung_up(_item: object) -> None:
        raise ConnectionResetError("the caller hung up")

    try:
        async with open_session(service, hung_up) as runner:
            core = runner.core
            await asyncio.sleep(0.05)  # the tasks are running: the guard sleeps until the idle timeout
            runner.emit(ErrorEvent(session_id=core.session_id, turn_id=0, t=0.0, code="probe", message="x"))
            for _ in range(50):
                if runner.failed is not None:
                    break
                await asyncio.sleep(0.01)
            assert isinstance(runner.failed, ConnectionResetError)
            tasks = list(runner._tasks)
            assert {t.get_name().split("-")[0] for t in tasks} >= {"ticker", "guard"}
        assert all(t.done() for t in tasks)
        mine = {t for t in asyncio.all_tasks() if t.get_name().endswith(runner.core.session_id)}
        assert not mine
        # the send's exception is kept (runner.failed) without its traceback, whose writer frame held the
        # runner: a cycle that kept each hung-up session's memory until a full collection (~100 MB a
        # minute in the soak with --hangups)
        assert runner.failed.__traceback__ is None
        del runner, tasks, mine
    finally:
        service.close()
    assert count(SessionRunner) == before


async def test_a_caller_who_hangs_up_is_freed_without_the_cycle_collector(no_cycle_collector: None) -> None:
    """A caller who drops the line mid-answer (no close handshake): the session's runner, core and jobs
    are freed by reference counting, as a caller who says goodbye is. (Here the server's reader sees the
    dead connection first; the failed-send path is the test above.)"""
    from duplex.bench.cli import tone_prompt
    from duplex.bench.load import hang_up_call

    before = {kind: count(kind) for kind in (Job, SessionCore, SessionRunner)}
    async with fake_server() as (service, url):
        for _ in range(3):
            got = await hang_up_call(url, tone_prompt(QUESTION))
            assert got["reached_audio"], got
        for _ in range(100):  # the server notices the dead connection on its own time
            if not service.sessions:
                break
            await asyncio.sleep(0.02)
        assert not service.sessions
    assert {kind: count(kind) - n for kind, n in before.items()} == {Job: 0, SessionCore: 0, SessionRunner: 0}


async def test_callers_who_hang_up_are_freed_while_another_call_goes_on(no_cycle_collector: None) -> None:
    """The hung-up sessions must go while a caller stays on the line. Every asyncio handle keeps the
    context it was scheduled in, and a context that held the session's core (for the log lines' ids)
    kept each hung-up session, its dialogue state and KV caches, alive for as long as any call went on:
    the hang-up soak's RSS growth (~6 MB per hung-up caller with the real models)."""
    import json

    from websockets.asyncio.client import connect

    from duplex.bench.cli import tone_prompt
    from duplex.bench.common import FRAME_SAMPLES, SR, float_to_pcm16
    from duplex.bench.load import hang_up_call

    before = count(SessionCore)
    async with fake_server() as (service, url):
        async with connect(url, compression=None) as staying:
            await staying.send(json.dumps({"type": "session.start", "sample_rate": SR}))

            async def microphone() -> None:  # the caller who stays: silence at the frame rate
                silence = float_to_pcm16(np.zeros(FRAME_SAMPLES, np.float32))
                while True:
                    await staying.send(silence)
                    await asyncio.sleep(FRAME_SAMPLES / SR)

            mic = asyncio.create_task(microphone())
            try:
                for _ in range(3):  # (two sessions at most: one hangs up at a time)
                    got = await hang_up_call(url, tone_prompt(QUESTION))
                    assert got["reached_audio"], got
                    for _ in range(100):  # the server notices the dead connection on its own time
                        if len(service.sessions) == 1:
                            break
                        await asyncio.sleep(0.02)
                    assert len(service.sessions) == 1
                # only the staying caller's core is alive, without a collection
                assert count(SessionCore) - before == 1
            finally:
                mic.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await mic
