"""The executor's gather window: a bulk worker waits a moment to batch a stage's jobs of sessions
that use it, never for a session that does not, never past the first job's deadline, never while
another stage's job is due first, and never on the realtime lane."""

from __future__ import annotations

import threading
import time

import pytest

from duplex.base.config import ConfigError
from duplex.base.limits import ServerLimits
from duplex.runtime.executor import DeviceExecutor
from duplex.testing.replay import FakeClock
from tests.duplex.runtime.test_executor import Recorder, job


def executor(window_ms: float, **kw) -> tuple[DeviceExecutor, Recorder]:
    ex = DeviceExecutor(bulk_workers=1, realtime_stages=("vad",), gather_ms={"llm": window_ms}, **kw)
    llm = Recorder("llm")
    ex.register(llm)
    return ex, llm


def both_sessions_used_the_stage(ex: DeviceExecutor, llm: Recorder) -> None:
    """One batch with s1 and s2 (queued behind a closed gate), so both count as recent users."""
    gate = threading.Event()
    llm.gate = gate
    futs = [ex.submit(job("llm", s, f"{s}-0", ex.now() + 5)) for s in ("s1", "s2")]
    time.sleep(0.05)
    gate.set()
    for f in futs:
        f.result(2)
    llm.gate = None


@pytest.mark.parametrize("window_ms", [0, 400])
def test_a_job_arriving_within_the_window_joins_the_batch(window_ms):
    ex, llm = executor(window_ms)
    both_sessions_used_the_stage(ex, llm)
    first = ex.submit(job("llm", "s1", "a", ex.now() + 5))
    time.sleep(0.05)  # s2's next step comes a moment later (its last result went out later)
    second = ex.submit(job("llm", "s2", "b", ex.now() + 5))
    assert first.result(2) == ("A", 1) and second.result(2) == ("B", 1)
    if window_ms:
        assert llm.calls[-1] == ["a", "b"]
        stats = ex.stats()["llm"]
        assert stats["gathered"] == 1 and stats["batch_max"] == 2 and stats["batch_mean"] == 2.0
        assert stats["wait_p90_ms"] >= 40  # the gather's wait is the first job's queue wait
    else:
        assert llm.calls[-2:] == [["a"], ["b"]]
        assert ex.stats()["llm"]["gathered"] == 0
    ex.close()


def test_a_lone_session_never_waits():
    ex, llm = executor(1000)
    ex.submit(job("llm", "s1", "warm", ex.now() + 5)).result(2)
    t0 = time.perf_counter()
    assert ex.submit(job("llm", "s1", "x", ex.now() + 5)).result(2) == ("X", 1)
    assert time.perf_counter() - t0 < 0.5
    ex.close()


def test_the_window_ends_at_the_gather_window_or_the_first_jobs_deadline():
    ex, llm = executor(300)
    both_sessions_used_the_stage(ex, llm)
    t0 = time.perf_counter()
    ex.submit(job("llm", "s1", "x", ex.now() + 5)).result(2)  # s2 never comes: the window ends it
    assert 0.25 < time.perf_counter() - t0 < 1.0
    ex.close()

    ex, llm = executor(5000)
    both_sessions_used_the_stage(ex, llm)
    t0 = time.perf_counter()
    ex.submit(job("llm", "s1", "x", ex.now() + 0.1)).result(2)  # ... or its deadline, before that
    assert time.perf_counter() - t0 < 1.0
    ex.close()


def test_the_deadline_bound_reads_the_executors_clock():
    clock = FakeClock(100.0)
    ex, llm = executor(5000, clock=clock)
    both_sessions_used_the_stage(ex, llm)
    t0 = time.perf_counter()
    ex.submit(job("llm", "s1", "x", 100.0)).result(2)  # due now by the injected clock: no wait
    assert time.perf_counter() - t0 < 1.0
    ex.close()


def test_a_job_of_another_stage_due_first_ends_the_gather():
    ex, llm = executor(3000)
    tts = Recorder("tts")
    ex.register(tts)
    both_sessions_used_the_stage(ex, llm)
    t0 = time.perf_counter()
    fut = ex.submit(job("llm", "s1", "x", ex.now() + 10))
    time.sleep(0.05)
    spoken = ex.submit(job("tts", "s3", "hello", ex.now() + 1))  # due before the llm job
    assert fut.result(2) == ("X", 1) and spoken.result(2) == ("HELLO", 1)
    assert time.perf_counter() - t0 < 1.0
    ex.close()


def test_the_realtime_lane_never_gathers_and_is_not_held_up():
    with pytest.raises(ValueError, match="realtime"):
        DeviceExecutor(realtime_stages=("vad",), gather_ms={"vad": 5})
    ex, llm = executor(2000)
    vad = Recorder("vad")
    ex.register(vad)
    both_sessions_used_the_stage(ex, llm)
    pending = ex.submit(job("llm", "s1", "x", ex.now() + 10))  # the bulk worker gathers for s2
    time.sleep(0.05)
    t0 = time.perf_counter()
    assert ex.submit(job("vad", "s1", "w", ex.now() + 0.03)).result(2) == ("W", 1)
    assert time.perf_counter() - t0 < 0.2
    pending.result(5)
    ex.close()


def test_the_llm_gather_window_is_a_limit_that_may_be_zero():
    assert ServerLimits().llm_gather_ms > 0
    assert ServerLimits().with_overrides({"llm_gather_ms": 0}).llm_gather_ms == 0
    with pytest.raises(ConfigError, match=">= 0"):
        ServerLimits().with_overrides({"llm_gather_ms": -1})
    with pytest.raises(ConfigError, match="positive"):
        ServerLimits().with_overrides({"stage_timeout_s": 0})
    with pytest.raises(ValueError, match=">= 0"):
        DeviceExecutor(gather_ms={"llm": -1})
