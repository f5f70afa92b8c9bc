"""Twilio Media Streams gateway: one phone call = one WebSocket = one duplex session.

A number whose TwiML says `<Connect><Stream url="wss://HOST/v1/twilio"/>` makes Twilio open a
*bidirectional* Media Stream to us. Both directions are JSON text frames:

    Twilio -> us   connected, start (streamSid, callSid, mediaFormat, customParameters),
                   media (base64 mu-law 8 kHz, 20 ms per message), dtmf, mark (echo), stop
    us -> Twilio   media (base64 mu-law 8 kHz), mark (name), clear (drop queued audio)

This module is a transport adapter like `duplex.transports.native`: it translates and holds no dialogue logic.

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
import base64
import binascii
import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import time
import urllib.parse
from collections import OrderedDict
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
from duplex.runtime.runner import Output, SessionRunner
from duplex.runtime.service import CapacityError, DuplexService
from duplex.transports.common import AudioIn, AudioOut, open_session
from duplex.transports.native import CLOSE_OVERLOAD, CLOSE_POLICY, DuplexServer, http_response

log = logging.getLogger("duplex.transports.twilio")

TWILIO_PATH = "/v1/twilio"
WIRE_RATE = 8000  # Twilio Media Streams carry mu-law at 8 kHz, always
FRAME_BYTES = 160  # 20 ms of 8 kHz mu-law: what Twilio sends, and what we send back
MULAW_SILENCE = 0xFF  # mu-law code of a zero sample
EXPECTED_FORMAT = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}
DTMF_DIGITS = frozenset("0123456789*#ABCD")

# Limits. Module constants rather than arguments: tests shorten them with monkeypatch.
MAX_MESSAGE_CHARS = 64 * 1024  # a 20 ms media message is ~300 characters
MAX_PAYLOAD_BYTES = 8000  # 1 s of audio in one media message: Twilio sends 160 bytes
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


class BadFrame(ValueError):
    """A message from Twilio we cannot use: logged and skipped (Twilio cannot receive errors)."""


class EndCall(Exception):
    """Ends the call; `code` is the WebSocket close code (None: the peer already ended it)."""

    def __init__(self, reason: str, code: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


# -- signatures ------------------------------------------------------------------------------


def twilio_signature(auth_token: str, data: str) -> str:
    """Base64(HMAC-SHA1(auth_token, data)): Twilio's X-Twilio-Signature over a URL (+ POST params)."""
    digest = hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode("ascii")


def signed_url(public_url: str | None, host: str | None, path: str) -> str | None:
    """The URL Twilio requested, as it signed it: `public_url` (or wss://Host) + the request path.

    A `public_url` that already ends with the Twilio path is taken as the full URL (only the query
    string is added), since that is what people paste from their TwiML.
    """
    route, _, query = path.partition("?")
    if public_url:
        base = public_url.rstrip("/")
        if urllib.parse.urlsplit(base).path.endswith(route):
            return base + (f"?{query}" if query else "")
        return base + path
    if not host:
        return None
    return f"wss://{host}{path}"


def url_variants(url: str) -> list[str]:
    """The URL with and without its default port, as Twilio's own validators accept both."""
    parts = urllib.parse.urlsplit(url)
    default = {"wss": 443, "https": 443, "ws": 80, "http": 80}.get(parts.scheme)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"  # IPv6 literal
    if parts.port is not None and parts.port == default:
        other = parts._replace(netloc=host)
    elif parts.port is None and default is not None:
        other = parts._replace(netloc=f"{host}:{default}")
    else:
        return [url]
    return [url, urllib.parse.urlunsplit(other)]


def check_signature(settings: TwilioSettings, request: Request) -> Response | None:
    """Before the upgrade: None to accept, or a 403 response when the signature is missing or wrong."""
    token = settings.auth_token
    if not token:
        return None
    given = request.headers.get("X-Twilio-Signature")
    url = signed_url(settings.public_url, request.headers.get("Host"), request.path)
    reason = None
    if not given:
        reason = "no X-Twilio-Signature header"
    elif url is None:
        reason = "no Host header to rebuild the signed URL from (set --public-url)"
    elif not any(_same(twilio_signature(token, u), given) for u in url_variants(url)):
        reason = f"X-Twilio-Signature does not match {url} (is --public-url the URL in your TwiML?)"
    if reason is None:
        return None
    log.warning("Twilio stream refused (403): %s", reason)
    return http_response(HTTPStatus.FORBIDDEN, b"invalid or missing X-Twilio-Signature\n", "text/plain")


def _same(expected: str, given: str) -> bool:
    """Constant-time comparison that also copes with non-ASCII header values."""
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


# -- outgoing audio and marks -----------------------------------------------------------------


class OutgoingAudio:
    """The core's 24 kHz PCM16 frames -> exact 160-byte mu-law payloads, counted per answer."""

    def __init__(self, source_rate: int) -> None:
        self._conv = AudioOut(source_rate, WIRE_RATE, "ulaw")
        self._pending = bytearray()  # converted audio not yet a whole 20 ms frame
        self.turn_id = 0  # the turn whose answer is being sent
        self.sent_bytes = 0  # of this answer, padding included (1 byte = 1/8 ms)

    @property
    def sent_ms(self) -> int:
        return self.sent_bytes * 1000 // WIRE_RATE

    def start(self, turn_id: int) -> None:
        """A new answer begins: its positions count from zero."""
        self.drop()
        self.turn_id = turn_id
        self.sent_bytes = 0

    def encode(self, pcm16: bytes) -> list[bytes]:
        """Whole 20 ms payloads from one core frame; the remainder waits for the next one."""
        self._pending += self._conv.encode(pcm16)
        return self._take(len(self._pending) // FRAME_BYTES)

    def flush(self) -> list[bytes]:
        """The answer ended: its last partial frame, padded with silence (no payload if none)."""
        if len(self._pending) % FRAME_BYTES:
            self._pending += bytes([MULAW_SILENCE]) * (FRAME_BYTES - len(self._pending) % FRAME_BYTES)
        payloads = self._take(len(self._pending) // FRAME_BYTES)
        self._conv.reset()
        return payloads

    def drop(self) -> None:
        """Barge-in: forget the partial frame and the resampler's history of the old answer."""
        self._pending.clear()
        self._conv.reset()

    def _take(self, n: int) -> list[bytes]:
        payloads = [bytes(self._pending[i * FRAME_BYTES : (i + 1) * FRAME_BYTES]) for i in range(n)]
        del self._pending[: n * FRAME_BYTES]
        self.sent_bytes += n * FRAME_BYTES
        return payloads


class MarkBook:
    """Marks we sent and not yet got back; a `clear` turns the outstanding ones into 'dropped'.

    Names are unique (`t<turn>:<ms>:<seq>`), so an echo is never confused with another mark.
    """

    def __init__(self, limit: int = 4096) -> None:
        self._seq = itertools.count(1)
        self._pending: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._dropped: set[str] = set()
        self._limit = limit  # a peer that never echoes must not grow memory without bound

    def new(self, turn_id: int, ms: int) -> str:
        name = f"t{turn_id}:{ms}:{next(self._seq)}"
        self._pending[name] = (turn_id, ms)
        while len(self._pending) > self._limit:
            self._pending.popitem(last=False)
        return name

    def clear(self) -> int:
        """Our `clear` drops the audio before every outstanding mark; returns how many."""
        n = len(self._pending)
        self._dropped.update(self._pending)
        self._pending.clear()
        while len(self._dropped) > self._limit:
            self._dropped.pop()
        return n

    def echoed(self, name: str) -> tuple[int, int] | None:
        """(turn id, ms played) of an echoed mark; None for a mark whose audio was cleared.

        Raises BadFrame for a name we never sent.
        """
        if name in self._dropped:
            self._dropped.discard(name)
            return None
        position = self._pending.pop(name, None)
        if position is None:
            raise BadFrame(f"mark {name[:40]!r} was never sent (or echoed twice)")
        return position


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
            async with open_session(service, self.send_output) as runner:
                self.runner = runner
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
            self.handle(message)
            if runner.failed is not None:
                raise EndCall(f"dropped: {runner.failed}", CLOSE_POLICY)

    def handle(self, message: str | bytes) -> None:
        """Dispatch one message; a bad one is logged and counted, a `stop` raises EndCall."""
        try:
            event = _parse(message)
            handler = _HANDLERS.get(event["event"])
            if handler is None:
                raise BadFrame(f"unknown event {str(event['event'])[:40]!r}")
            handler(self, event)
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
            log.warning("Twilio session %s: more warnings; not logging them until the call ends", self.session_id)

    def _log_end(self) -> None:
        s = self.stats
        log.info(
            "Twilio session %s (call %s) ended: %s; %.1f s, %d media in, %d out, marks %d sent / %d played / "
            "%d dropped by clear, %d clears, %d DTMF, %d bad messages%s",
            self.session_id or "-", self.call_sid or "-", self.reason, time.monotonic() - self._started_at,
            s.media_in, s.media_out, s.marks_sent, s.marks_played, s.marks_dropped, s.clears, s.dtmf, s.bad_frames,
            f" ({self.warnings - MAX_WARNINGS} warnings not logged)" if self.warnings > MAX_WARNINGS else "",
        )

    # -- Twilio -> session ---------------------------------------------------------------------

    def _on_connected(self, event: dict[str, Any]) -> None:
        log.debug("Twilio session %s: connected (protocol %s, version %s)", self.session_id,
                  event.get("protocol"), event.get("version"))

    def _on_start(self, event: dict[str, Any]) -> None:
        if self.started:
            raise BadFrame("a second start message")
        body = _object(event, "start")
        stream_sid = body.get("streamSid") or event.get("streamSid")
        if not isinstance(stream_sid, str) or not stream_sid:
            raise BadFrame("start without a streamSid")
        self.stream_sid = stream_sid
        self.call_sid = str(body.get("callSid") or "")
        self.account_sid = str(body.get("accountSid") or "")
        fmt = body.get("mediaFormat")
        if not isinstance(fmt, dict) or any(fmt.get(k) != v for k, v in EXPECTED_FORMAT.items()):
            self._warn(f"start: mediaFormat {_short(fmt)} is not {EXPECTED_FORMAT}; treating the audio as mu-law 8 kHz")
        params = body.get("customParameters") or {}
        if not isinstance(params, dict):
            self._warn(f"start: customParameters is {type(params).__name__}, not an object; ignored")
            params = {}
        self.custom_parameters = {str(k): str(v) for k, v in params.items()}
        log.info("Twilio session %s: call %s, stream %s, parameters %s", self.session_id, _short(self.call_sid),
                 _short(stream_sid), _short(self.custom_parameters, 500))
        runner = self._runner()
        self._apply_options(runner, self.custom_parameters)
        core = runner.core
        runner.emit(SessionStarted(
            session_id=core.session_id, turn_id=0, t=core.clock(), input_sample_rate=WIRE_RATE,
            output_sample_rate=WIRE_RATE, profile=core.profile.name,
            options={k: getattr(core.options, k) for k in core.options.CLIENT_SETTABLE},
        ))
        if self.settings.on_start is not None:
            try:
                self.settings.on_start(self)
            except Exception:
                log.exception("Twilio session %s: on_start callback failed", self.session_id)

    def _apply_options(self, runner: SessionRunner, params: dict[str, str]) -> None:
        """`<Parameter name="end_of_turn_silence_ms" value="700"/>` sets a per-call session option."""
        settable = runner.core.options.CLIENT_SETTABLE
        overrides = {k: _number(v) for k, v in params.items() if k in settable}
        if not overrides:
            return
        try:
            runner.core.configure(overrides)
        except ConfigError as exc:
            self._warn(f"start: session options {_short(overrides, 300)} refused: {exc}")

    def _on_media(self, event: dict[str, Any]) -> None:
        if not self.started:
            raise BadFrame("media before start")
        media = _object(event, "media")
        track = media.get("track", "inbound")
        if track not in ("inbound", "inbound_track"):
            raise BadFrame(f"media on track {str(track)[:20]!r}: only the caller's inbound track is used")
        payload = media.get("payload")
        if not isinstance(payload, str):
            raise BadFrame("media without a string payload")
        if len(payload) > MAX_PAYLOAD_BYTES * 4 // 3 + 4:
            raise BadFrame(f"media payload of {len(payload)} base64 characters (> {MAX_PAYLOAD_BYTES} bytes)")
        try:
            audio = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise BadFrame("media payload is not valid base64") from None
        if not audio:
            raise BadFrame("empty media payload")
        self.stats.media_in += 1
        self._runner().feed_audio(self._audio_in.decode(audio))

    def _on_dtmf(self, event: dict[str, Any]) -> None:
        if not self.started:
            raise BadFrame("dtmf before start")
        digit = _object(event, "dtmf").get("digit")
        if not isinstance(digit, str) or digit.upper() not in DTMF_DIGITS:
            raise BadFrame(f"dtmf digit {str(digit)[:8]!r} is not one of 0-9 * # A-D")
        self.stats.dtmf += 1
        core = self._runner().core
        self._runner().emit(DtmfReceived(session_id=core.session_id, turn_id=core.turn_id, t=core.clock(),
                                         digit=digit.upper(), source="twilio"))

    def _on_mark(self, event: dict[str, Any]) -> None:
        name = _object(event, "mark").get("name")
        if not isinstance(name, str):
            raise BadFrame("mark without a string name")
        position = self._marks.echoed(name)
        if position is None:
            self.stats.marks_dropped += 1  # its audio was cleared, never heard
            return
        self.stats.marks_played += 1
        turn_id, ms = position
        self._runner().control({"type": CLIENT_PLAYOUT, "turn_id": turn_id, "played_ms": ms})

    def _on_stop(self, event: dict[str, Any]) -> None:
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
            await self._send({"event": "media", "streamSid": self.stream_sid,
                              "media": {"payload": base64.b64encode(payload).decode("ascii")}})
        self.stats.media_out += len(payloads)
        out = self._outgoing()
        name = self._marks.new(out.turn_id, out.sent_ms)
        await self._send({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})
        self.stats.marks_sent += 1

    async def _clear(self) -> None:
        """Barge-in: Twilio drops what it has queued; the old answer's remainder never leaks."""
        self._outgoing().drop()
        self._marks.clear()
        if self.stream_sid is not None:
            await self._send({"event": "clear", "streamSid": self.stream_sid})
            self.stats.clears += 1

    async def _send(self, message: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(message, separators=(",", ":")))

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


_HANDLERS: dict[str, Callable[[TwilioCall, dict[str, Any]], None]] = {
    "connected": TwilioCall._on_connected,
    "start": TwilioCall._on_start,
    "media": TwilioCall._on_media,
    "dtmf": TwilioCall._on_dtmf,
    "mark": TwilioCall._on_mark,
    "stop": TwilioCall._on_stop,
}


def _parse(message: str | bytes) -> dict[str, Any]:
    if isinstance(message, bytes):
        raise BadFrame(f"binary frame of {len(message)} bytes (Twilio sends JSON text)")
    if len(message) > MAX_MESSAGE_CHARS:
        raise BadFrame(f"message of {len(message)} characters (> {MAX_MESSAGE_CHARS})")
    try:
        event = json.loads(message)
    except json.JSONDecodeError as exc:
        raise BadFrame(f"malformed JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        raise BadFrame('not a JSON object with a string "event"')
    return event


def _object(event: dict[str, Any], key: str) -> dict[str, Any]:
    body = event.get(key)
    if not isinstance(body, dict):
        raise BadFrame(f"{event['event']} message without a {key!r} object")
    return body


def _short(value: Any, limit: int = 120) -> str:
    """repr() of something a peer sent, cut to a sane length for the log."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(value: str) -> Any:
    """A custom parameter's string as the number a session option needs (left as is otherwise)."""
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(value)
    return value


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
    else:
        server.extra_checks.pop(TWILIO_PATH, None)
        log.warning("Twilio Media Streams at %s without signature checks: anyone who can reach it gets a "
                    "session (set --twilio-auth-token)", TWILIO_PATH)
