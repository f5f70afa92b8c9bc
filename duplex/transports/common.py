"""What every transport's connection shares: a session bound to a started runner.

A transport adapter (native WebSocket, Twilio Media Streams, Asterisk AudioSocket, OpenAI
Realtime) only translates: wire audio -> 16 kHz float32 for `SessionRunner.feed_audio`, wire
control messages -> `SessionRunner.control` events, and the core's outputs (typed events and
24 kHz PCM16 frames) -> wire messages. No dialogue logic lives in an adapter. Wire-audio
conversion, which needs no I/O, is in `duplex.transports.wire_audio`; what each wire looks like is
in the transport's `*_protocol` module.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from duplex.base.limits import (
    AUDIO_TOO_FAST,
    CLOSE_POLICY,
    RATE_LIMITED,
    AudioPacer,
    ControlLimiter,
    ServerLimits,
)
from duplex.core.events import ErrorEvent
from duplex.runtime.logs import bind_session
from duplex.runtime.metrics import Metrics
from duplex.runtime.runner import Output, SessionRunner
from duplex.runtime.service import DuplexService


@contextlib.asynccontextmanager
async def open_session(
    service: DuplexService,
    send: Callable[[Output], Awaitable[None]],
    *,
    max_queued_outputs: int = 1024,
    transport: str = "native",
    terminate: Callable[[int, str], Awaitable[None]] | None = None,
) -> AsyncIterator[SessionRunner]:
    """A new session on `service`, driven by a started runner; closed (and freed) on exit.

    `terminate(code, reason)` closes the connection when the server ends the session by its rules
    (duration, idle, stage failures, drain; see `SessionRunner.end`). Raises
    `duplex.runtime.service.CapacityError` when the service is full or draining.
    """
    core = service.open_session()
    bind_session(core)
    runner = SessionRunner(
        core,
        service.executor,
        send,
        max_queued_outputs=max_queued_outputs,
        limits=service.limits,
        terminate=terminate,
        observe=service.metrics.observe_event,
    )
    try:
        service.attach(runner, transport)
        await runner.start()
        yield runner
    finally:
        await runner.close()
        service.close_session(core.session_id)


class ClientGuard:
    """The per-connection rate rules a transport's reader applies (`duplex.base.limits`).

    - `control()`: before handling a control (non-audio) message; False: drop it (an `error`
      `rate_limited` was sent, once per burst), and a sustained flood ends the session (1008).
    - `audio(seconds)`: after feeding audio; waits while the client is more than the burst ahead
      of real time (the socket's back-pressure slows it down), and ends the session (1008,
      `audio_too_fast`) if one message put it far ahead.
    - `text_ok(text)`: a typed turn's length.
    """

    def __init__(self, runner: SessionRunner, limits: ServerLimits, metrics: Metrics | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.runner = runner
        self.limits = limits
        self.metrics = metrics
        self._control = ControlLimiter(limits.control_per_s, limits.control_burst, loop.time)
        self._pacer = AudioPacer(
            speed=limits.audio_speed,
            burst_s=limits.audio_burst_s,
            close_s=limits.audio_close_s,
            clock=loop.time,
        )
        self._warned = False

    def _hit(self, limit: str) -> None:
        if self.metrics is not None:
            self.metrics.limit_hits.labels(limit).inc()

    def _error(self, code: str, message: str) -> None:
        core = self.runner.core
        self.runner.emit(
            ErrorEvent(
                session_id=core.session_id, turn_id=core.turn_id, t=core.clock(), code=code, message=message
            )
        )

    def control(self) -> bool:
        self.runner.touch()
        verdict = self._control.check()
        if verdict == ControlLimiter.ACCEPT:
            self._warned = False
            return True
        self._hit("control_rate")
        if verdict == ControlLimiter.CLOSE:
            self.runner.end(
                CLOSE_POLICY,
                "message flood",
                RATE_LIMITED,
                f"more than {self.limits.control_per_s:g} control messages per second, sustained",
            )
        elif not self._warned:
            self._warned = True
            self._error(
                RATE_LIMITED,
                f"over {self.limits.control_per_s:g} control messages per second: messages are dropped",
            )
        return False

    def text_ok(self, text: str) -> bool:
        if len(text) <= self.limits.max_text_chars:
            return True
        self._hit("text_length")
        return False

    async def audio(self, seconds: float) -> None:
        self.runner.touch()
        wait = self._pacer.add(seconds)
        if self._pacer.too_fast():
            self._hit("audio_rate")
            self.runner.end(
                CLOSE_POLICY,
                "audio too fast",
                AUDIO_TOO_FAST,
                f"audio arrived {self._pacer.ahead():.0f} s ahead of real time "
                f"(limit {self.limits.audio_close_s:g} s)",
            )
            return
        if wait > 0:
            self._hit("audio_rate")
            await asyncio.sleep(wait)
