"""Asterisk AudioSocket as data: an incremental frame parser and the messages we send back.

Sans-I/O: bytes in, typed messages out; PCM in, bytes out. The connection
(`duplex.transports.audiosocket`) reads the socket, feeds the bytes to an `AudioSocketParser` and
acts on the messages; this module only knows *what the stream looks like*, so every rule can be
tested without a socket. Every message is `type (1 byte) | payload length (uint16, big endian) |
payload`:

    0x00 hangup (no payload)          0x01 call UUID (16 bytes, always first)
    0x03 DTMF digit (1 ASCII byte)    0x10 audio: signed 16-bit little-endian PCM, 8 kHz mono
    0x11..0x18 audio at 12/16/24/32/44.1/48/96/192 kHz (newer Asterisk, channel driver only)
    0xff error (optional code from Asterisk, bit-packed)

Errors: `FramingError` when the bytes are not AudioSocket (the call should be hung up), decided
from a message's header alone so garbage is never waited on; `TruncatedMessage` when the stream
ends inside a message. See docs/audiosocket.md.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

KIND_HANGUP = 0x00
KIND_UUID = 0x01
KIND_DTMF = 0x03
KIND_AUDIO = 0x10  # slin, 8 kHz: what the AudioSocket() dialplan application always uses
KIND_ERROR = 0xFF
#: audio message types -> sample rate (0x11.. only in recent Asterisk releases, channel driver only)
AUDIO_KINDS = {
    0x10: 8000,
    0x11: 12000,
    0x12: 16000,
    0x13: 24000,
    0x14: 32000,
    0x15: 44100,
    0x16: 48000,
    0x17: 96000,
    0x18: 192000,
}
DEFAULT_RATE = 8000
FRAME_MS = 20  # Asterisk's own frame size; we send exactly this much per audio message
#: Asterisk's bit-packed error codes (res_audiosocket)
ASTERISK_ERRORS = {0x01: "hangup of calling party", 0x02: "frame forwarding error", 0x04: "memory error"}
DTMF_DIGITS = frozenset("0123456789*#ABCD")
HEADER_BYTES = 3
UUID_BYTES = 16
MAX_AUDIO_MS = 500  # an audio message longer than this is not Asterisk (it sends 20 ms)


class AudioSocketError(ValueError):
    """The byte stream cannot be read as AudioSocket messages; the text says why."""


class FramingError(AudioSocketError):
    """Not AudioSocket (a bad first message, an oversized audio message): hang up the call."""


class TruncatedMessage(AudioSocketError):
    """The stream ended inside a message."""


# -- messages ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hangup:
    """0x00: the peer ends the call."""


@dataclass(frozen=True)
class CallUuid:
    """0x01: the call's UUID; `call_uuid` is None for a later UUID message that is not 16 bytes."""

    payload: bytes

    @property
    def call_uuid(self) -> uuid.UUID | None:
        return uuid.UUID(bytes=self.payload) if len(self.payload) == UUID_BYTES else None


@dataclass(frozen=True)
class Dtmf:
    """0x03: a keypad digit; `digit` is None when the payload is not one of 0-9 * # A-D."""

    payload: bytes

    @property
    def digit(self) -> str | None:
        digit = self.payload.decode("ascii", "replace").upper() if len(self.payload) == 1 else ""
        return digit if digit in DTMF_DIGITS else None


@dataclass(frozen=True)
class Audio:
    """0x10..0x18: signed 16-bit little-endian PCM at `rate` (may be empty or odd-sized: check)."""

    kind: int
    pcm: bytes

    @property
    def rate(self) -> int:
        return AUDIO_KINDS[self.kind]


@dataclass(frozen=True)
class ErrorReport:
    """0xff: Asterisk reports an error; `code` (bit-packed, see `ASTERISK_ERRORS`) may be absent."""

    payload: bytes

    @property
    def code(self) -> int | None:
        return self.payload[0] if self.payload else None

    @property
    def names(self) -> list[str]:
        code = self.code or 0
        return [name for bit, name in ASTERISK_ERRORS.items() if code & bit] or ["unknown"]


@dataclass(frozen=True)
class Unknown:
    """A message type this server does not know; skipped."""

    kind: int
    payload: bytes


Message = Hangup | CallUuid | Dtmf | Audio | ErrorReport | Unknown


class AudioSocketParser:
    """An incremental parser: `feed` bytes as they arrive, take messages with `next_message`.

    The first message must be the call UUID (16 bytes); a hangup instead ends the stream at once.
    Oversized audio and a wrong first message raise `FramingError` as soon as their header is in,
    without waiting for the payload. After `feed_eof`, a partial message raises `TruncatedMessage`.
    After a `Hangup` the stream is over: nothing more is parsed.
    """

    def __init__(self, *, max_audio_ms: int = MAX_AUDIO_MS) -> None:
        self.max_audio_ms = max_audio_ms
        self.uuid_seen = False  # the first message, the call UUID, was parsed
        self.eof = False
        self.ended = False  # a hangup was parsed
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        """Bytes received from the peer, in order."""
        if self.eof:
            raise RuntimeError("feed() after feed_eof()")
        self._buffer += data

    def feed_eof(self) -> None:
        """The peer closed its side: a message still incomplete is truncated."""
        self.eof = True

    @property
    def buffered(self) -> int:
        """Bytes received and not yet parsed into a message."""
        return len(self._buffer)

    def next_message(self) -> Message | None:
        """The next complete message, or None until more bytes arrive (or at a clean end)."""
        if self.ended:
            return None
        buf = self._buffer
        if len(buf) < HEADER_BYTES:
            self._check_truncated()
            return None
        kind, length = buf[0], int.from_bytes(buf[1:HEADER_BYTES], "big")
        if not self.uuid_seen:
            if kind == KIND_HANGUP:  # the peer gave up before saying which call: no payload to wait for
                self.ended = True
                return Hangup()
            if kind != KIND_UUID:
                raise FramingError(f"protocol error: message type 0x{kind:02x} before the call UUID")
            if length != UUID_BYTES:
                raise FramingError(f"protocol error: call UUID of {length} bytes (expected {UUID_BYTES})")
        rate = AUDIO_KINDS.get(kind)
        if rate is not None and length > rate * 2 * self.max_audio_ms // 1000:
            raise FramingError(f"protocol error: audio message of {length} bytes (> {self.max_audio_ms} ms)")
        if len(buf) < HEADER_BYTES + length:
            self._check_truncated()
            return None
        payload = bytes(buf[HEADER_BYTES : HEADER_BYTES + length])
        del buf[: HEADER_BYTES + length]
        return self._message(kind, payload)

    def messages(self) -> Iterator[Message]:
        """Every complete message now buffered, in order (raises at the first bad one)."""
        while (message := self.next_message()) is not None:
            yield message

    def _check_truncated(self) -> None:
        """An incomplete message is only waiting for bytes, unless the stream has ended."""
        if self.eof and self._buffer:
            raise TruncatedMessage("truncated message")

    def _message(self, kind: int, payload: bytes) -> Message:
        if kind in AUDIO_KINDS:
            return Audio(kind, payload)
        if kind == KIND_UUID:
            self.uuid_seen = True
            return CallUuid(payload)
        if kind == KIND_HANGUP:
            self.ended = True
            return Hangup()
        if kind == KIND_DTMF:
            return Dtmf(payload)
        if kind == KIND_ERROR:
            return ErrorReport(payload)
        return Unknown(kind, payload)


# -- us -> Asterisk ----------------------------------------------------------------------------


def encode_message(kind: int, payload: bytes = b"") -> bytes:
    """One AudioSocket message."""
    return bytes((kind,)) + len(payload).to_bytes(2, "big") + payload


def hangup_message() -> bytes:
    """0x00: Asterisk ends the channel."""
    return encode_message(KIND_HANGUP)


def frame_bytes(rate: int) -> int:
    """Bytes of one 20 ms PCM16 audio message at `rate`."""
    return rate * FRAME_MS // 1000 * 2


def audio_messages(kind: int, pcm: bytes, size: int) -> bytes:
    """`pcm` (a whole number of `size`-byte frames) as consecutive audio messages of type `kind`."""
    if len(pcm) % size:
        raise ValueError(f"{len(pcm)} bytes of audio is not a whole number of {size}-byte frames")
    return b"".join(encode_message(kind, pcm[i : i + size]) for i in range(0, len(pcm), size))
