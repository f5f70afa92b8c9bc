"""The WebSocket server: HTTP for the browser client and health, the native protocol at /v1/duplex.

This module is a transport adapter: it converts wire messages (PCM16 binary frames at the client's
rate, JSON control events) into session-core inputs and core outputs back into wire messages.
It holds no dialogue logic. The protocol is documented in docs/protocol.md.
"""

from __future__ import annotations

import json
import logging
import mimetypes
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from importlib import resources
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from duplex.base.config import ConfigError
from duplex.core.events import (
    CLIENT_EVENT_TYPES,
    CLIENT_SESSION_START,
    ErrorEvent,
    ServerEvent,
    SessionStarted,
)
from duplex.core.session import SR
from duplex.runtime.runner import SessionRunner
from duplex.runtime.service import CapacityError, DuplexService
from duplex.transports.common import AudioFormatError, AudioIn, open_session

log = logging.getLogger("duplex.transports.native")

NATIVE_PATH = "/v1/duplex"
SUPPORTED_RATES = (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000)
MAX_FRAME_BYTES = 64 * 1024  # 0.68 s at 48 kHz; larger frames are refused by the library (1009)
MAX_JSON_BYTES = 16 * 1024
START_TIMEOUT_S = 30.0

# WebSocket close codes used by the native protocol
CLOSE_POLICY = 1008  # e.g. the client stopped reading its audio
CLOSE_OVERLOAD = 1013  # try again later


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8765
    origins: tuple[str, ...] | None = None  # None: any origin (set it when exposed to the web)


class ProtocolError(ValueError):
    """A client message broke the protocol; `code` goes into the error event."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _static(name: str) -> tuple[bytes, str] | None:
    base = resources.files("clients") / "web"
    path = base / name
    if "/" in name or name.startswith(".") or not path.is_file():
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
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            return http_response(HTTPStatus.OK, json.dumps(self.service.health()).encode(), "application/json")
        if path == "/stats":
            return http_response(HTTPStatus.OK, json.dumps(self.service.stats()).encode(), "application/json")
        if path in (NATIVE_PATH, *self.extra_routes):
            if request.headers.get("Upgrade", "").lower() != "websocket":
                return http_response(HTTPStatus.UPGRADE_REQUIRED, b"WebSocket endpoint\n", "text/plain")
            if self.service.full():
                return http_response(HTTPStatus.SERVICE_UNAVAILABLE, b"server is at capacity, retry later\n", "text/plain")
            check = self.extra_checks.get(path)
            return check(request) if check is not None else None
        name = "index.html" if path == "/" else path.lstrip("/")
        found = _static(name)
        if found is None:
            return http_response(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
        return http_response(HTTPStatus.OK, found[0], found[1])

    # -- WebSocket -------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        path = ws.request.path.split("?", 1)[0] if ws.request else NATIVE_PATH
        if path in self.extra_routes:
            await self.extra_routes[path](ws)
            return
        await self._handle_native(ws)

    async def _handle_native(self, ws: ServerConnection) -> None:
        async def send(item: ServerEvent | bytes) -> None:
            if isinstance(item, bytes):
                await ws.send(item)
            else:
                await ws.send(json.dumps(item.to_wire()))

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
            runner.emit(ErrorEvent(session_id=sid, turn_id=core.turn_id, t=core.clock(), code=code, message=message))

        def begin(rate: int, options: dict[str, Any]) -> None:
            nonlocal audio_in, started
            if rate not in SUPPORTED_RATES:
                raise ProtocolError("unsupported_sample_rate", f"sample_rate {rate!r} not supported; use one of {list(SUPPORTED_RATES)}")
            if options:
                try:
                    core.configure(options)
                except ConfigError as exc:
                    raise ProtocolError("bad_option", str(exc)) from None
            audio_in = AudioIn(rate)  # PCM16 at the client's rate -> 16 kHz, nothing held back
            started = True
            runner.emit(
                SessionStarted(
                    session_id=sid,
                    turn_id=0,
                    t=core.clock(),
                    input_sample_rate=rate,
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
                            begin(SR, {})  # audio first: the defaults (16 kHz)
                        assert audio_in is not None
                        try:
                            samples = audio_in.decode(message)
                        except AudioFormatError as exc:
                            raise ProtocolError("bad_audio", f"audio frame: {exc}") from None
                        runner.feed_audio(samples)
                    else:
                        event = self._parse(message)
                        if event["type"] == CLIENT_SESSION_START:
                            if started:
                                raise ProtocolError("already_started", "session.start may only be sent once, first")
                            rate = event.get("sample_rate", SR)
                            if not isinstance(rate, int) or isinstance(rate, bool):
                                raise ProtocolError("unsupported_sample_rate", "sample_rate must be an integer")
                            options = event.get("options") or {}
                            if not isinstance(options, dict):
                                raise ProtocolError("bad_option", "options must be an object")
                            begin(rate, options)
                        else:
                            if not started:
                                begin(SR, {})
                            runner.control(event)
                except ProtocolError as exc:
                    error(exc.code, str(exc))
                if runner.failed is not None:
                    await ws.close(CLOSE_POLICY, "client too slow: output not read")
                    break
        except ConnectionClosed:
            pass

    @staticmethod
    def _parse(message: str) -> dict[str, Any]:
        if len(message) > MAX_JSON_BYTES:
            raise ProtocolError("too_large", f"JSON message of {len(message)} bytes exceeds {MAX_JSON_BYTES}")
        try:
            event = json.loads(message)
        except json.JSONDecodeError as exc:
            raise ProtocolError("bad_json", f"malformed JSON: {exc.msg} at position {exc.pos}") from None
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise ProtocolError("bad_event", 'a JSON message must be an object with a string "type"')
        if event["type"] not in CLIENT_EVENT_TYPES:
            raise ProtocolError("unknown_event", f"unknown event type {event['type']!r}; known: {list(CLIENT_EVENT_TYPES)}")
        return event

