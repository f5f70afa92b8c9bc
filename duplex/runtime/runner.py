"""Async glue between one `SessionCore`, the device executor and a transport.

The runner only moves things: jobs to the executor, results back into the core (on the event
loop thread), outputs into a bounded queue that the transport drains, and ticks at the times the
core asks for. It does no model work and holds no dialogue logic.

It also ends a session by the server's rules (`duplex.base.limits`): after `max_session_s`, after
`idle_timeout_s` without a client message, after `max_stage_failures` failed stage jobs (1011), or
when the server drains (1001): an `error` event first, then the transport's `terminate` callback
closes the connection with the code.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from duplex.base.limits import (
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    IDLE_TIMEOUT,
    SESSION_EXPIRED,
    ServerLimits,
)
from duplex.core.events import ErrorEvent, ServerEvent
from duplex.core.jobs import Job
from duplex.core.session import SessionCore
from duplex.runtime.executor import DeviceExecutor

log = logging.getLogger("duplex.runtime.runner")

Output = ServerEvent | bytes


class ClientTooSlow(RuntimeError):
    """The transport did not drain its output queue in time."""


class SessionEnded(RuntimeError):
    """The server ended the session by its rules; `code` is the WebSocket close code."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


@dataclass(frozen=True)
class _Terminate:
    """Queued behind the outputs already queued: the writer closes the connection when it gets here."""

    code: int
    reason: str


SESSION_FAILED = "session_failed"


def _detached(exc: BaseException) -> BaseException:
    """`exc` without its traceback and chained exceptions: kept on the runner, a traceback's frames (the
    writer's, whose `self` is the runner) would make a cycle that holds the whole session until a full
    garbage collection, minutes apart with the models loaded."""
    exc.__traceback__ = None
    exc.__context__ = exc.__cause__ = None
    return exc


class SessionRunner:
    """Drives one session core; `send` is awaited for every event and audio frame, in order."""

    def __init__(
        self,
        core: SessionCore,
        executor: DeviceExecutor,
        send: Callable[[Output], Awaitable[None]],
        *,
        max_queued_outputs: int = 1024,
        limits: ServerLimits | None = None,
        terminate: Callable[[int, str], Awaitable[None]] | None = None,
        observe: Callable[[ServerEvent], None] | None = None,
    ) -> None:
        self.core = core
        self.executor = executor
        self._send = send
        self._out: asyncio.Queue[Output | _Terminate | None] = asyncio.Queue(maxsize=max_queued_outputs)
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._tasks: list[asyncio.Task[None]] = []
        # jobs in flight by their future: the future's done callback must not hold its job, since the
        # job holds the future (a reference cycle that kept every finished job's states, KV caches and
        # logits alive until a full collection: the soak's ~40 MB a minute, docs/results/2026-11-26.md)
        self._inflight: dict[Future[tuple[Any, Any]], Job] = {}
        self._closed = False  # no more feeding, ticking or sending (the writer or a full queue may set it)
        self._shut = False  # close() ran: the tasks are cancelled and dropped
        self.failed: BaseException | None = None
        self.limits = limits
        self._terminate = terminate
        self._observe = observe
        self._context = contextvars.copy_context()  # worker callbacks log with this session's ids
        self.opened_at = self._loop.time()
        self.last_activity = self.opened_at
        self.stage_failures = 0
        self.ending: SessionEnded | None = None

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._writer(), name=f"writer-{self.core.session_id}"),
            asyncio.create_task(self._ticker(), name=f"ticker-{self.core.session_id}"),
        ]
        if self.limits is not None:
            self._tasks.append(asyncio.create_task(self._guard(), name=f"guard-{self.core.session_id}"))
        self._flush()

    def touch(self) -> None:
        """A client message arrived (for the idle timeout)."""
        self.last_activity = self._loop.time()

    def feed_audio(self, samples: np.ndarray) -> None:
        if self._closed:
            return
        self.touch()
        self.core.receive_audio(samples)
        self._flush()

    def control(self, event: dict[str, Any]) -> None:
        if self._closed:
            return
        self.touch()
        self.core.receive_control(event)
        self._flush()

    def answering(self) -> bool:
        """An answer is being prepared or played (a drain lets it finish)."""
        return not self._closed and (self.core.response is not None or self.core.playout.pending())

    def end(self, code: int, reason: str, error_code: str, message: str) -> None:
        """End the session by the server's rules: an `error` event, then the connection closes with `code`."""
        if self._closed or self.ending is not None:
            return
        self.ending = SessionEnded(code, reason)
        log.info("session %s: ending (%d %s): %s", self.core.session_id, code, error_code, message)
        core = self.core
        self._enqueue(
            ErrorEvent(
                session_id=core.session_id,
                turn_id=core.turn_id,
                t=core.clock(),
                code=error_code,
                message=message,
            )
        )
        if self._closed:  # the queue was full
            return
        try:
            self._out.put_nowait(_Terminate(code, reason))
        except asyncio.QueueFull:
            self._stop(self.ending)

    def emit(self, event: ServerEvent) -> None:
        """Send an event that did not come from the core (e.g. a transport-level error)."""
        self._enqueue(event)

    async def close(self) -> None:
        """Stop ticking and sending; results still in flight are discarded by the core. Cancels the
        runner's tasks even when the session had already stopped itself (a send failed, the server ended
        it, the client stopped reading): those set `_closed` first, and the ticker and the guard would
        otherwise sleep on, holding the session, until the event loop closes."""
        if self._shut:
            return
        self._shut = True
        if not self._closed:
            self._closed = True
            self.core.close()
        cancel = getattr(self.executor, "cancel_session", None)  # test doubles may lack it
        if cancel is not None:
            cancel(self.core.session_id)
        self._inflight.clear()
        for task in self._tasks:
            task.cancel()
        # bounded: a transport's send that swallowed the cancel must not hang the session forever
        if not self._tasks:
            return
        done, stuck = await asyncio.wait(self._tasks, timeout=5.0)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: the tasks log their own failures
        for task in stuck:
            log.warning("session %s: task %s did not stop within 5 s", self.core.session_id, task.get_name())
        # a cancelled task keeps its CancelledError, whose traceback holds the task's frames and so this
        # runner: drop the tasks so that the session is freed by reference counting, not a full collection
        self._tasks = []

    # -- internals -----------------------------------------------------------------------

    def _flush(self) -> None:
        """Hand the core's new jobs to the executor and its outputs to the writer; wake the ticker."""
        for job in self.core.take_jobs():
            try:
                fut = self.executor.submit(job)
            except RuntimeError as exc:  # executor closed: the server is shutting down
                self.core.on_failure(job, exc)
                continue
            self._inflight[fut] = job
            fut.add_done_callback(self._from_worker)
        for item in self.core.take_outputs():
            self._enqueue(item)
        self._wake.set()

    def _enqueue(self, item: Output) -> None:
        if self._closed:
            return
        if self._observe is not None and not isinstance(item, bytes):
            try:
                self._observe(item)
            except Exception:  # metrics must never break a session
                log.exception("session %s: observer failed", self.core.session_id)
        try:
            self._out.put_nowait(item)
        except asyncio.QueueFull:
            self._stop(ClientTooSlow("client is not reading; output queue full"))
            log.warning("session %s: %s", self.core.session_id, self.failed)

    def _stop(self, reason: BaseException) -> None:
        self.failed = reason
        self._closed = True
        self.core.close()

    def _from_worker(self, fut: Future[tuple[Any, Any]]) -> None:
        # runs in a worker thread: hop onto the event loop before touching the core
        with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
            self._loop.call_soon_threadsafe(self._on_done, fut, context=self._context)

    def _on_done(self, fut: Future[tuple[Any, Any]]) -> None:
        job = self._inflight.pop(fut, None)
        if self._closed or job is None:
            return
        exc = fut.exception()
        if exc is not None:
            self.core.on_failure(job, exc)
            self.stage_failures += 1
            limit = self.limits.max_stage_failures if self.limits is not None else None
            if limit is not None and self.stage_failures >= limit:
                self._flush()
                self.end(
                    CLOSE_INTERNAL,
                    "stage failures",
                    SESSION_FAILED,
                    f"{self.stage_failures} stage jobs of this session failed; the session is closed",
                )
                return
        else:
            out, state = fut.result()
            self.core.on_result(job, out, state)
        self.core.tick()
        self._flush()

    async def _ticker(self) -> None:
        while not self._closed:
            wake = self.core.next_wakeup()
            timeout = None if wake is None else max(0.0, wake - self.core.clock())
            self._wake.clear()
            if timeout is None or timeout > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
            if self._closed:
                return
            self.core.tick()
            self._flush()

    async def _guard(self) -> None:
        """Ends the session after `max_session_s`, or `idle_timeout_s` without a client message."""
        limits = self.limits
        assert limits is not None
        while not self._closed and self.ending is None:
            now = self._loop.time()
            expires = self.opened_at + limits.max_session_s
            idle_at = self.last_activity + limits.idle_timeout_s
            if now >= expires:
                self.end(
                    CLOSE_NORMAL,
                    "session expired",
                    SESSION_EXPIRED,
                    f"sessions last at most {limits.max_session_s:g} s",
                )
                return
            if now >= idle_at:
                self.end(
                    CLOSE_NORMAL,
                    "idle",
                    IDLE_TIMEOUT,
                    f"no message from the client for {limits.idle_timeout_s:g} s",
                )
                return
            await asyncio.sleep(min(expires, idle_at) - now + 0.01)

    async def _writer(self) -> None:
        while True:
            item = await self._out.get()
            if item is None:
                return
            if isinstance(item, _Terminate):
                self._closed = True
                self.core.close()
                self.failed = self.ending
                if self._terminate is not None:
                    try:
                        await self._terminate(item.code, item.reason)
                    except Exception as exc:
                        log.info("session %s: close failed: %s", self.core.session_id, exc)
                return
            try:
                await self._send(item)
            except Exception as exc:  # the transport went away: stop quietly
                log.info("session %s: send failed: %s", self.core.session_id, exc)
                self.failed = _detached(exc)
                self._closed = True
                self.core.close()
                return
