"""What every transport's connection shares: a session bound to a started runner.

A transport adapter (native WebSocket, Twilio Media Streams, Asterisk AudioSocket, OpenAI
Realtime) only translates: wire audio -> 16 kHz float32 for `SessionRunner.feed_audio`, wire
control messages -> `SessionRunner.control` events, and the core's outputs (typed events and
24 kHz PCM16 frames) -> wire messages. No dialogue logic lives in an adapter. Wire-audio
conversion, which needs no I/O, is in `duplex.transports.wire_audio`; what each wire looks like is
in the transport's `*_protocol` module.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from duplex.runtime.runner import Output, SessionRunner
from duplex.runtime.service import DuplexService


@contextlib.asynccontextmanager
async def open_session(
    service: DuplexService, send: Callable[[Output], Awaitable[None]], *, max_queued_outputs: int = 1024
) -> AsyncIterator[SessionRunner]:
    """A new session on `service`, driven by a started runner; closed (and freed) on exit.

    Raises `duplex.runtime.service.CapacityError` when the service is full.
    """
    core = service.open_session()
    runner = SessionRunner(core, service.executor, send, max_queued_outputs=max_queued_outputs)
    try:
        await runner.start()
        yield runner
    finally:
        await runner.close()
        service.close_session(core.session_id)
