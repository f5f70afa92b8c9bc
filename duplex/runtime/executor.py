"""The device executor: the one place where model code runs.

Every neural step of every session is a `Job` with a deadline derived from the per-chunk budget
in models.yaml. Worker threads take jobs earliest-deadline-first and batch queued jobs of the
same stage across sessions into one `step_batch` call. Overruns (a job finishing after its
deadline) are counted per budget label and reported by `stats()`.

Jobs are split into two lanes so that a long, unpreemptible job (an LLM prefill, a Moonshine
transcription) can never delay the tiny real-time jobs (the VAD windows that detect barge-in):
the `realtime` lane has its own worker. Within a lane the order is EDF.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from duplex.base.stage import StreamingStage
from duplex.core.jobs import Job

log = logging.getLogger("duplex.runtime.executor")


@dataclass
class LabelStats:
    count: int = 0
    overruns: int = 0
    failures: int = 0
    run_total: float = 0.0  # seconds of worker time, shared evenly by the jobs of a batch
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=2000))
    runs: deque[float] = field(default_factory=lambda: deque(maxlen=2000))
    batch_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=2000))


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[idx]


class _Lane:
    def __init__(self, name: str) -> None:
        self.name = name
        self.heap: list[tuple[float, int, Job]] = []


class DeviceExecutor:
    """Runs stage steps for all sessions in worker threads, EDF per lane, batched per stage."""

    def __init__(
        self,
        *,
        bulk_workers: int = 1,
        realtime_stages: Sequence[str] = ("vad",),
        max_batch: int = 16,
        clock: Callable[[], float] = time.monotonic,
        on_thread_start: Callable[[], None] | None = None,
    ) -> None:
        self._clock = clock
        self._stages: dict[str, StreamingStage[Any, Any, Any]] = {}
        self._realtime = set(realtime_stages)
        self._max_batch = max_batch
        self._cv = threading.Condition()
        self._lanes = {"realtime": _Lane("realtime"), "bulk": _Lane("bulk")}
        self._seq = itertools.count()
        self._stats: dict[str, LabelStats] = defaultdict(LabelStats)
        self._closed = False
        self._busy = 0
        self._on_thread_start = on_thread_start
        self._threads = [
            threading.Thread(target=self._worker, args=("realtime",), name="exec-realtime", daemon=True)
        ] + [
            threading.Thread(target=self._worker, args=("bulk",), name=f"exec-bulk-{i}", daemon=True)
            for i in range(bulk_workers)
        ]
        for t in self._threads:
            t.start()

    def register(self, stage: StreamingStage[Any, Any, Any], name: str | None = None) -> None:
        """Make a stage runnable; jobs name it by `name` (default: the stage's kind)."""
        self._stages[name or stage.kind] = stage

    def now(self) -> float:
        return self._clock()

    def submit(self, job: Job) -> Future[tuple[Any, Any]]:
        """Queue a job; its future resolves to (out, new_state) or to the stage's exception."""
        if job.stage not in self._stages:
            raise KeyError(f"no stage registered as {job.stage!r}")
        job.submitted = self._clock()
        lane = self._lanes["realtime" if job.stage in self._realtime else "bulk"]
        with self._cv:
            if self._closed:
                raise RuntimeError("executor is closed")
            heapq.heappush(lane.heap, (job.deadline, next(self._seq), job))
            self._cv.notify_all()
        return job.future

    async def run(self, job: Job) -> tuple[Any, Any]:
        """Submit from asyncio and await the result without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(job))

    def queue_depth(self) -> dict[str, int]:
        with self._cv:
            return {name: len(lane.heap) for name, lane in self._lanes.items()}

    def stats(self) -> dict[str, dict[str, float]]:
        """Per budget label: jobs, overruns, failures and queue-wait / run-time percentiles (ms)."""
        out: dict[str, dict[str, float]] = {}
        with self._cv:
            items = list(self._stats.items())
        for label, s in sorted(items):
            out[label] = {
                "jobs": s.count,
                "overruns": s.overruns,
                "failures": s.failures,
                "run_total_s": round(s.run_total, 4),
                "wait_p50_ms": 1000 * _percentile(s.waits, 50),
                "wait_p90_ms": 1000 * _percentile(s.waits, 90),
                "run_p50_ms": 1000 * _percentile(s.runs, 50),
                "run_p90_ms": 1000 * _percentile(s.runs, 90),
                "batch_p50": _percentile(s.batch_sizes, 50),
                "batch_max": max(s.batch_sizes, default=0),
            }
        return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            pending = [job for lane in self._lanes.values() for _, _, job in lane.heap]
            for lane in self._lanes.values():
                lane.heap.clear()
            self._cv.notify_all()
        for job in pending:
            job.future.set_exception(RuntimeError("executor closed"))
        for t in self._threads:
            t.join(timeout=5)

    # -- worker side -------------------------------------------------------------------

    def _take_batch(self, lane: _Lane) -> list[Job]:
        """Pop the earliest-deadline job and every queued job of the same stage (other sessions)."""
        _, _, first = heapq.heappop(lane.heap)
        batch = [first]
        if len(lane.heap) and self._max_batch > 1:
            sessions = {first.session_id}
            keep: list[tuple[float, int, Job]] = []
            for entry in sorted(lane.heap):
                job = entry[2]
                if (
                    len(batch) < self._max_batch
                    and job.stage == first.stage
                    and job.session_id not in sessions
                ):
                    batch.append(job)
                    sessions.add(job.session_id)
                else:
                    keep.append(entry)
            heapq.heapify(keep)
            lane.heap[:] = keep
        return batch

    def _worker(self, lane_name: str) -> None:
        if self._on_thread_start is not None:
            self._on_thread_start()
        lane = self._lanes[lane_name]
        while True:
            with self._cv:
                while not lane.heap and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                batch = self._take_batch(lane)
                self._busy += 1
            try:
                self._run_batch(batch)
            finally:
                with self._cv:
                    self._busy -= 1

    def _run_batch(self, batch: list[Job]) -> None:
        stage = self._stages[batch[0].stage]
        start = self._clock()
        try:
            results = stage.step_batch([(job.state, job.chunk) for job in batch])
            error: BaseException | None = None
        except Exception as exc:  # a stage failure must fail its jobs, not the worker
            log.exception("stage %s failed on a batch of %d", batch[0].stage, len(batch))
            results, error = [], exc
        end = self._clock()
        with self._cv:
            for job in batch:
                s = self._stats[job.label]
                s.count += 1
                s.waits.append(start - job.submitted)
                s.runs.append(end - start)
                s.run_total += (end - start) / len(batch)
                s.batch_sizes.append(len(batch))
                if end > job.deadline:
                    s.overruns += 1
                if error is not None:
                    s.failures += 1
        if error is not None:
            for job in batch:
                job.future.set_exception(error)
            return
        for job, result in zip(batch, results, strict=True):
            job.future.set_result(result)
