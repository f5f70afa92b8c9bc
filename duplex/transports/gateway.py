"""Everything `duplex serve` listens on, assembled around one service.

One port carries HTTP (browser client, /healthz, /stats) and the WebSocket transports: the native
protocol (`/v1/duplex`), Twilio Media Streams (`/v1/twilio`) and the OpenAI-Realtime-compatible API
(`/v1/realtime`). Asterisk AudioSocket is plain TCP, so it gets its own listener when asked for.
All transports share the service, its session limit and its device executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from duplex.runtime.service import DuplexService
from duplex.transports.native import DuplexServer, ServerSettings
from duplex.transports.native_protocol import NATIVE_PATH

log = logging.getLogger("duplex.transports.gateway")


@dataclass
class GatewaySettings:
    http: ServerSettings = field(default_factory=ServerSettings)
    twilio_auth_token: str | None = None  # X-Twilio-Signature is required when set
    public_url: str | None = None  # the wss:// base URL Twilio signs (behind a proxy)
    audiosocket: tuple[str, int] | None = None  # (host, port) of the AudioSocket TCP listener
    audiosocket_uuids: Sequence[uuid.UUID] | None = None  # accept only these calls (None: any)


def parse_host_port(value: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """'HOST:PORT' or ':PORT' or 'PORT' -> (host, port); ValueError with a clear message otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "", value
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"expected HOST:PORT, got {value!r}") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"port {number} out of range in {value!r}")
    return (host.strip("[]") or default_host), number


class Gateway:
    """Starts and stops the HTTP/WebSocket server and, optionally, the AudioSocket listener."""

    def __init__(self, service: DuplexService, settings: GatewaySettings | None = None) -> None:
        self.service = service
        self.settings = settings or GatewaySettings()
        self.server = DuplexServer(service, self.settings.http)
        self.audiosocket: Any = None

    async def start(self) -> None:
        from duplex.transports.realtime import mount_realtime
        from duplex.transports.twilio import TwilioSettings, mount_twilio

        s = self.settings
        mount_twilio(self.server, TwilioSettings(auth_token=s.twilio_auth_token, public_url=s.public_url))
        mount_realtime(self.server)
        await self.server.start()
        if s.audiosocket is not None:
            from duplex.transports.audiosocket import AudioSocketServer

            host, port = s.audiosocket
            self.audiosocket = AudioSocketServer(self.service, host, port, allowed_uuids=s.audiosocket_uuids)
            try:
                await self.audiosocket.start()
            except BaseException:
                await self.server.close()
                raise

    @property
    def port(self) -> int:
        return self.server.port

    def urls(self) -> list[str]:
        host = self.settings.http.host
        base = f"{host}:{self.server.port}"
        lines = [
            f"http://{base}/  (browser client)",
            f"ws://{base}{NATIVE_PATH}  (native protocol)",
            f"ws://{base}/v1/twilio  (Twilio Media Streams"
            + (
                ", signatures checked)"
                if self.settings.twilio_auth_token
                else ", signatures NOT checked: set --twilio-auth-token)"
            ),
            f"ws://{base}/v1/realtime  (OpenAI Realtime compatible)",
        ]
        if self.audiosocket is not None:
            allowed = self.settings.audiosocket_uuids
            lines.append(
                f"tcp://{self.settings.audiosocket[0]}:{self.audiosocket.port}  (Asterisk AudioSocket, "  # type: ignore[index]
                + (f"{len(allowed)} allowed call UUIDs)" if allowed is not None else "any call UUID)")
            )
        return lines

    async def close(self) -> None:
        if self.audiosocket is not None:
            with contextlib.suppress(Exception):
                await self.audiosocket.close()
        with contextlib.suppress(Exception):
            await self.server.close()


async def run_gateway(
    service: DuplexService, settings: GatewaySettings, ready: asyncio.Event | None = None
) -> None:
    """Serve until cancelled (Ctrl-C / SIGTERM)."""
    gateway = Gateway(service, settings)
    await gateway.start()
    print("duplex: listening on", flush=True)
    for line in gateway.urls():
        print(f"  {line}", flush=True)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Future()
    finally:
        await gateway.close()
