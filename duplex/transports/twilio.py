"""Twilio Media Streams gateway: one phone call = one WebSocket = one duplex session.

A number whose TwiML says `<Connect><Stream url="wss://HOST/v1/twilio"/>` makes Twilio open a
*bidirectional* Media Stream to us. Both directions are JSON text frames:

    Twilio -> us   connected, start (streamSid, callSid, mediaFormat, customParameters),
                   media (base64 mu-law 8 kHz, 20 ms per message), dtmf, mark (echo), stop
    us -> Twilio   media (base64 mu-law 8 kHz), mark (name), clear (drop queued audio)

This module is the connection, a transport adapter like `duplex.transports.native`: it drives
`duplex.transports.twilio_protocol` (the messages, the signature, 20 ms mu-law framing) and the
session, and holds no dialogue logic.

- Audio in: mu-law -> `AudioIn(8000, "ulaw")` -> `SessionRunner.feed_audio`.
- Audio out: the core's 24 kHz PCM16 frames -> `AudioOut(24000, 8000, "ulaw")` -> exact 160-byte
  (20 ms) media messages; a partial frame is carried to the next batch and padded with silence when
  the answer ends.
- What the caller has heard: Twilio plays our audio from its own buffer, so the core's playout clock
  cannot know when the phone actually played it. After every audio batch we send a mark named
  `t<turn>:<ms>:<seq>` (`ms` = audio of the current answer sent so far); Twilio echoes a mark when
  the audio before it has played, and we pass that on as the core's `playout.position`, which bounds
  what counts as heard at a barge-in. After a `clear` Twilio echoes the marks of dropped audio at
  once: those are ignored.
- Barge-in: on the core's `response.interrupted` we send `clear` at once and forget the old
  answer's partial frame and resampler history.
- DTMF: becomes an `input.dtmf` event (`DtmfReceived`, source "twilio") in the session's event
  stream; applications see it, and every other server event, through `TwilioSettings.on_event`.

Twilio cannot receive error messages, so anything malformed it (or an impostor) sends is logged with
the session id and skipped; after `MAX_BAD_FRAMES` bad messages in a row the call is closed (1008).
With an auth token configured, the upgrade request must carry a valid `X-Twilio-Signature`
(HMAC-SHA1 of the wss:// URL), else it is refused with 403 before a session exists.
See docs/twilio.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from duplex.base.config import ConfigError
from duplex.core.events import (
    CLIENT_PLAYOUT,
    DtmfReceived,
    ErrorEvent,
    Interrupted,
    ResponseAudioStarted,
    ResponseDone,
    ServerEvent,
    SessionStarted,
)
from duplex.runtime.runner import ClientTooSlow, Output, SessionRunner
from duplex.runtime.service import CapacityError, DuplexService
from duplex.transports.common import ClientGuard, open_session
from duplex.transports.native import DuplexServer, http_response
from duplex.transports.native_protocol import CLOSE_OVERLOAD, CLOSE_POLICY
from duplex.transports.twilio_protocol import (
    TWILIO_PATH,
    WIRE_RATE,
    BadFrame,
    Connected,
    Dtmf,
    Mark,
    MarkBook,
    Media,
    OutgoingAudio,
    Start,
    Stop,
    TwilioMessage,
    clear_message,
    encode_message,
    mark_message,
    media_message,
    parameter_value,
    parse_message,
    short_repr,
    signature_problem,
)
from duplex.transports.wire_audio import AudioIn

log = logging.getLogger("duplex.transports.twilio")

# Limits. Module constants rather than arguments: tests shorten them with monkeypatch.
MAX_BAD_FRAMES = 100  # consecutive unusable messages before the call is closed (1008)
MAX_WARNINGS = 20  # logged per call, so a peer sending garbage cannot flood the log
START_TIMEOUT_S = 30.0  # Twilio sends `start` right after `connected`


@dataclass
class TwilioSettings:
    """How `/v1/twilio` checks and reports calls.

    `auth_token`: when set, the X-Twilio-Signature header is required and validated.
    `public_url`: the wss:// base URL Twilio connects to (what it signs), e.g.
    "wss://voice.example.com" behind a TLS proxy; default: wss://<Host header>.
    `on_event`: called with every server event of every call (DTMF, transcripts, answers ...);
    events carry the session id. `on_start`: called with the `TwilioCall` once its `start` message
    arrived (call SID, custom parameters, session id), e.g. to map calls to sessions.
    """

    auth_token: str | None = None
    public_url: str | None = None
    on_event: Callable[[ServerEvent], None] | None = None
    on_start: Callable[[TwilioCall], None] | None = None


class EndCall(Exception):
    """Ends the call; `code` is the WebSocket close code (None: the peer already ended it)."""

    def __init__(self, reason: str, code: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


# -- signatures ------------------------------------------------------------------------------


def check_signature(settings: TwilioSettings, request: Request) -> Response | None:
    """Before the upgrade: None to accept, or a 403 response when the signature is missing or wrong."""
    token = settings.auth_token
    if not token:
        return None
    reason = signature_problem(
        token,
        request.headers.get("X-Twilio-Signature"),
        public_url=settings.public_url,
        host=request.headers.get("Host"),
        path=request.path,
    )
    if reason is None:
        return None
    log.warning("Twilio stream refused (403): %s", reason)
    return http_response(HTTPStatus.FORBIDDEN, b"invalid or missing X-Twilio-Signature\n", "text/plain")


# -- one call ---------------------------------------------------------------------------------


@dataclass
class CallStats:
    media_in: int = 0  # media messages fed to the session
    media_out: int = 0  # 20 ms media messages sent
    marks_sent: int = 0
    marks_played: int = 0  # echoes passed on as playout.position
    marks_dropped: int = 0  # echoes of marks whose audio a clear dropped (not counted as played)
    clears: int = 0
    dtmf: int = 0
    bad_frames: int = 0


@dataclass
class TwilioCall:
    """One Media Stream: reads Twilio's messages, writes the session's audio and marks back."""

    ws: ServerConnection = field(repr=False)
    settings: TwilioSettings = field(repr=False)
    session_id: str = ""
    stream_sid: str | None = None
    call_sid: str = ""
    account_sid: str = ""
    custom_parameters: dict[str, str] = field(default_factory=dict)
    stats: CallStats = field(default_factory=CallStats)
    bad_in_a_row: int = 0
    warnings: int = 0
    reason: str = "ended"
    runner: SessionRunner | None = field(default=None, repr=False)
    guard: ClientGuard | None = field(default=None, repr=False)
    _audio_in: AudioIn = field(default_factory=lambda: AudioIn(WIRE_RATE, "ulaw"), repr=False)
    _out: OutgoingAudio | None = field(default=None, repr=False)
    _marks: MarkBook = field(default_factory=MarkBook, repr=False)
    _started_at: float = field(default_factory=time.monotonic, repr=False)

    @property
    def started(self) -> bool:
        return self.stream_sid is not None

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self, service: DuplexService) -> None:
        """Serve the call until `stop`, a hang-up or a fatal error; the session is freed on return."""
        try:

            async def terminate(code: int, reason: str) -> None:
                await self.ws.close(code, reason)

            async with open_session(
                service, self.send_output, transport="twilio", terminate=terminate
            ) as runner:
                self.runner = runner
                self.guard = ClientGuard(runner, service.limits, service.metrics)
                self.session_id = runner.core.session_id
                self._out = OutgoingAudio(runner.core.out_sr)
                log.info("Twilio stream from %s: session %s", self.ws.remote_address, self.session_id)
                await self._serve(runner)
        except CapacityError as exc:
            self.reason = f"refused: {exc}"
            log.warning("Twilio stream refused: %s", exc)
            await self.ws.close(CLOSE_OVERLOAD, "server is at capacity, retry later")
        except EndCall as end:
            self.reason = end.reason
            if end.code is not None:
                await self.ws.close(end.code, end.reason[:120])
        finally:
            self._log_end()

    async def _serve(self, runner: SessionRunner) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if self.started:
                    message = await self.ws.recv()
                else:
                    message = await asyncio.wait_for(self.ws.recv(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise EndCall(f"no start message within {START_TIMEOUT_S:g} s", CLOSE_POLICY) from None
            except ConnectionClosed:
                reason = "connection closed by Twilio" if self.started else "connection closed before start"
                raise EndCall(reason) from None
            fed = self.stats.media_in
            self.handle(message)
            if self.stats.media_in > fed and self.guard is not None:
                await self.guard.audio(
                    0.02 * (self.stats.media_in - fed)
                )  # Twilio sends 20 ms per media message
            if isinstance(runner.failed, ClientTooSlow):
                raise EndCall(f"dropped: {runner.failed}", CLOSE_POLICY)
            if runner.ending is not None:
                raise EndCall(f"ended: {runner.ending}")

    def handle(self, message: str | bytes) -> None:
        """Dispatch one message; a bad one is logged and counted, a `stop` raises EndCall."""
        try:
            parsed = parse_message(message, started=self.started)
            _HANDLERS[type(parsed)](self, parsed)
        except BadFrame as exc:
            self._bad(str(exc))
            return
        self.bad_in_a_row = 0

    def _bad(self, message: str) -> None:
        self.stats.bad_frames += 1
        self.bad_in_a_row += 1
        self._warn(f"{message}; skipped")
        if self.bad_in_a_row >= MAX_BAD_FRAMES:
            raise EndCall(f"{self.bad_in_a_row} unusable messages in a row", CLOSE_POLICY)

    def _warn(self, message: str) -> None:
        self.warnings += 1
        if self.warnings <= MAX_WARNINGS:
            log.warning("Twilio session %s (call %s): %s", self.session_id, self.call_sid or "-", message)
        elif self.warnings == MAX_WARNINGS + 1:
            log.warning(
                "Twilio session %s: more warnings; not logging them until the call ends", self.session_id
            )

    def _log_end(self) -> None:
        s = self.stats
        log.info(
            "Twilio session %s (call %s) ended: %s; %.1f s, %d media in, %d out, marks %d sent / %d played / "
            "%d dropped by clear, %d clears, %d DTMF, %d bad messages%s",
            self.session_id or "-",
            self.call_sid or "-",
            self.reason,
            time.monotonic() - self._started_at,
            s.media_in,
            s.media_out,
            s.marks_sent,
            s.marks_played,
            s.marks_dropped,
            s.clears,
            s.dtmf,
            s.bad_frames,
            f" ({self.warnings - MAX_WARNINGS} warnings not logged)" if self.warnings > MAX_WARNINGS else "",
        )

    # -- Twilio -> session ---------------------------------------------------------------------

    def _on_connected(self, message: Connected) -> None:
        log.debug(
            "Twilio session %s: connected (protocol %s, version %s)",
            self.session_id,
            message.protocol,
            message.version,
        )

    def _on_start(self, start: Start) -> None:
        self.stream_sid = start.stream_sid
        self.call_sid = start.call_sid
        self.account_sid = start.account_sid
        for warning in start.warnings:
            self._warn(warning)
        self.custom_parameters = start.custom_parameters
        log.info(
            "Twilio session %s: call %s, stream %s, parameters %s",
            self.session_id,
            short_repr(self.call_sid),
            short_repr(start.stream_sid),
            short_repr(self.custom_parameters, 500),
        )
        runner = self._runner()
        self._apply_options(runner, self.custom_parameters)
        core = runner.core
        runner.emit(
            SessionStarted(
                session_id=core.session_id,
                turn_id=0,
                t=core.clock(),
                input_sample_rate=WIRE_RATE,
                output_sample_rate=WIRE_RATE,
                profile=core.profile.name,
                options={k: getattr(core.options, k) for k in core.options.CLIENT_SETTABLE},
            )
        )
        if self.settings.on_start is not None:
            try:
                self.settings.on_start(self)
            except Exception:
                log.exception("Twilio session %s: on_start callback failed", self.session_id)

    def _apply_options(self, runner: SessionRunner, params: dict[str, str]) -> None:
        """`<Parameter name="end_of_turn_silence_ms" value="700"/>` sets a per-call session option."""
        settable = runner.core.options.CLIENT_SETTABLE
        overrides = {k: parameter_value(v) for k, v in params.items() if k in settable}
        if not overrides:
            return
        try:
            runner.core.configure(overrides)
        except ConfigError as exc:
            self._warn(f"start: session options {short_repr(overrides, 300)} refused: {exc}")

    def _on_media(self, media: Media) -> None:
        self.stats.media_in += 1
        self._runner().feed_audio(self._audio_in.decode(media.audio))

    def _on_dtmf(self, dtmf: Dtmf) -> None:
        self.stats.dtmf += 1
        core = self._runner().core
        self._runner().emit(
            DtmfReceived(
                session_id=core.session_id,
                turn_id=core.turn_id,
                t=core.clock(),
                digit=dtmf.digit,
                source="twilio",
            )
        )

    def _on_mark(self, mark: Mark) -> None:
        position = self._marks.echoed(mark.name)
        if position is None:
            self.stats.marks_dropped += 1  # its audio was cleared, never heard
            return
        self.stats.marks_played += 1
        turn_id, ms = position
        self._runner().control({"type": CLIENT_PLAYOUT, "turn_id": turn_id, "played_ms": ms})

    def _on_stop(self, stop: Stop) -> None:
        raise EndCall("Twilio sent stop (the call ended)", None)

    def _runner(self) -> SessionRunner:
        assert self.runner is not None, "handle() before the session was opened"
        return self.runner

    # -- session -> Twilio (the runner's writer task calls this, in output order) --------------

    async def send_output(self, item: Output) -> None:
        """The runner's `send`: audio becomes media + mark, events steer the output, then go to the app."""
        if isinstance(item, bytes):
            out = self._outgoing()
            await self._send_media(out.encode(item))
            return
        if isinstance(item, ResponseAudioStarted):
            self._outgoing().start(item.turn_id)
        elif isinstance(item, Interrupted):
            await self._clear()
        elif isinstance(item, ResponseDone) and item.status not in ("interrupted", "cancelled"):
            await self._send_media(self._outgoing().flush())  # the answer's last few ms, padded
        elif isinstance(item, DtmfReceived):
            log.info("Twilio session %s (call %s): DTMF %s", self.session_id, self.call_sid, item.digit)
        elif isinstance(item, ErrorEvent):
            self._warn(f"session error {item.code}: {item.message}")
        self._publish(item)

    async def _send_media(self, payloads: list[bytes]) -> None:
        """Media messages for `payloads`, then a mark at the position they end (nothing if empty)."""
        if not payloads or self.stream_sid is None:
            return
        for payload in payloads:
            await self._send(media_message(self.stream_sid, payload))
        self.stats.media_out += len(payloads)
        out = self._outgoing()
        name = self._marks.new(out.turn_id, out.sent_ms)
        await self._send(mark_message(self.stream_sid, name))
        self.stats.marks_sent += 1

    async def _clear(self) -> None:
        """Barge-in: Twilio drops what it has queued; the old answer's remainder never leaks."""
        self._outgoing().drop()
        self._marks.clear()
        if self.stream_sid is not None:
            await self._send(clear_message(self.stream_sid))
            self.stats.clears += 1

    async def _send(self, message: dict[str, Any]) -> None:
        await self.ws.send(encode_message(message))

    def _outgoing(self) -> OutgoingAudio:
        assert self._out is not None, "output before the session was opened"
        return self._out

    def _publish(self, event: ServerEvent) -> None:
        """Hand an event to the application; a failing callback must not end the call."""
        if self.settings.on_event is None:
            return
        try:
            self.settings.on_event(event)
        except Exception:
            log.exception("Twilio session %s: on_event callback failed for %s", self.session_id, event.type)


_HANDLERS: dict[type[TwilioMessage], Callable[[TwilioCall, Any], None]] = {
    Connected: TwilioCall._on_connected,
    Start: TwilioCall._on_start,
    Media: TwilioCall._on_media,
    Dtmf: TwilioCall._on_dtmf,
    Mark: TwilioCall._on_mark,
    Stop: TwilioCall._on_stop,
}


# -- mounting ---------------------------------------------------------------------------------


def mount_twilio(server: DuplexServer, settings: TwilioSettings | None = None) -> None:
    """Serve Twilio Media Streams at `TWILIO_PATH` on `server` (before `server.start()`)."""
    settings = settings or TwilioSettings()

    async def handle(ws: ServerConnection) -> None:
        call = TwilioCall(ws, settings)
        try:
            await call.run(server.service)
        except Exception:  # a bug must end only this call, never the server
            log.exception("Twilio session %s failed", call.session_id or "-")
            with contextlib.suppress(Exception):
                await ws.close(1011, "internal error")

    server.extra_routes[TWILIO_PATH] = handle
    if settings.auth_token:
        server.extra_checks[TWILIO_PATH] = lambda request: check_signature(settings, request)
    elif server.auth.enabled:
        # Twilio cannot send an API key: with keys set, the stream is open only to signed requests
        server.extra_checks[TWILIO_PATH] = lambda request: http_response(
            HTTPStatus.FORBIDDEN,
            b"API keys are set but no Twilio auth token: /v1/twilio needs --twilio-auth-token\n",
            "text/plain",
        )
        log.warning("%s refuses every stream: API keys are set but no Twilio auth token", TWILIO_PATH)
    else:
        server.extra_checks.pop(TWILIO_PATH, None)
        log.warning(
            "Twilio Media Streams at %s without signature checks: anyone who can reach it gets a "
            "session (set --twilio-auth-token)",
            TWILIO_PATH,
        )
