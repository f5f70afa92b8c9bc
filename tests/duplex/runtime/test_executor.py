"""The device executor: EDF order, batching across sessions, lanes, overruns, failures."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from duplex.runtime.executor import DeviceExecutor, Job


class Recorder:
    """A stage that records the order and batch sizes of what it ran; `delay` per batch."""

    def __init__(self, kind: str, delay: float = 0.0, gate: threading.Event | None = None) -> None:
        self.kind = kind
        self.delay = delay
        self.gate = gate
        self.calls: list[list[str]] = []

    def init_state(self) -> int:
        return 0

    def step(self, state: int, chunk: str) -> tuple[str, int]:
        return self.step_batch([(state, chunk)])[0]

    def step_batch(self, items: Sequence[tuple[int, str]]) -> list[tuple[str, int]]:
        if self.gate is not None:
            self.gate.wait(5)
        self.calls.append([chunk for _, chunk in items])
        if self.delay:
            time.sleep(self.delay)
        if any(chunk == "boom" for _, chunk in items):
            raise ValueError("stage exploded")
        return [(chunk.upper(), state + 1) for state, chunk in items]


def job(stage: str, session: str, chunk: str, deadline: float, label: str | None = None) -> Job:
    return Job(
        stage=stage,
        label=label or stage,
        session_id=session,
        turn_id=1,
        state=0,
        chunk=chunk,
        deadline=deadline,
    )


def test_earliest_deadline_first_and_batching_across_sessions():
    gate = threading.Event()
    ex = DeviceExecutor(bulk_workers=1, realtime_stages=())
    blocker = Recorder("block", gate=gate)
    asr = Recorder("asr")
    llm = Recorder("llm")
    for st in (blocker, asr, llm):
        ex.register(st)
    now = ex.now()
    first = ex.submit(job("block", "s0", "x", now + 0.01))  # occupies the worker while we queue
    time.sleep(0.05)
    futs = [
        ex.submit(job("llm", "s1", "late", now + 5.0)),
        ex.submit(job("asr", "s1", "a1", now + 1.0)),
        ex.submit(job("asr", "s2", "a2", now + 2.0)),
        ex.submit(job("asr", "s3", "a3", now + 3.0)),
        ex.submit(job("llm", "s2", "early", now + 0.5)),
    ]
    gate.set()
    results = [f.result(5) for f in [first, *futs]]
    assert results[1:] == [("LATE", 1), ("A1", 1), ("A2", 1), ("A3", 1), ("EARLY", 1)]
    # the earliest deadline (llm 'early', 0.5) ran first, batched with the other session's llm job;
    # then the three sessions' asr jobs ran as one call
    assert llm.calls == [["early", "late"]]
    assert asr.calls == [["a1", "a2", "a3"]]
    ex.close()


def test_a_long_bulk_job_never_delays_the_realtime_lane():
    ex = DeviceExecutor(bulk_workers=1, realtime_stages=("vad",))
    slow = Recorder("llm", delay=0.5)
    vad = Recorder("vad")
    ex.register(slow)
    ex.register(vad)
    now = ex.now()
    ex.submit(job("llm", "s1", "prefill", now + 1.0))
    time.sleep(0.02)
    t0 = time.perf_counter()
    assert ex.submit(job("vad", "s2", "w", now + 0.03)).result(2) == ("W", 1)
    assert time.perf_counter() - t0 < 0.1  # not stuck behind the 0.5 s job
    ex.close()


def test_a_remote_stage_step_never_holds_the_bulk_worker():
    """The engine's step runs in another process: while it is in flight a TTS job runs on the bulk worker."""
    gate = threading.Event()
    ex = DeviceExecutor(bulk_workers=1, realtime_stages=("vad",), remote_stages=("llm",))
    llm = Recorder("llm", gate=gate)
    tts = Recorder("tts")
    ex.register(llm)
    ex.register(tts)
    now = ex.now()
    held = ex.submit(job("llm", "s1", "step", now + 0.01))
    time.sleep(0.02)
    # the llm job is blocked on its gate (the other process computing); the TTS job is due later and still runs
    assert ex.submit(job("tts", "s2", "chunk", now + 1.0)).result(2) == ("CHUNK", 1)
    assert not held.done()
    assert ex.queue_depth() == {"realtime": 0, "bulk": 0, "remote": 0}
    gate.set()
    assert held.result(2) == ("STEP", 1)
    names = {
        t.name.rstrip("0123456789").rstrip("-") for t in threading.enumerate() if t.name.startswith("exec-")
    }
    assert {"exec-realtime", "exec-bulk", "exec-remote"} <= names
    ex.close()


def test_the_remote_lane_batches_and_orders_like_the_bulk_lane():
    gate = threading.Event()
    ex = DeviceExecutor(bulk_workers=1, realtime_stages=(), remote_stages=("llm",))
    llm = Recorder("llm", gate=gate)
    ex.register(llm)
    now = ex.now()
    first = ex.submit(job("llm", "s0", "a", now + 0.01))
    time.sleep(0.05)
    late = ex.submit(job("llm", "s1", "late", now + 5.0))
    early = ex.submit(job("llm", "s2", "early", now + 0.5))
    gate.set()
    assert [f.result(5)[0] for f in (first, late, early)] == ["A", "LATE", "EARLY"]
    assert llm.calls == [["a"], ["early", "late"]]
    ex.close()


def test_remote_lane_arguments_are_checked():
    with pytest.raises(ValueError, match="both realtime and remote"):
        DeviceExecutor(realtime_stages=("vad",), remote_stages=("vad",))
    with pytest.raises(ValueError, match="remote_workers"):
        DeviceExecutor(remote_stages=("llm",), remote_workers=0)
    ex = DeviceExecutor(remote_workers=0)  # no remote stage: no remote lane, no worker needed
    assert set(ex.queue_depth()) == {"realtime", "bulk"}
    ex.close()


def test_overruns_and_failures_are_counted_per_label_and_do_not_kill_workers():
    ex = DeviceExecutor(bulk_workers=1, realtime_stages=())
    st = Recorder("tts", delay=0.03)
    ex.register(st)
    now = ex.now()
    ex.submit(job("tts", "s1", "a", now + 0.001, label="tts")).result(2)  # misses its deadline
    ex.submit(job("tts", "s1", "b", now + 10, label="tts")).result(2)
    bad = ex.submit(job("tts", "s1", "boom", now + 10, label="tts"))
    with pytest.raises(ValueError, match="exploded"):
        bad.result(2)
    assert ex.submit(job("tts", "s1", "c", ex.now() + 10, label="tts")).result(2) == ("C", 1)
    stats = ex.stats()["tts"]
    assert stats["jobs"] == 4 and stats["overruns"] == 1 and stats["failures"] == 1
    assert stats["run_total_s"] >= 0.09
    ex.close()


async def test_asyncio_callers_are_not_blocked():
    ex = DeviceExecutor(bulk_workers=1, realtime_stages=())
    ex.register(Recorder("llm", delay=0.3))
    ticks = 0

    async def ticker():
        nonlocal ticks
        for _ in range(20):
            await asyncio.sleep(0.01)
            ticks += 1

    t = asyncio.create_task(ticker())
    out = await ex.run(job("llm", "s1", "hi", ex.now() + 1))
    await t
    assert out == ("HI", 1) and ticks == 20
    ex.close()


def test_closed_executor_refuses_and_fails_pending():
    ex = DeviceExecutor(bulk_workers=1)
    ex.register(Recorder("llm"))
    ex.close()
    with pytest.raises(RuntimeError, match="closed"):
        ex.submit(job("llm", "s1", "x", 0))


def test_cancel_session_drops_its_queued_jobs_and_leaves_the_others() -> None:
    """A closed session's queued jobs are dropped (futures cancelled) and others' run: a hung-up
    caller's work neither runs nor holds its state behind the live sessions'."""
    gate = threading.Event()
    stage = Recorder("s", gate=gate)
    ex = DeviceExecutor(bulk_workers=1, realtime_stages=())
    ex.register(stage)
    try:
        first = ex.submit(job("s", "a", "x", 1.0))  # holds the only worker until the gate opens
        time.sleep(0.05)
        dead = [ex.submit(job("s", "dead", f"d{k}", 2.0 + k)) for k in range(3)]
        alive = ex.submit(job("s", "b", "y", 9.0))
        assert ex.cancel_session("dead") == 3 and ex.cancel_session("dead") == 0
        gate.set()
        assert first.result(5)[0] == "X" and alive.result(5)[0] == "Y"
        assert all(f.cancelled() for f in dead)
        assert not any(c.startswith("d") for call in stage.calls for c in call)  # they never ran
    finally:
        gate.set()
        ex.close()


def test_a_finished_batch_is_not_kept_alive_by_the_watchdog() -> None:
    """The watchdog looks at the running batches every 50 ms; its frame must not keep the last one it
    saw (with the jobs' results: a session's dialogue state and, through the futures' callbacks, its
    runner) once the batch is done. It did, which kept a hung-up session's KV caches alive."""
    import gc
    import weakref

    class Heavy:
        pass

    class Holder:
        kind = "hold"

        def init_state(self):
            return None

        def step_batch(self, items):
            time.sleep(0.15)  # running long enough for the watchdog to look at it
            return [(chunk, Heavy()) for _, chunk in items]

    ex = DeviceExecutor(bulk_workers=1, realtime_stages=(), stage_timeout_s=5.0)
    ex.register(Holder())
    gc.disable()
    try:
        fut = ex.submit(job("hold", "gone", "x", 1.0))
        state = weakref.ref(fut.result(5)[1])
        done = weakref.ref(fut)
        del fut
        time.sleep(0.2)  # a few watchdog passes with nothing running
        assert done() is None and state() is None
    finally:
        gc.enable()
        ex.close()
