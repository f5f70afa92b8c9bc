"""The WebSocket server: HTTP for the browser client and health, the native protocol at /v1/duplex.

This module is the native protocol's connection: it drives `duplex.transports.native_protocol`
(what the messages look like and which are refused) over one WebSocket per session, feeding the
session core and sending its outputs back. It holds no dialogue logic. The protocol is documented
in docs/protocol.md.

Before any WebSocket upgrade, `_process_request` applies the server's admission rules, in this
order (docs/operations.md): 426 not an upgrade, 503 draining, 403 a browser Origin not allowed,
503 at capacity, 429 too many connections from this client address, 401 no valid API key or
client secret (on `/v1/duplex` and `/v1/realtime` when keys are set), then the transport's own
check (Twilio's signature). Plain HTTP: `/healthz`, `/readyz`, `/stats` and `/metrics` (the last
two need the key when keys are set), `POST /v1/realtime/client_secrets`, the browser client.
"""

from __future__ import annotations

import json
import logging
import mimetypes
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from importlib import resources

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from duplex.base.audio import SAMPLE_RATE as SR
from duplex.base.config import ConfigError
from duplex.base.limits import ClientCounts
from duplex.core.events import ErrorEvent, ServerEvent, SessionStarted
from duplex.runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from duplex.runtime.runner import ClientTooSlow, SessionRunner
from duplex.runtime.service import CapacityError, DuplexService
from duplex.transports.auth import Authenticator, AuthError, choose_subprotocol, origin_allowed
from duplex.transports.common import ClientGuard, open_session
from duplex.transports.native_protocol import (
    CLIENT_SECRETS_PATH,
    CLOSE_OVERLOAD,
    CLOSE_POLICY,
    HEALTH_PATH,
    MAX_FRAME_BYTES,
    METRICS_PATH,
    NATIVE_PATH,
    READY_PATH,
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
    #: browser Origins allowed besides the page's own (the request's Host); ("*",): any
    origins: tuple[str, ...] | None = None
    #: API keys: when set, `/v1/duplex` and `/v1/realtime` need one (Bearer) or a client secret
    api_keys: tuple[str, ...] = ()


def client_address(ws_or_conn: ServerConnection) -> str:
    """The peer's IP address (the per-client limits count by it)."""
    addr = ws_or_conn.remote_address
    return str(addr[0]) if addr else "?"


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
        self.auth = Authenticator(self.settings.api_keys)
        self.clients = ClientCounts(service.limits.max_connections_per_client)
        #: WebSocket routes that need an API key or client secret when keys are set
        self.keyed_routes: set[str] = {NATIVE_PATH}
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
            select_subprotocol=lambda _conn, offered: choose_subprotocol(offered),
        )
        return self._server

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self, immediate: bool = False) -> None:
        """Stop serving; `immediate`: drop connections without the closing handshake (a second Ctrl-C)."""
        if self._server is not None:
            if immediate:
                for conn in self._server.connections:
                    conn.transport.abort()
            self._server.close()
            await self._server.wait_closed()

    # -- HTTP ------------------------------------------------------------------------------

    def _refuse(self, status: HTTPStatus, code: str, message: str) -> Response:
        self.service.metrics.refused.labels(code).inc()
        body = json.dumps({"error": {"type": "invalid_request_error", "code": code, "message": message}})
        return http_response(status, body.encode() + b"\n", "application/json")

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = route_of(request.path)
        if path == CLIENT_SECRETS_PATH:
            return self._client_secret(request)
        if request.method != "GET":
            return http_response(HTTPStatus.METHOD_NOT_ALLOWED, b"method not allowed\n", "text/plain")
        if path == HEALTH_PATH:
            health = {**self.service.health(), "auth": self.auth.enabled}
            return http_response(HTTPStatus.OK, json.dumps(health).encode(), "application/json")
        if path == READY_PATH:
            ready = self.service.ready()
            reason = "draining" if self.service.draining else ("full" if not ready else None)
            return http_response(
                HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE,
                json.dumps({"ready": ready, "reason": reason}).encode(),
                "application/json",
            )
        if path in (STATS_PATH, METRICS_PATH):
            try:
                self.auth.check_key(request.headers.get("Authorization"))
            except AuthError as exc:
                return self._refuse(HTTPStatus.UNAUTHORIZED, exc.code, str(exc))
            if path == METRICS_PATH:
                return http_response(HTTPStatus.OK, self.service.metrics.render(), METRICS_CONTENT_TYPE)
            return http_response(HTTPStatus.OK, json.dumps(self.service.stats()).encode(), "application/json")
        if path in (NATIVE_PATH, *self.extra_routes):
            return self._admit(connection, request, path)
        found = _static(path)
        if found is None:
            return http_response(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
        return http_response(HTTPStatus.OK, found[0], found[1])

    def _admit(self, connection: ServerConnection, request: Request, path: str) -> Response | None:
        """The admission rules of a WebSocket route (see the module docstring), before the upgrade."""
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return http_response(HTTPStatus.UPGRADE_REQUIRED, b"WebSocket endpoint\n", "text/plain")
        if self.service.draining:
            return self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, "draining", "server is shutting down, retry")
        if not origin_allowed(
            request.headers.get("Origin"), request.headers.get("Host"), self.settings.origins
        ):
            return self._refuse(
                HTTPStatus.FORBIDDEN, "origin_not_allowed", "this Origin may not open sessions (see --origin)"
            )
        if self.service.full():
            return self._refuse(
                HTTPStatus.SERVICE_UNAVAILABLE, "at_capacity", "server is at capacity, retry later"
            )
        if self.clients.count(client_address(connection)) >= self.clients.limit:
            return self._refuse(
                HTTPStatus.TOO_MANY_REQUESTS,
                "too_many_connections",
                f"at most {self.clients.limit} connections per client address",
            )
        if path in self.keyed_routes:
            try:
                self.auth.check_session(
                    request.headers.get("Authorization"), request.headers.get("Sec-WebSocket-Protocol")
                )
            except AuthError as exc:
                log.info("refused %s from %s: %s", path, client_address(connection), exc.code)
                return self._refuse(HTTPStatus.UNAUTHORIZED, exc.code, str(exc))
        check = self.extra_checks.get(path)
        return check(request) if check is not None else None

    def _client_secret(self, request: Request) -> Response:
        """`POST /v1/realtime/client_secrets` (API key): a single-use secret for one browser session."""
        if request.method != "POST":
            return http_response(HTTPStatus.METHOD_NOT_ALLOWED, b"use POST\n", "text/plain")
        try:
            self.auth.check_key(request.headers.get("Authorization"))
        except AuthError as exc:
            return self._refuse(HTTPStatus.UNAUTHORIZED, exc.code, str(exc))
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(request.path).query)
        ttl = self.service.limits.client_secret_ttl_s
        try:
            ttl = float(query.get("expires_after", [ttl])[0])
        except ValueError:
            return self._refuse(HTTPStatus.BAD_REQUEST, "invalid_value", "expires_after must be seconds")
        secret = self.auth.secrets.issue(ttl)
        body = {
            "value": secret.value,
            "expires_at": int(secret.expires_at),
            "session": {"type": "realtime", "object": "realtime.session", "model": self.service.profile.name},
        }
        return http_response(HTTPStatus.OK, json.dumps(body).encode(), "application/json")

    # -- WebSocket -------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        path = route_of(ws.request.path) if ws.request else NATIVE_PATH
        client = client_address(ws)
        if not self.clients.acquire(client):  # raced past the check before the upgrade
            await ws.close(CLOSE_OVERLOAD, "too many connections from this address")
            return
        try:
            if path in self.extra_routes:
                await self.extra_routes[path](ws)
                return
            await self._handle_native(ws)
        finally:
            self.clients.release(client)

    async def _handle_native(self, ws: ServerConnection) -> None:
        async def send(item: ServerEvent | bytes) -> None:
            if isinstance(item, bytes):
                await ws.send(item)
            else:
                await ws.send(encode_event(item))

        async def terminate(code: int, reason: str) -> None:
            await ws.close(code, reason)

        try:
            async with open_session(self.service, send, transport="native", terminate=terminate) as runner:
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
        guard = ClientGuard(runner, self.service.limits, self.service.metrics)
        max_text = self.service.limits.max_text_chars

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
                        samples = decode_audio(audio_in, message)
                        runner.feed_audio(samples)
                        await guard.audio(len(samples) / SR)
                    else:
                        if not guard.control():
                            continue
                        parsed = parse_text(message, started=started, max_text_chars=max_text)
                        if isinstance(parsed, SessionStart):
                            begin(parsed)
                        else:
                            if not started:
                                begin(SessionStart())
                            runner.control(parsed.event)
                except ProtocolError as exc:
                    error(exc.code, str(exc))
                except Exception:  # a bug must end no session: report it and go on
                    log.exception("session %s: message not handled", sid)
                    error("internal_error", "the server could not handle this message")
                if isinstance(runner.failed, ClientTooSlow):
                    await ws.close(CLOSE_POLICY, "client too slow: output not read")
                    break
        except ConnectionClosed:
            pass
