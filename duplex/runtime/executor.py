"""The device executor: the one place where model code runs.

Every neural step of every session is a `Job` with a deadline derived from the per-chunk budget
in models.yaml. Worker threads take jobs earliest-deadline-first and batch queued jobs of the
same stage across sessions into one `step_batch` call. Overruns (a job finishing after its
deadline) are counted per budget label and reported by `stats()`.

A batching stage may have a gather window (`gather_ms`, the LLM's from `limits.llm_gather_ms`):
after taking a job, a bulk or remote worker waits up to that long for the same stage's jobs of other
sessions that submitted one recently (a decode step's next job arrives a moment after the last
batch's results went out), never past the first job's deadline, never while a job of another stage
falls due first, and never on the realtime lane.

Jobs are split into two lanes so that a long, unpreemptible job (an LLM prefill, a Moonshine
transcription) can never delay the tiny real-time jobs (the VAD windows that detect barge-in):
the `realtime` lane has its own worker. Within a lane the order is EDF.

A stage that runs in another process (`remote_stages`: the dialogue engine behind
`duplex.runtime.stage_process`) gets a lane of its own, the `remote` lane, with its own worker(s). Its
worker only waits on a socket while the other process computes, so it need not hold the bulk worker
meanwhile: on one bulk worker, a TTS chunk or a transcription that falls due during an LLM step waits
for that step to end although a core may be free for it. The service does so with `limits.engine_lane`
(off by default: on two cores the overlap slowed the engine's own steps more than it saved).

Fault isolation: a batch that raises is re-run job by job, so only the session whose input broke
the stage fails; a result that fails its stage's `check` (NaN audio, say) fails that one job; a
job running past `stage_timeout_s` is abandoned (its future fails with `StageTimeout`) and its
worker replaced, as is a worker that dies. The session core turns a failed job into an `error`
event for that session only.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from duplex.base.stage import StreamingStage
from duplex.core.jobs import Job

log = logging.getLogger("duplex.runtime.executor")

MAX_ABANDONED_WORKERS = 32  # hung threads cannot be killed; past this many, stop replacing them
#: a session that submitted a job of a stage this recently is waited for by that stage's gather window
GATHER_HORIZON_S = 1.0


class StageFailure(RuntimeError):
    """A stage job failed; `kind` is exception, memory, timeout, bad_output or worker_died."""

    kind = "exception"


class StageTimeout(StageFailure):
    """The job ran past `stage_timeout_s`; its worker was replaced."""

    kind = "timeout"


class StageOutputError(StageFailure):
    """The stage returned something its check refused (non-finite audio, probabilities out of range)."""

    kind = "bad_output"


class WorkerDied(StageFailure):
    """The worker thread running the job ended with an exception that is not an `Exception`."""

    kind = "worker_died"


def failure_kind(exc: BaseException) -> str:
    if isinstance(exc, StageFailure):
        return exc.kind
    return "memory" if isinstance(exc, MemoryError) else "exception"


@dataclass
class LabelStats:
    count: int = 0
    overruns: int = 0
    failures: int = 0
    run_total: float = 0.0  # seconds of worker time, shared evenly by the jobs of a batch
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=2000))
    runs: deque[float] = field(default_factory=lambda: deque(maxlen=2000))
    batch_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=2000))
    gathered: int = 0  # jobs that joined their batch during a gather window


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
        remote_stages: Sequence[str] = (),
        remote_workers: int = 1,
        max_batch: int = 16,
        clock: Callable[[], float] = time.monotonic,
        on_thread_start: Callable[[], None] | None = None,
        stage_timeout_s: float | None = None,
        on_batch: Callable[[str, float, float, bool], None] | None = None,
        on_failure: Callable[[str, str], None] | None = None,
        on_restart: Callable[[str], None] | None = None,
        gather_ms: Mapping[str, float] | None = None,
    ) -> None:
        """`gather_ms`: per stage name, how long a worker may wait to fill a batch (0: no wait).
        `remote_stages`: stages whose steps run in another process; their jobs go to the `remote` lane and
        its `remote_workers` threads instead of the bulk workers."""
        self._clock = clock
        self._stages: dict[str, StreamingStage[Any, Any, Any]] = {}
        self._realtime = set(realtime_stages)
        self._remote = set(remote_stages)
        if self._realtime & self._remote:
            raise ValueError(
                f"a stage cannot be both realtime and remote: {sorted(self._realtime & self._remote)}"
            )
        if self._remote and remote_workers < 1:
            raise ValueError(f"remote_workers must be >= 1 with remote stages, got {remote_workers}")
        self._max_batch = max_batch
        self._gather: dict[str, float] = {}
        for stage_name, ms in (gather_ms or {}).items():
            if ms < 0:
                raise ValueError(f"gather_ms of {stage_name!r} must be >= 0, got {ms}")
            if ms and stage_name in self._realtime:
                raise ValueError(f"no gather window on the realtime lane ({stage_name!r})")
            if ms:
                self._gather[stage_name] = ms / 1000.0
        #: per gathering stage: session -> when it last submitted a job of it (time.monotonic)
        self._recent: dict[str, dict[str, float]] = {name: {} for name in self._gather}
        self._cv = threading.Condition()
        self._lanes = {"realtime": _Lane("realtime"), "bulk": _Lane("bulk")}
        if self._remote:
            self._lanes["remote"] = _Lane("remote")
        self._seq = itertools.count()
        self._stats: dict[str, LabelStats] = defaultdict(LabelStats)
        self._closed = False
        self._busy = 0
        self._on_thread_start = on_thread_start
        self._checks: dict[str, Callable[[Any], None]] = {}
        self._timeout = stage_timeout_s
        self._on_batch = on_batch
        self._on_failure = on_failure
        self._on_restart = on_restart
        self._tokens = itertools.count()
        self._running: dict[int, tuple[float, list[Job]]] = {}  # worker token -> (monotonic start, batch)
        self._abandoned: set[int] = set()
        self._solo: set[int] = set()  # ids of jobs re-queued from a hung batch: they run alone
        self.restarts = 0
        self._threads: list[threading.Thread] = []
        self._spawn("realtime")
        for _ in range(bulk_workers):
            self._spawn("bulk")
        for _ in range(remote_workers if self._remote else 0):
            self._spawn("remote")
        if stage_timeout_s is not None:
            watchdog = threading.Thread(target=self._watchdog, name="exec-watchdog", daemon=True)
            watchdog.start()
            self._threads.append(watchdog)

    def register(
        self,
        stage: StreamingStage[Any, Any, Any],
        name: str | None = None,
        check: Callable[[Any], None] | None = None,
    ) -> None:
        """Make a stage runnable; jobs name it by `name` (default: the stage's kind).

        `check(out)` runs on the worker for every result and raises to refuse it (the job fails)."""
        self._stages[name or stage.kind] = stage
        if check is not None:
            self._checks[name or stage.kind] = check

    def _lane_of(self, stage: str) -> str:
        if stage in self._realtime:
            return "realtime"
        return "remote" if stage in self._remote else "bulk"

    def now(self) -> float:
        return self._clock()

    def submit(self, job: Job) -> Future[tuple[Any, Any]]:
        """Queue a job; its future resolves to (out, new_state) or to the stage's exception."""
        if job.stage not in self._stages:
            raise KeyError(f"no stage registered as {job.stage!r}")
        job.submitted = self._clock()
        lane = self._lanes[self._lane_of(job.stage)]
        with self._cv:
            if self._closed:
                raise RuntimeError("executor is closed")
            heapq.heappush(lane.heap, (job.deadline, next(self._seq), job))
            recent = self._recent.get(job.stage)
            if recent is not None:
                recent[job.session_id] = time.monotonic()
            self._cv.notify_all()
        return job.future

    async def run(self, job: Job) -> tuple[Any, Any]:
        """Submit from asyncio and await the result without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(job))

    def cancel_session(self, session_id: str) -> int:
        """Drop a closed session's queued jobs (their futures are cancelled) and forget it as a batch
        partner to wait for; how many jobs were dropped. Jobs already running finish (their results
        are ignored by the closed session). Without this a hung-up caller's jobs still ran, and held
        its dialogue state, behind every live session's."""
        dropped: list[Job] = []
        with self._cv:
            for lane in self._lanes.values():
                keep = [entry for entry in lane.heap if entry[2].session_id != session_id]
                if len(keep) != len(lane.heap):
                    dropped += [entry[2] for entry in lane.heap if entry[2].session_id == session_id]
                    heapq.heapify(keep)
                    lane.heap[:] = keep
            for recent in self._recent.values():
                recent.pop(session_id, None)
            for job in dropped:
                self._solo.discard(id(job))
            self._cv.notify_all()
        for job in dropped:
            job.future.cancel()
        return len(dropped)

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
                "batch_mean": round(sum(s.batch_sizes) / len(s.batch_sizes), 3) if s.batch_sizes else 0.0,
                "batch_max": max(s.batch_sizes, default=0),
                "gathered": s.gathered,
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
        deadline = time.monotonic() + 5.0  # one bound for all: a hung stage must not stall shutdown
        for t in list(self._threads):
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, deadline - time.monotonic()))

    # -- worker side -------------------------------------------------------------------

    def _take_batch(self, lane: _Lane) -> list[Job]:
        """Pop the earliest-deadline job and every queued job of the same stage (other sessions)."""
        _, _, first = heapq.heappop(lane.heap)
        batch = [first]
        self._take_more(lane, batch)
        return batch

    def _take_more(self, lane: _Lane, batch: list[Job]) -> int:
        """Move queued jobs of the batch's stage from sessions not in it yet into it; how many."""
        first = batch[0]
        if not lane.heap or len(batch) >= self._max_batch or id(first) in self._solo:
            return 0
        sessions = {job.session_id for job in batch}
        keep: list[tuple[float, int, Job]] = []
        taken = 0
        for entry in sorted(lane.heap):
            job = entry[2]
            if (
                len(batch) < self._max_batch
                and job.stage == first.stage
                and job.session_id not in sessions
                and id(job) not in self._solo
            ):
                batch.append(job)
                sessions.add(job.session_id)
                taken += 1
            else:
                keep.append(entry)
        if taken:
            heapq.heapify(keep)
            lane.heap[:] = keep
        return taken

    def _gather_more(self, lane: _Lane, batch: list[Job]) -> int:
        """Wait (lock held, released while waiting) up to the stage's gather window for jobs of
        the sessions that recently used the stage and are not in the batch; jobs gathered."""
        first = batch[0]
        window = self._gather.get(first.stage, 0.0)
        if not window or len(batch) >= self._max_batch or id(first) in self._solo:
            return 0
        start = time.monotonic()
        end = start + min(window, first.deadline - self._clock())
        recent = self._recent[first.stage]
        for session, seen in list(recent.items()):
            if start - seen > GATHER_HORIZON_S:
                del recent[session]
        gathered = 0
        while not self._closed and len(batch) < self._max_batch:
            if not set(recent) - {job.session_id for job in batch}:
                break  # no other session is likely to come
            if lane.heap and lane.heap[0][0] < first.deadline:
                break  # a job of another stage (or the same session) is due first: EDF runs it next
            left = end - time.monotonic()
            if left <= 0:
                break
            self._cv.wait(left)
            gathered += self._take_more(lane, batch)
        return gathered

    def _spawn(self, lane_name: str) -> None:
        token = next(self._tokens)
        name = "exec-realtime" if lane_name == "realtime" else f"exec-{lane_name}-{token}"
        thread = threading.Thread(target=self._worker, args=(lane_name, token), name=name, daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _replace(self, lane_name: str, reason: str) -> None:
        """Start a new worker for a lane whose worker hung or died (call with the lock held)."""
        if self._closed:
            return
        if len(self._abandoned) >= MAX_ABANDONED_WORKERS:
            log.critical(
                "not replacing a %s worker (%s): %d workers already abandoned",
                lane_name,
                reason,
                len(self._abandoned),
            )
            return
        self.restarts += 1
        log.error("replacing a %s worker (%s)", lane_name, reason)
        self._spawn(lane_name)
        if self._on_restart is not None:
            self._on_restart(reason)

    def _worker(self, lane_name: str, token: int) -> None:
        if self._on_thread_start is not None:
            self._on_thread_start()
        lane = self._lanes[lane_name]
        batch: list[Job] = []
        try:
            while True:
                with self._cv:
                    while not lane.heap and not self._closed:
                        self._cv.wait()
                    if self._closed:
                        return
                    batch = self._take_batch(lane)
                    gathered = self._gather_more(lane, batch) if lane_name != "realtime" else 0
                    self._busy += 1
                    self._running[token] = (time.monotonic(), batch)
                try:
                    self._run_batch(batch, gathered)
                finally:
                    with self._cv:
                        self._busy -= 1
                        self._running.pop(token, None)
                        abandoned = token in self._abandoned
                        self._abandoned.discard(token)
                if abandoned:  # the watchdog gave up on this thread and started another
                    return
                batch = []
        except BaseException as exc:  # SystemExit, KeyboardInterrupt...: the thread dies; replace it
            log.critical("%s worker died: %r", lane_name, exc)
            self._fail(batch, WorkerDied(f"the worker running this job died: {exc!r}"))
            with self._cv:
                if token not in self._abandoned:
                    self._replace(lane_name, "died")
                self._abandoned.discard(token)

    def _watchdog(self) -> None:
        assert self._timeout is not None
        period = min(0.05, self._timeout / 4)
        while True:
            with self._cv:
                if self._closed:
                    return
                hung = self._hung_batches()
                self._cv.wait(period)
            self._fail_hung(hung)
            # nothing of a batch may stay bound in this frame while it waits: a finished batch's jobs
            # hold their results (a session's dialogue state) and their futures the session's runner
            del hung

    def _hung_batches(self) -> list[tuple[str, list[Job]]]:
        """(lock held) Batches running past the timeout: replace their worker; a batch of several is
        re-queued job by job (only the culprit hangs again), a single job is returned to fail."""
        assert self._timeout is not None
        hung: list[tuple[str, list[Job]]] = []
        now = time.monotonic()
        for token, (started, batch) in self._running.items():
            if token not in self._abandoned and now - started > self._timeout:
                self._abandoned.add(token)
                lane = self._lane_of(batch[0].stage)
                self._replace(lane, "hang")
                if len(batch) > 1:
                    # which job hangs is unknown: run each alone; only the culprit hangs again
                    log.warning(
                        "a batch of %d %s jobs hung; re-running them one by one", len(batch), batch[0].stage
                    )
                    for job in batch:
                        self._solo.add(id(job))
                        heapq.heappush(self._lanes[lane].heap, (job.deadline, next(self._seq), job))
                    self._cv.notify_all()
                else:
                    self._solo.discard(id(batch[0]))
                    hung.append((lane, batch))
        return hung

    def _fail_hung(self, hung: list[tuple[str, list[Job]]]) -> None:
        assert self._timeout is not None
        for _, batch in hung:
            log.error(
                "stage %s hung for over %.1f s on a batch of %d", batch[0].stage, self._timeout, len(batch)
            )
            self._fail(batch, StageTimeout(f"{batch[0].stage} took longer than {self._timeout:g} s"))

    def _fail(self, jobs: list[Job], error: BaseException) -> None:
        for job in jobs:
            if self._settle(job, error=error) and self._on_failure is not None:
                self._on_failure(job.stage, failure_kind(error))

    @staticmethod
    def _settle(job: Job, result: Any = None, error: BaseException | None = None) -> bool:
        """Resolve a job's future once; False if it was already resolved (abandoned by the watchdog)."""
        try:
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)
        except InvalidStateError:
            return False
        return True

    def _step_each(self, stage: StreamingStage[Any, Any, Any], batch: list[Job]) -> list[Any]:
        """Results of a batch, or per job an exception: a failing batch is re-run job by job."""
        try:
            return list(stage.step_batch([(job.state, job.chunk) for job in batch]))
        except Exception as exc:  # a stage failure must fail its jobs, not the worker
            if len(batch) == 1:
                log.error("stage %s failed: %r", batch[0].stage, exc)
                return [exc]
            log.warning(
                "stage %s failed on a batch of %d; re-running it job by job", batch[0].stage, len(batch)
            )
        out: list[Any] = []
        for job in batch:
            try:
                out.append(stage.step_batch([(job.state, job.chunk)])[0])
            except Exception as exc:
                log.error("stage %s failed for session %s: %r", job.stage, job.session_id, exc)
                out.append(exc)
        return out

    def _run_batch(self, batch: list[Job], gathered: int = 0) -> None:
        stage = self._stages[batch[0].stage]
        check = self._checks.get(batch[0].stage)
        start = self._clock()
        results = self._step_each(stage, batch)
        end = self._clock()
        outcomes: list[tuple[Any, BaseException | None]] = []
        for result in results:
            if isinstance(result, BaseException):
                outcomes.append((None, result))
                continue
            try:
                if check is not None:
                    check(result[0])
                outcomes.append((result, None))
            except Exception as exc:
                outcomes.append((None, StageOutputError(f"{batch[0].stage} output refused: {exc}")))
        with self._cv:
            for job, (_, error) in zip(batch, outcomes, strict=True):
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
            for job in batch[len(batch) - gathered :] if gathered else ():
                self._stats[job.label].gathered += 1
        if self._solo:
            with self._cv:
                for job in batch:
                    self._solo.discard(id(job))
        for job, (result, error) in zip(batch, outcomes, strict=True):
            if self._on_batch is not None:
                self._on_batch(job.label, start - job.submitted, end - start, end > job.deadline)
            if error is not None:
                self._fail([job], error)
            else:
                self._settle(job, result)
