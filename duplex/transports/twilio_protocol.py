"""Twilio Media Streams as data: the JSON messages both ways, the signature, and 20 ms mu-law framing.

Sans-I/O: text in, typed messages out; payloads and ids in, JSON text out. The connection
(`duplex.transports.twilio`) decides *when* to send what and drives the session; this module only
knows *what it looks like*, so every rule can be tested without a socket.

    Twilio -> us   connected, start (streamSid, callSid, mediaFormat, customParameters),
                   media (base64 mu-law 8 kHz, 20 ms per message), dtmf, mark (echo), stop
    us -> Twilio   media (base64 mu-law 8 kHz), mark (name), clear (drop queued audio)

`parse_message` turns one text frame into `Connected`, `Start`, `Media`, `Dtmf`, `Mark` or `Stop`,
or raises `BadFrame` (Twilio cannot receive errors: the connection logs and skips it).
`MarkBook` tracks the marks we sent, `OutgoingAudio` cuts the core's audio into exact 160-byte
payloads, and `signature_problem` checks X-Twilio-Signature (HMAC-SHA1 of the wss:// URL).
See docs/twilio.md.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import itertools
import json
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from duplex.transports.wire_audio import AudioOut

TWILIO_PATH = "/v1/twilio"
WIRE_RATE = 8000  # Twilio Media Streams carry mu-law at 8 kHz, always
FRAME_BYTES = 160  # 20 ms of 8 kHz mu-law: what Twilio sends, and what we send back
MULAW_SILENCE = 0xFF  # mu-law code of a zero sample
EXPECTED_FORMAT = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}
DTMF_DIGITS = frozenset("0123456789*#ABCD")
INBOUND_TRACKS = ("inbound", "inbound_track")  # the caller's audio; we never ask for the outbound track

MAX_MESSAGE_CHARS = 64 * 1024  # a 20 ms media message is ~300 characters
MAX_PAYLOAD_BYTES = 8000  # 1 s of audio in one media message: Twilio sends 160 bytes


class BadFrame(ValueError):
    """A message from Twilio we cannot use: logged and skipped (Twilio cannot receive errors)."""


# -- Twilio -> us ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Connected:
    """`connected`: the first message of every stream (informational)."""

    protocol: Any = None
    version: Any = None


@dataclass(frozen=True)
class Start:
    """`start`: the call's ids and custom parameters. `warnings`: what was odd but usable."""

    stream_sid: str
    call_sid: str = ""
    account_sid: str = ""
    custom_parameters: dict[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Media:
    """`media`: the caller's audio, 8 kHz mu-law bytes (decoded from base64, never empty)."""

    audio: bytes


@dataclass(frozen=True)
class Dtmf:
    """`dtmf`: one keypad digit, upper case (0-9 * # A-D)."""

    digit: str


@dataclass(frozen=True)
class Mark:
    """`mark`: Twilio echoes a mark we sent once the audio before it has played (or was cleared)."""

    name: str


@dataclass(frozen=True)
class Stop:
    """`stop`: the call ended."""


TwilioMessage = Connected | Start | Media | Dtmf | Mark | Stop


def parse_message(message: str | bytes, *, started: bool) -> TwilioMessage:
    """One WebSocket frame from Twilio; `started`: whether a `start` was already accepted.

    Raises BadFrame for anything unusable: binary or oversized frames, malformed JSON, unknown
    events, a second `start`, media or DTMF before `start`, and bad bodies.
    """
    event = _decode(message)
    kind = event["event"]
    if kind == "connected":
        return Connected(event.get("protocol"), event.get("version"))
    if kind == "start":
        if started:
            raise BadFrame("a second start message")
        return _start(event)
    if kind == "media":
        if not started:
            raise BadFrame("media before start")
        return Media(_media_audio(_object(event, "media")))
    if kind == "dtmf":
        if not started:
            raise BadFrame("dtmf before start")
        digit = _object(event, "dtmf").get("digit")
        if not isinstance(digit, str) or digit.upper() not in DTMF_DIGITS:
            raise BadFrame(f"dtmf digit {str(digit)[:8]!r} is not one of 0-9 * # A-D")
        return Dtmf(digit.upper())
    if kind == "mark":
        name = _object(event, "mark").get("name")
        if not isinstance(name, str):
            raise BadFrame("mark without a string name")
        return Mark(name)
    if kind == "stop":
        return Stop()
    raise BadFrame(f"unknown event {str(kind)[:40]!r}")


def _decode(message: str | bytes) -> dict[str, Any]:
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


def _start(event: dict[str, Any]) -> Start:
    body = _object(event, "start")
    stream_sid = body.get("streamSid") or event.get("streamSid")
    if not isinstance(stream_sid, str) or not stream_sid:
        raise BadFrame("start without a streamSid")
    warnings = []
    fmt = body.get("mediaFormat")
    if not isinstance(fmt, dict) or any(fmt.get(k) != v for k, v in EXPECTED_FORMAT.items()):
        warnings.append(
            f"start: mediaFormat {short_repr(fmt)} is not {EXPECTED_FORMAT}; treating the audio as mu-law 8 kHz"
        )
    params = body.get("customParameters") or {}
    if not isinstance(params, dict):
        warnings.append(f"start: customParameters is {type(params).__name__}, not an object; ignored")
        params = {}
    return Start(
        stream_sid=stream_sid,
        call_sid=str(body.get("callSid") or ""),
        account_sid=str(body.get("accountSid") or ""),
        custom_parameters={str(k): str(v) for k, v in params.items()},
        warnings=tuple(warnings),
    )


def _media_audio(media: dict[str, Any]) -> bytes:
    track = media.get("track", "inbound")
    if track not in INBOUND_TRACKS:
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
    return audio


def parameter_value(value: str) -> Any:
    """A custom parameter's string as the number a session option needs (left as is otherwise)."""
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(value)
    return value


def short_repr(value: Any, limit: int = 120) -> str:
    """repr() of something a peer sent, cut to a sane length for the log."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- us -> Twilio ------------------------------------------------------------------------------


def media_message(stream_sid: str, payload: bytes) -> dict[str, Any]:
    """`media`: one payload of mu-law audio for Twilio to play."""
    return {
        "event": "media",
        "streamSid": stream_sid,
        "media": {"payload": base64.b64encode(payload).decode("ascii")},
    }


def mark_message(stream_sid: str, name: str) -> dict[str, Any]:
    """`mark`: Twilio echoes it once the audio sent before it has played."""
    return {"event": "mark", "streamSid": stream_sid, "mark": {"name": name}}


def clear_message(stream_sid: str) -> dict[str, Any]:
    """`clear`: Twilio drops the audio it has queued (barge-in) and echoes the outstanding marks."""
    return {"event": "clear", "streamSid": stream_sid}


def encode_message(message: dict[str, Any]) -> str:
    """A message as the compact JSON text frame we send."""
    return json.dumps(message, separators=(",", ":"))


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


# -- X-Twilio-Signature ------------------------------------------------------------------------


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


def signature_problem(
    auth_token: str, given: str | None, *, public_url: str | None, host: str | None, path: str
) -> str | None:
    """Why an upgrade request's X-Twilio-Signature (`given`) is refused; None when it is valid.

    `host` and `path` are the request's Host header and target; `public_url` the wss:// base URL
    Twilio was told to connect to, when we are behind a proxy.
    """
    url = signed_url(public_url, host, path)
    if not given:
        return "no X-Twilio-Signature header"
    if url is None:
        return "no Host header to rebuild the signed URL from (set --public-url)"
    if not any(_same(twilio_signature(auth_token, u), given) for u in url_variants(url)):
        return f"X-Twilio-Signature does not match {url} (is --public-url the URL in your TwiML?)"
    return None


def _same(expected: str, given: str) -> bool:
    """Constant-time comparison that also copes with non-ASCII header values."""
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))
