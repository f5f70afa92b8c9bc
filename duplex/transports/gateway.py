"""Everything `duplex serve` listens on, assembled around one service.

One port carries HTTP (browser client, /healthz, /stats) and the WebSocket transports: the native
protocol (`/v1/duplex`), Twilio Media Streams (`/v1/twilio`) and the OpenAI-Realtime-compatible API
(`/v1/realtime`). Asterisk AudioSocket is plain TCP, so it gets its own listener when asked for.
All transports share the service, its session limit and its device executor.

`run_gateway` also handles the process's signals: the first SIGTERM or SIGINT drains (new
connections get 503 and `/readyz` turns false, answers in progress finish up to the drain
deadline, then every session is closed with 1001), a second one exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from duplex.runtime.service import DuplexService
from duplex.transports.auth import is_loopback
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


def exposure_problem(settings: GatewaySettings, insecure: bool = False) -> str | None:
    """Why serving with these settings would let anyone on the network in (None: it would not).

    Without an API key only loopback binds are allowed; an AudioSocket listener on another address,
    or on any address once API keys are set, needs a call-UUID allow-list. `insecure` waives these
    (a trusted network, a proxy that authenticates).
    """
    if insecure:
        return None
    host = settings.http.host
    if not settings.http.api_keys and not is_loopback(host):
        return (
            f"--host {host} is reachable from other machines and no API key is set: anyone who reaches the "
            "port could open sessions and spend this machine's compute. Set --api-key (or $DUPLEX_API_KEY), "
            "or pass --insecure if something in front of the server authenticates clients "
            "(docs/operations.md)."
        )
    if settings.audiosocket is not None and not settings.audiosocket_uuids:
        where = f"--audiosocket {settings.audiosocket[0]}:{settings.audiosocket[1]}"
        if not is_loopback(settings.audiosocket[0]):
            return (
                f"{where} is reachable from other machines and AudioSocket has no keys: pass "
                "--audiosocket-uuid for the calls to accept, or --insecure on a private network "
                "(docs/audiosocket.md)."
            )
        if settings.http.api_keys:
            return (
                f"API keys are set, but {where} would accept any call: pass --audiosocket-uuid for the "
                "calls to accept (AudioSocket cannot send a key), or --insecure (docs/audiosocket.md)."
            )
    return None


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
        keyed = bool(self.settings.http.api_keys)
        auth = f", API key required ({len(self.settings.http.api_keys)} keys)" if keyed else ", no API key"
        if self.settings.twilio_auth_token:
            twilio = ", signatures checked)"
        elif keyed:
            twilio = ": refused, API keys are set but no --twilio-auth-token)"
        else:
            twilio = ", signatures NOT checked: set --twilio-auth-token)"
        lines = [
            f"http://{base}/  (browser client)",
            f"ws://{base}{NATIVE_PATH}  (native protocol{auth})",
            f"ws://{base}/v1/twilio  (Twilio Media Streams{twilio}",
            f"ws://{base}/v1/realtime  (OpenAI Realtime compatible{auth})",
            f"http://{base}/metrics, /readyz, /healthz  (Prometheus, load balancer, health)",
        ]
        if self.audiosocket is not None:
            allowed = self.settings.audiosocket_uuids
            lines.append(
                f"tcp://{self.settings.audiosocket[0]}:{self.audiosocket.port}  (Asterisk AudioSocket, "  # type: ignore[index]
                + (f"{len(allowed)} allowed call UUIDs)" if allowed is not None else "any call UUID)")
            )
        return lines

    async def drain(self, deadline_s: float) -> None:
        """Stop accepting, let answers in progress finish (up to `deadline_s`), end sessions with 1001."""
        log.warning("draining: no new sessions; answers in progress may finish within %g s", deadline_s)
        await self.service.drain(deadline_s)

    async def close(self, immediate: bool = False) -> None:
        if self.audiosocket is not None:
            with contextlib.suppress(Exception):
                await self.audiosocket.close()
        with contextlib.suppress(Exception):
            await self.server.close(immediate=immediate)


async def run_gateway(
    service: DuplexService,
    settings: GatewaySettings,
    ready: asyncio.Event | None = None,
    *,
    handle_signals: bool = True,
) -> None:
    """Serve until cancelled, or until a SIGTERM / SIGINT drain ends (a second signal: at once)."""
    gateway = Gateway(service, settings)
    await gateway.start()
    print("duplex: listening on", flush=True)
    for line in gateway.urls():
        print(f"  {line}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    drain_task: asyncio.Task[None] | None = None
    signals_seen = 0
    immediate = False

    async def drain_then_stop() -> None:
        try:
            await gateway.drain(service.limits.drain_timeout_s)
        finally:
            stop.set()

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals_seen, drain_task, immediate
        signals_seen += 1
        if signals_seen == 1:
            print(f"duplex: {sig.name}: draining (send it again to exit at once)", flush=True)
            drain_task = loop.create_task(drain_then_stop())
        else:
            print(f"duplex: {sig.name} again: exiting now", flush=True)
            immediate = True
            stop.set()

    installed: list[signal.Signals] = []
    if handle_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
                loop.add_signal_handler(sig, on_signal, sig)
                installed.append(sig)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if drain_task is not None and not drain_task.done():
            drain_task.cancel()
        await gateway.close(immediate=immediate)
