"""The WebSocket server: HTTP for the browser client and health, the native protocol at /v1/duplex.

This module is the native protocol's connection: it drives `duplex.transports.native_protocol`
(what the messages look like and which are refused) over one WebSocket per session, feeding the
session core and sending its outputs back. It holds no dialogue logic. The protocol is documented
in docs/protocol.md.
"""

from __future__ import annotations

import json
import logging
import mimetypes
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from importlib import resources

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from duplex.base.config import ConfigError
from duplex.core.events import ErrorEvent, ServerEvent, SessionStarted
from duplex.runtime.runner import SessionRunner
from duplex.runtime.service import CapacityError, DuplexService
from duplex.transports.common import open_session
from duplex.transports.native_protocol import (
    CLOSE_OVERLOAD,
    CLOSE_POLICY,
    HEALTH_PATH,
    MAX_FRAME_BYTES,
    NATIVE_PATH,
    STATS_PATH,
    ProtocolError,
    SessionStart,
    decode_audio,
    encode_event,
    parse_text,
    route_of,
    static_name,
)
from duplex.transports.wire_audio import AudioIn

log = logging.getLogger("duplex.transports.native")


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8765
    origins: tuple[str, ...] | None = None  # None: any origin (set it when exposed to the web)


def _static(route: str) -> tuple[bytes, str] | None:
    name = static_name(route)
    if name is None:
        return None
    path = resources.files("clients") / "web" / name
    if not path.is_file():
        return None
    ctype = mimetypes.guess_type(name)[0] or "application/octet-stream"
    return path.read_bytes(), ctype


def http_response(status: HTTPStatus, body: bytes, ctype: str) -> Response:
    headers = Headers(
        [("Content-Type", ctype), ("Content-Length", str(len(body))), ("Cache-Control", "no-store")]
    )
    return Response(status.value, status.phrase, headers, body)


class DuplexServer:
    """Serves the native protocol for a `DuplexService`."""

    def __init__(self, service: DuplexService, settings: ServerSettings | None = None) -> None:
        self.service = service
        self.settings = settings or ServerSettings()
        self._server: Server | None = None
        # other transports mount themselves here: path -> async handler(connection), and optionally
        # path -> check(request) run before the upgrade (return a Response to refuse, e.g. 403)
        self.extra_routes: dict[str, Callable[[ServerConnection], Awaitable[None]]] = {}
        self.extra_checks: dict[str, Callable[[Request], Response | None]] = {}

    async def start(self) -> Server:
        self._server = await serve(
            self._handle,
            self.settings.host,
            self.settings.port,
            process_request=self._process_request,
            compression=None,  # deflate costs memory per connection and invites amplification
            max_size=MAX_FRAME_BYTES,
            max_queue=64,
            ping_interval=20,
            ping_timeout=20,
            origins=list(self.settings.origins) if self.settings.origins else None,
        )
        return self._server

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # -- HTTP ------------------------------------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = route_of(request.path)
        if path == HEALTH_PATH:
            return http_response(
                HTTPStatus.OK, json.dumps(self.service.health()).encode(), "application/json"
            )
        if path == STATS_PATH:
            return http_response(HTTPStatus.OK, json.dumps(self.service.stats()).encode(), "application/json")
        if path in (NATIVE_PATH, *self.extra_routes):
            if request.headers.get("Upgrade", "").lower() != "websocket":
                return http_response(HTTPStatus.UPGRADE_REQUIRED, b"WebSocket endpoint\n", "text/plain")
            if self.service.full():
                return http_response(
                    HTTPStatus.SERVICE_UNAVAILABLE, b"server is at capacity, retry later\n", "text/plain"
                )
            check = self.extra_checks.get(path)
            return check(request) if check is not None else None
        found = _static(path)
        if found is None:
            return http_response(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
        return http_response(HTTPStatus.OK, found[0], found[1])

    # -- WebSocket -------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        path = route_of(ws.request.path) if ws.request else NATIVE_PATH
        if path in self.extra_routes:
            await self.extra_routes[path](ws)
            return
        await self._handle_native(ws)

    async def _handle_native(self, ws: ServerConnection) -> None:
        async def send(item: ServerEvent | bytes) -> None:
            if isinstance(item, bytes):
                await ws.send(item)
            else:
                await ws.send(encode_event(item))

        try:
            async with open_session(self.service, send) as runner:
                log.info("session %s opened from %s", runner.core.session_id, ws.remote_address)
                try:
                    await self._serve_native(ws, runner)
                finally:
                    log.info("session %s closed", runner.core.session_id)
        except CapacityError as exc:
            await ws.close(CLOSE_OVERLOAD, str(exc))

    async def _serve_native(self, ws: ServerConnection, runner: SessionRunner) -> None:
        """The native protocol over one connection, until it closes (the session is open and started)."""
        core = runner.core
        sid = core.session_id
        audio_in: AudioIn | None = None
        started = False

        def error(code: str, message: str) -> None:
            runner.emit(
                ErrorEvent(session_id=sid, turn_id=core.turn_id, t=core.clock(), code=code, message=message)
            )

        def begin(start: SessionStart) -> None:
            nonlocal audio_in, started
            if start.options:
                try:
                    core.configure(start.options)
                except ConfigError as exc:
                    raise ProtocolError("bad_option", str(exc)) from None
            audio_in = AudioIn(start.sample_rate)  # PCM16 at the client's rate -> 16 kHz, nothing held back
            started = True
            runner.emit(
                SessionStarted(
                    session_id=sid,
                    turn_id=0,
                    t=core.clock(),
                    input_sample_rate=start.sample_rate,
                    output_sample_rate=core.out_sr,
                    profile=self.service.profile.name,
                    options={k: getattr(core.options, k) for k in core.options.CLIENT_SETTABLE},
                )
            )

        try:
            async for message in ws:
                try:
                    if isinstance(message, bytes):
                        if not started:
                            begin(SessionStart())  # audio first: the defaults (16 kHz)
                        assert audio_in is not None
                        runner.feed_audio(decode_audio(audio_in, message))
                    else:
                        parsed = parse_text(message, started=started)
                        if isinstance(parsed, SessionStart):
                            begin(parsed)
                        else:
                            if not started:
                                begin(SessionStart())
                            runner.control(parsed.event)
                except ProtocolError as exc:
                    error(exc.code, str(exc))
                if runner.failed is not None:
                    await ws.close(CLOSE_POLICY, "client too slow: output not read")
                    break
        except ConnectionClosed:
            pass
