"""Shared fixtures. `live` is the real service (packaged models), loaded once per test run."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import pytest

from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.transports.gateway import Gateway, GatewaySettings
from duplex.transports.native import DuplexServer, ServerSettings


@dataclass
class Live:
    """A running server on the real models, served from its own thread and event loop."""

    gateway: Gateway
    service: DuplexService
    loop: asyncio.AbstractEventLoop

    @property
    def server(self) -> DuplexServer:
        return self.gateway.server

    @property
    def audiosocket_port(self) -> int:
        return self.gateway.audiosocket.port

    @property
    def port(self) -> int:
        return self.server.port

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        """Run `coro` on the server's loop (e.g. to start another listener there) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="session")
def live():
    """The real `cpu` profile (Silero VAD, Moonshine, Qwen2.5-0.5B, hibari) behind every transport of
    `duplex serve` (native, Twilio, Realtime on one free port; AudioSocket on another)."""
    service = DuplexService.load("cpu", progress=False, limits=ServiceLimits(max_sessions=4))
    loop = asyncio.new_event_loop()
    server = Gateway(
        service, GatewaySettings(http=ServerSettings(host="127.0.0.1", port=0), audiosocket=("127.0.0.1", 0))
    )
    ready = threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True, name="live-server")
    thread.start()
    assert ready.wait(60)
    yield Live(server, service, loop)
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    service.close()
