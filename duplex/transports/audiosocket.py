"""Asterisk AudioSocket gateway: one TCP connection from Asterisk = one call = one session.

Asterisk connects *out* to us (dialplan `AudioSocket(uuid,host:port)` or `Dial(AudioSocket/...)`)
and both sides exchange messages of `type (1 byte) | payload length (uint16, big endian) | payload`:

    0x00 hangup (no payload)          0x01 call UUID (16 bytes, always first)
    0x03 DTMF digit (1 ASCII byte)    0x10 audio: signed 16-bit little-endian PCM, 8 kHz mono
    0x11..0x18 audio at 12/16/24/32/44.1/48/96/192 kHz (newer Asterisk, channel driver only)
    0xff error (optional code from Asterisk, bit-packed)

This module is the connection, a transport adapter like `duplex.transports.native`: it feeds the
bytes Asterisk sends to `duplex.transports.audiosocket_protocol`'s parser, turns the messages into
session-core input and the core's 24 kHz output into 20 ms AudioSocket frames, and holds no
dialogue logic.
The protocol has no authentication, so bind to a private address and, where possible, accept only
the call UUIDs the dialplan uses (`allowed_uuids`). It also has no "clear": Asterisk writes every
audio frame to the channel as it arrives, so on barge-in we can only stop sending; what is already
on its way (the core's ~120 ms lead plus the socket) still plays. See docs/audiosocket.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
import uuid
from collections.abc import Callable, Collection

from duplex.base.limits import ClientCounts
from duplex.core.events import DtmfReceived, Interrupted, ResponseDone, ServerEvent, SessionStarted
from duplex.runtime.runner import ClientTooSlow, Output, SessionRunner
from duplex.runtime.service import CapacityError, DuplexService
from duplex.transports.audiosocket_protocol import (
    AUDIO_KINDS,
    DEFAULT_RATE,
    KIND_AUDIO,
    Audio,
    AudioSocketParser,
    CallUuid,
    Dtmf,
    ErrorReport,
    FramingError,
    Hangup,
    Message,
    TruncatedMessage,
    Unknown,
    audio_messages,
    frame_bytes,
    hangup_message,
)
from duplex.transports.common import ClientGuard, open_session
from duplex.transports.wire_audio import AudioIn, AudioOut

log = logging.getLogger("duplex.transports.audiosocket")

CORE_RATE = 24000  # the session core's output rate

# Limits. Module constants rather than arguments: tests shorten them with monkeypatch.
UUID_TIMEOUT_S = 5.0  # Asterisk sends the UUID immediately after connecting
DRAIN_TIMEOUT_S = 5.0  # a peer that reads nothing for this long is stuck: drop the call
WRITE_BUFFER_BYTES = 16 * 1024  # ~0.5 s of 8 kHz audio queued in asyncio before `send` waits
SEND_BUFFER_BYTES = 32 * 1024  # kernel send buffer: real-time audio queued further is stale anyway
READ_BYTES = 64 * 1024  # at most this much is read from the socket at once, then parsed
MAX_WARNINGS = 10  # per call, so a peer sending garbage cannot flood the log
CLOSE_GRACE_S = 2.0  # close(): how long calls get to end before their handlers are cancelled


class EndCall(Exception):
    """Ends one call. `hang_up`: tell Asterisk with a 0x00 message (not when the peer ended it)."""

    def __init__(self, reason: str, hang_up: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.hang_up = hang_up


class PeerStuck(ConnectionError):
    """The peer stopped reading: our bounded write path could not drain in time."""


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine (so no allow-list is needed)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or '' (all interfaces): assume reachable from the network


class AudioSocketServer:
    """Accepts Asterisk AudioSocket calls for a `DuplexService`.

    `allowed_uuids`: the call UUIDs to accept (None: any; an empty collection refuses every call).
    `on_event`: called with every server event of every call (the events carry the session id;
    `calls` maps session ids to call UUIDs), e.g. to log DTMF or to react to it.
    """

    def __init__(
        self,
        service: DuplexService,
        host: str = "127.0.0.1",
        port: int = 9092,
        *,
        allowed_uuids: Collection[uuid.UUID] | None = None,
        on_event: Callable[[ServerEvent], None] | None = None,
    ) -> None:
        self.service = service
        self.host = host
        self._port = port
        self.allowed_uuids = (
            None if allowed_uuids is None else frozenset(uuid.UUID(str(u)) for u in allowed_uuids)
        )
        self.on_event = on_event
        self._server: asyncio.Server | None = None
        self._calls: dict[asyncio.Task[None], _Call] = {}
        self._closing = False
        self.clients = ClientCounts(service.limits.max_connections_per_client)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self._port)
        if self.allowed_uuids is None and not is_loopback(self.host):
            log.warning(
                "AudioSocket on %s:%d accepts ANY call UUID and has no authentication: anyone who can reach "
                "this port gets a session. Bind to a private address and pass --audiosocket-uuid.",
                self.host,
                self.port,
            )
        log.info("AudioSocket listening on %s:%d", self.host, self.port)

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        if self._server is None:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def calls(self) -> dict[str, uuid.UUID]:
        """Calls that have a session now: session id -> call UUID."""
        return {c.session_id: c.call_uuid for c in self._calls.values() if c.session_id and c.call_uuid}

    async def close(self) -> None:
        """Stop listening and hang up every call (0x00, then close); returns when all sessions are freed."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for call in list(self._calls.values()):
            call.hang_up("server shutting down")
        tasks = list(self._calls)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=CLOSE_GRACE_S)
            for task in pending:  # a peer that does not read cannot take our hangup: cut it off
                self._calls[task].writer.transport.abort()
            if pending:
                _, pending = await asyncio.wait(pending, timeout=CLOSE_GRACE_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def allowed(self, call_uuid: uuid.UUID) -> bool:
        return self.allowed_uuids is None or call_uuid in self.allowed_uuids

    def publish(self, event: ServerEvent) -> None:
        """Hand an event to `on_event`; a failing callback must not end the call."""
        if self.on_event is None:
            return
        try:
            self.on_event(event)
        except Exception:
            log.exception("AudioSocket on_event callback failed for %s", event.type)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        call = _Call(self, reader, writer)
        self._calls[task] = call
        client = str(call.peer[0]) if call.peer else "?"
        counted = False
        try:
            if self._closing or self.service.draining:  # it would outlive the server
                call.hang_up("server shutting down")
                return
            counted = self.clients.acquire(client)
            if not counted:
                self.service.metrics.refused.labels("too_many_connections").inc()
                call.hang_up(f"more than {self.clients.limit} connections from {client}")
                return
            await call.run()
        except Exception:  # a bug must end only this call, never the listener
            log.exception("AudioSocket call from %s failed", call.peer)
        finally:
            if counted:
                self.clients.release(client)
            await call.finish()
            del self._calls[task]


class _Call:
    """One AudioSocket connection: reads Asterisk's messages, writes the session's audio back."""

    def __init__(
        self, server: AudioSocketServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        self.peer = writer.get_extra_info("peername")
        self.call_uuid: uuid.UUID | None = None
        self.session_id = ""
        self.guard: ClientGuard | None = None
        self.started = time.monotonic()
        self.reason = ""  # why the call ended: the first cause wins (an abort also ends the read loop)
        self.frames_in = 0
        self.frames_out = 0
        self.warnings = 0
        self.rate = DEFAULT_RATE
        self.kind = KIND_AUDIO
        self.audio_in = AudioIn(DEFAULT_RATE, "pcm16")
        self.audio_out = AudioOut(CORE_RATE, DEFAULT_RATE, "pcm16")
        self.pending = bytearray()  # resampled output not yet a whole 20 ms frame
        self.parser = AudioSocketParser()
        self._tune_socket()

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            self.call_uuid = await self._read_uuid()
            if not self.server.allowed(self.call_uuid):
                raise EndCall("call UUID not in the allow-list")
            await self._run_session()
        except EndCall as end:
            self._ended(end.reason)
            if end.hang_up:  # we end it: the peer misbehaved, or is not allowed, or we are full
                log.warning(
                    "AudioSocket call %s from %s: %s; hanging up", self.call_uuid, self.peer, end.reason
                )
                self.hang_up(end.reason)
        except PeerStuck as exc:
            self._ended(str(exc))
            self.writer.transport.abort()

    async def _run_session(self) -> None:
        try:

            async def terminate(code: int, reason: str) -> None:
                self.hang_up(reason)  # AudioSocket has no close codes: the error event says why

            service = self.server.service
            async with open_session(
                service, self._send, transport="audiosocket", terminate=terminate
            ) as runner:
                self.session_id = runner.core.session_id
                self.guard = ClientGuard(runner, service.limits, service.metrics)
                log.info(
                    "AudioSocket call %s from %s: session %s", self.call_uuid, self.peer, self.session_id
                )
                await self._serve(runner)
        except CapacityError as exc:
            raise EndCall(f"refused: {exc}") from None

    def _ended(self, reason: str) -> None:
        self.reason = self.reason or reason

    def hang_up(self, reason: str) -> None:
        """Send Asterisk a hangup and close the connection (it ends the channel on its side)."""
        if self.writer.is_closing():
            return
        self._ended(reason)
        with contextlib.suppress(Exception):
            self.writer.write(hangup_message())
        self.writer.close()

    async def finish(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await self.writer.wait_closed()
        log.info(
            "AudioSocket call %s (session %s) ended: %s; %d frames in, %d out, %.1f s%s",
            self.call_uuid,
            self.session_id or "-",
            self.reason or "ended",
            self.frames_in,
            self.frames_out,
            time.monotonic() - self.started,
            f", {self.warnings - MAX_WARNINGS} more warnings not logged"
            if self.warnings > MAX_WARNINGS
            else "",
        )

    def _tune_socket(self) -> None:
        """Keep buffered output small: audio that waits long in a buffer is stale, and a stuck
        peer must make `drain` block (and us notice) long before memory grows."""
        self.writer.transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            with contextlib.suppress(OSError):  # asyncio sets it too; 3-byte headers must not wait for ACKs
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # -- reading ---------------------------------------------------------------------------

    async def _read_message(self) -> Message:
        """The next message; EndCall when the peer hung up, vanished or broke the framing."""
        while True:
            try:
                message = self.parser.next_message()
            except TruncatedMessage as exc:
                raise EndCall(str(exc), False) from None
            except FramingError as exc:
                raise EndCall(str(exc)) from None
            if message is not None:
                return message
            if self.parser.eof:
                raise EndCall("peer closed the connection", False)
            try:
                data = await self.reader.read(READ_BYTES)
            except (ConnectionError, OSError) as exc:
                raise EndCall(f"connection lost: {exc!r}", False) from None
            if data:
                self.parser.feed(data)
            else:
                self.parser.feed_eof()

    async def _read_uuid(self) -> uuid.UUID:
        """The first message must be the call UUID; its header alone tells (garbage is not waited on)."""
        try:
            async with asyncio.timeout(UUID_TIMEOUT_S):
                message = await self._read_message()
        except TimeoutError:
            raise EndCall(f"no call UUID within {UUID_TIMEOUT_S:g} s") from None
        if isinstance(message, Hangup):
            raise EndCall("hangup before the call UUID", False)
        assert isinstance(message, CallUuid) and message.call_uuid is not None  # the parser checks the first
        return message.call_uuid

    async def _serve(self, runner: SessionRunner) -> None:
        """Dispatch messages until the call ends; the session is freed by the caller."""
        message = await self._read_message()
        if isinstance(message, Audio) and message.kind != self.kind:
            self._set_rate(message.kind)  # session.started reports the rate Asterisk actually sends
        self._emit_started(runner)
        while True:
            self._dispatch(runner, message)
            if isinstance(message, Audio) and self.guard is not None:
                await self.guard.audio(len(message.pcm) / 2 / message.rate)
            if isinstance(runner.failed, ClientTooSlow):
                raise PeerStuck(f"dropped: {runner.failed}")
            if runner.ending is not None:
                raise EndCall(f"ended: {runner.ending}", False)
            message = await self._read_message()

    def _dispatch(self, runner: SessionRunner, message: Message) -> None:
        if isinstance(message, Audio):
            self._on_audio(runner, message)
        elif isinstance(message, Hangup):
            raise EndCall("peer hung up", False)
        elif isinstance(message, Dtmf):
            self._on_dtmf(runner, message)
        elif isinstance(message, ErrorReport):
            self._on_error(message)
        elif isinstance(message, CallUuid):
            self._warn("a second call UUID message; ignored")
        else:
            assert isinstance(message, Unknown)
            self._warn(f"unknown message type 0x{message.kind:02x} ({len(message.payload)} bytes); skipped")

    def _on_audio(self, runner: SessionRunner, audio: Audio) -> None:
        if audio.kind != self.kind:
            self._set_rate(audio.kind)
        if len(audio.pcm) % 2:
            self._warn(f"audio message of {len(audio.pcm)} bytes: PCM16 needs an even byte count; dropped")
            return
        if not audio.pcm:
            return
        self.frames_in += 1
        runner.feed_audio(self.audio_in.decode(audio.pcm))

    def _set_rate(self, kind: int) -> None:
        """Audio at another rate (the channel driver uses the channel's slin format): follow it."""
        rate = AUDIO_KINDS[kind]
        if self.frames_in:
            log.info("AudioSocket call %s: audio rate changed %d -> %d Hz", self.call_uuid, self.rate, rate)
        self.kind, self.rate = kind, rate
        self.audio_in = AudioIn(rate, "pcm16")
        self.audio_out = AudioOut(CORE_RATE, rate, "pcm16")
        self.pending.clear()

    def _on_dtmf(self, runner: SessionRunner, dtmf: Dtmf) -> None:
        digit = dtmf.digit
        if digit is None:
            self._warn(f"bad DTMF payload {dtmf.payload[:8]!r}; ignored")
            return
        core = runner.core
        log.info("AudioSocket call %s (session %s): DTMF %s", self.call_uuid, self.session_id, digit)
        runner.emit(
            DtmfReceived(
                session_id=core.session_id,
                turn_id=core.turn_id,
                t=core.clock(),
                digit=digit,
                source="audiosocket",
            )
        )

    def _on_error(self, report: ErrorReport) -> None:
        if report.code is None:
            log.warning("AudioSocket call %s: Asterisk reported an error (no code)", self.call_uuid)
            return
        log.warning(
            "AudioSocket call %s: Asterisk reported error 0x%02x (%s)",
            self.call_uuid,
            report.code,
            ", ".join(report.names),
        )

    def _warn(self, message: str) -> None:
        self.warnings += 1
        if self.warnings <= MAX_WARNINGS:
            log.warning("AudioSocket call %s: %s", self.call_uuid, message)

    def _emit_started(self, runner: SessionRunner) -> None:
        core = runner.core
        runner.emit(
            SessionStarted(
                session_id=core.session_id,
                turn_id=0,
                t=core.clock(),
                input_sample_rate=self.rate,
                output_sample_rate=self.rate,
                profile=self.server.service.profile.name,
                options={k: getattr(core.options, k) for k in core.options.CLIENT_SETTABLE},
            )
        )

    # -- writing (called by the runner's writer task, in output order) -----------------------

    async def _send(self, item: Output) -> None:
        if isinstance(item, bytes):
            self.pending += self.audio_out.encode(item)
            await self._write_frames(whole=True)
            return
        if isinstance(item, Interrupted):
            # AudioSocket has no "clear": stop sending, and never let the old answer's tail leak
            self._reset_output()
        elif isinstance(item, ResponseDone):
            if item.status == "completed":
                await self._write_frames(whole=False)  # the answer's last few ms, padded to a frame
            self._reset_output()
        log.debug("AudioSocket call %s: %s", self.call_uuid, item.type)
        self.server.publish(item)

    def _reset_output(self) -> None:
        self.pending.clear()
        self.audio_out.reset()

    async def _write_frames(self, whole: bool) -> None:
        """Send `pending` as exact 20 ms frames (a partial last one is zero-padded unless `whole`)."""
        size = frame_bytes(self.rate)
        if not whole and len(self.pending) % size:
            self.pending += bytes(size - len(self.pending) % size)
        n = len(self.pending) // size
        if n == 0 or self.writer.is_closing():
            return
        data = audio_messages(self.kind, bytes(self.pending[: n * size]), size)
        del self.pending[: n * size]
        self.writer.write(data)
        self.frames_out += n
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands as drain()
            # completes, and the runner's close() would then wait forever for its writer task
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                await self.writer.drain()
        except TimeoutError:
            log.warning(
                "AudioSocket call %s: peer has not read for %.1f s; dropping it",
                self.call_uuid,
                DRAIN_TIMEOUT_S,
            )
            self._ended("peer stopped reading")
            self.writer.transport.abort()  # ends the read loop too; the session is freed there
            raise PeerStuck("peer stopped reading") from None
