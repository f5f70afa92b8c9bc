"""Async glue between one `SessionCore`, the device executor and a transport.

The runner only moves things: jobs to the executor, results back into the core (on the event
loop thread), outputs into a bounded queue that the transport drains, and ticks at the times the
core asks for. It does no model work and holds no dialogue logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from duplex.core.events import ServerEvent
from duplex.core.jobs import Job
from duplex.core.session import SessionCore
from duplex.runtime.executor import DeviceExecutor

log = logging.getLogger("duplex.runtime.runner")

Output = ServerEvent | bytes


class ClientTooSlow(RuntimeError):
    """The transport did not drain its output queue in time."""


class SessionRunner:
    """Drives one session core; `send` is awaited for every event and audio frame, in order."""

    def __init__(
        self,
        core: SessionCore,
        executor: DeviceExecutor,
        send: Callable[[Output], Awaitable[None]],
        *,
        max_queued_outputs: int = 1024,
    ) -> None:
        self.core = core
        self.executor = executor
        self._send = send
        self._out: asyncio.Queue[Output | None] = asyncio.Queue(maxsize=max_queued_outputs)
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self.failed: BaseException | None = None

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._writer(), name=f"writer-{self.core.session_id}"),
            asyncio.create_task(self._ticker(), name=f"ticker-{self.core.session_id}"),
        ]
        self._flush()

    def feed_audio(self, samples: np.ndarray) -> None:
        if self._closed:
            return
        self.core.receive_audio(samples)
        self._flush()

    def control(self, event: dict[str, Any]) -> None:
        if self._closed:
            return
        self.core.receive_control(event)
        self._flush()

    def emit(self, event: ServerEvent) -> None:
        """Send an event that did not come from the core (e.g. a transport-level error)."""
        self._enqueue(event)

    async def close(self) -> None:
        """Stop ticking and sending; results still in flight are discarded by the core."""
        if self._closed:
            return
        self._closed = True
        self.core.close()
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

    # -- internals -----------------------------------------------------------------------

    def _flush(self) -> None:
        """Hand the core's new jobs to the executor and its outputs to the writer; wake the ticker."""
        for job in self.core.take_jobs():
            try:
                fut = self.executor.submit(job)
            except RuntimeError as exc:  # executor closed: the server is shutting down
                self.core.on_failure(job, exc)
                continue
            fut.add_done_callback(lambda f, job=job: self._from_worker(job, f))
        for item in self.core.take_outputs():
            self._enqueue(item)
        self._wake.set()

    def _enqueue(self, item: Output) -> None:
        if self._closed:
            return
        try:
            self._out.put_nowait(item)
        except asyncio.QueueFull:
            self.failed = ClientTooSlow("client is not reading; output queue full")
            log.warning("session %s: %s", self.core.session_id, self.failed)
            self._closed = True
            self.core.close()

    def _from_worker(self, job: Job, fut: Future[tuple[Any, Any]]) -> None:
        # runs in a worker thread: hop onto the event loop before touching the core
        with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
            self._loop.call_soon_threadsafe(self._on_done, job, fut)

    def _on_done(self, job: Job, fut: Future[tuple[Any, Any]]) -> None:
        if self._closed:
            return
        exc = fut.exception()
        if exc is not None:
            self.core.on_failure(job, exc)
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

    async def _writer(self) -> None:
        while True:
            item = await self._out.get()
            if item is None:
                return
            try:
                await self._send(item)
            except Exception as exc:  # the transport went away: stop quietly
                log.info("session %s: send failed: %s", self.core.session_id, exc)
                self.failed = exc
                self._closed = True
                self.core.close()
                return
