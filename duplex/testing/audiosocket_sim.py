"""A faithful Asterisk AudioSocket peer: it calls our AudioSocket server the way Asterisk does.

What it copies from Asterisk (apps/app_audiosocket.c, res/res_audiosocket.c):

- it connects out over TCP and sends the call UUID (0x01, 16 binary bytes) before anything else;
- it streams the caller's audio as 20 ms slin frames (0x10: 320 bytes at 8 kHz; 0x11.. for the
  newer slin12/16/.. formats of the channel driver) *continuously*, silence included, because the
  channel delivers a frame every 20 ms whether the caller speaks or not; keypad digits are 0x03;
- frames leave when their 20 ms have been captured, delayed by network jitter and sometimes held
  back and released in bunches (seeded, so a run is reproducible);
- audio from the server is written to the channel the moment it arrives (Asterisk has no playout
  buffer of its own): we model the far end as a FIFO that plays in real time and drops a frame
  when more than `playback_buffer_ms` is already queued (the phone's jitter buffer overflowing);
- a server message that is neither audio nor hangup, or an empty audio message, makes Asterisk
  log an error and hang up: we record it in `protocol_errors` and close too;
- a caller hanging up closes the socket (Asterisk does not send 0x00); `hangup(terminate=True)`
  sends 0x00 first, `abort()` resets the connection.

The wire format is implemented here again, independently of `duplex.transports.audiosocket_protocol`, so a framing
bug on the server side cannot hide behind shared code.

Usage::

    async with AudioSocketPeer("127.0.0.1", 9092, call_uuid) as call:
        said = await call.say(question_16k)                    # returns when its last frame was sent
        heard = await call.wait_for_answer(quiet_s=0.6)        # float32 at the call rate (8 kHz)
        onset = call.first_played_after(said.end) - said.end   # first answer audio heard

All times are `loop.time()` of the running event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import socket
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import numpy as np

from codec.pcm import float_to_pcm16, pcm16_to_float
from codec.resample import resample

KIND_HANGUP = 0x00
KIND_UUID = 0x01
KIND_DTMF = 0x03
KIND_ERROR = 0xFF
RATE_KINDS = {
    8000: 0x10,
    12000: 0x11,
    16000: 0x12,
    24000: 0x13,
    32000: 0x14,
    44100: 0x15,
    48000: 0x16,
    96000: 0x17,
    192000: 0x18,
}
KIND_RATES = {kind: rate for rate, kind in RATE_KINDS.items()}
FRAME_S = 0.02
LOUD_RMS = 0.02  # a 10 ms block above this is answer audio, not silence (as in duplex.testing.twilio_sim)


def message(kind: int, payload: bytes = b"") -> bytes:
    """One AudioSocket message: type byte, big-endian uint16 length, payload (for malformed tests too)."""
    return struct.pack("!BH", kind, len(payload)) + payload


@dataclass(frozen=True)
class PlayedFrame:
    """One audio message from the server and when the simulated far end played it."""

    received: float  # loop time it arrived
    start: float  # loop time its playback started (after what was queued before it)
    pcm: bytes  # PCM16 little-endian, as received
    rate: int

    @property
    def duration(self) -> float:
        return len(self.pcm) // 2 / self.rate

    @property
    def end(self) -> float:
        return self.start + self.duration

    def rms(self) -> float:
        x = pcm16_to_float(self.pcm[: len(self.pcm) // 2 * 2])
        return float(np.sqrt(np.mean(x**2))) if x.size else 0.0


@dataclass(frozen=True)
class Said:
    """When an utterance went out: first and last frame carrying it (loop time at sending)."""

    start: float
    end: float


@dataclass
class _Utterance:
    first_byte: int  # position in the speech byte stream
    end_byte: int
    done: asyncio.Future[Said]
    start: float | None = None


class AudioSocketPeer:
    """An Asterisk channel running `AudioSocket(uuid,host:port)`, simulated.

    rate: the call's slin rate (8000 like the dialplan application; 16000 etc. like the channel
    driver with a wideband codec). jitter_ms: each frame leaves up to this much late (uniform).
    bunching: probability that a frame starts a bunch of 2..max_bunch frames sent back to back
    when the last is due. send_silence: stream silence between utterances (False: like DTX).
    send_uuid: False to misbehave (no UUID first). recv_buffer_bytes: small socket and reader
    buffers, so `stop_reading()` makes the server's writes block soon.
    """

    def __init__(
        self,
        host: str,
        port: int,
        call_uuid: uuid.UUID | str | None = None,
        *,
        rate: int = 8000,
        jitter_ms: float = 0.0,
        bunching: float = 0.0,
        max_bunch: int = 4,
        seed: int = 0,
        playback_buffer_ms: float = 500.0,
        send_silence: bool = True,
        send_uuid: bool = True,
        recv_buffer_bytes: int | None = None,
    ) -> None:
        if rate not in RATE_KINDS:
            raise ValueError(f"AudioSocket has no slin format at {rate} Hz; use one of {sorted(RATE_KINDS)}")
        self.host, self.port = host, port
        self.call_uuid = uuid.UUID(str(call_uuid)) if call_uuid is not None else uuid.uuid4()
        self.rate = rate
        self.kind = RATE_KINDS[rate]
        self.frame_bytes = int(rate * FRAME_S) * 2
        self.jitter_ms = jitter_ms
        self.bunching = bunching
        self.max_bunch = max(2, max_bunch)
        self.playback_buffer_s = playback_buffer_ms / 1000.0
        self.send_silence = send_silence
        self.send_uuid = send_uuid
        self.recv_buffer_bytes = recv_buffer_bytes
        self._rng = random.Random(seed)
        # what happened
        self.frames: list[PlayedFrame] = []  # played (or playing) server audio, in order
        self.dropped_frames = 0  # far-end buffer overflow
        self.protocol_errors: list[str] = []  # server messages Asterisk would refuse
        self.closed_by: str | None = None  # server-hangup, server-eof, reset, protocol-error, local
        self.sent_frames = 0
        # internals
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._speech = bytearray()  # queued caller audio (PCM16 at `rate`)
        self._speech_sent = 0  # bytes of speech sent so far
        self._speech_queued = 0  # bytes of speech ever queued
        self._utterances: list[_Utterance] = []
        self._last_said_end = -math.inf
        self._play_end = -math.inf
        self._changed = asyncio.Event()  # set on every new frame and at the end of the call
        self._closed = asyncio.Event()

    # -- connection ------------------------------------------------------------------------

    async def __aenter__(self) -> AudioSocketPeer:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect like Asterisk: TCP_NODELAY, UUID first, then a frame every 20 ms."""
        self._reader, self._writer = await self._open()
        sock = self._writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.send_uuid:
            self._writer.write(message(KIND_UUID, self.call_uuid.bytes))
        self._tasks = [
            asyncio.create_task(self._send_loop(), name=f"audiosocket-peer-send-{self.call_uuid}"),
            asyncio.create_task(self._recv_loop(), name=f"audiosocket-peer-recv-{self.call_uuid}"),
        ]

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.recv_buffer_bytes is None:
            return await asyncio.open_connection(self.host, self.port)
        loop = asyncio.get_running_loop()
        family, type_, proto, _, addr = (
            await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        )[0]
        sock = socket.socket(family, type_, proto)
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVBUF, self.recv_buffer_bytes
        )  # before connect: the window
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock, limit=max(1024, self.recv_buffer_bytes // 2))

    async def close(self) -> None:
        """End the call from our side if it is still up (the caller hangs up) and stop the tasks."""
        if self.closed_by is None:
            await self.hangup()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def is_closed(self) -> bool:
        return self.closed_by is not None

    async def wait_closed(self, limit_s: float = 10.0) -> str:
        """Until the call ended (either side); returns `closed_by`."""
        async with asyncio.timeout(limit_s):
            await self._closed.wait()
        assert self.closed_by is not None
        return self.closed_by

    # -- the caller's side -----------------------------------------------------------------

    async def say(self, audio: np.ndarray, rate: int = 16000) -> Said:
        """Speak float32 `audio` (at `rate`) into the call; returns once its last frame was sent.

        `Said.end` is then the end of the speech as the server saw it arrive: trim trailing silence
        first when it should mean the end of the question (e.g. to measure onset latency)."""
        said = await self.say_nowait(audio, rate)
        self._last_said_end = said.end
        return said

    def say_nowait(self, audio: np.ndarray, rate: int = 16000) -> asyncio.Future[Said]:
        """Queue speech after what is queued (e.g. to talk over an answer); the future resolves
        when its last frame was sent (ConnectionError if the call ends first)."""
        if self.is_closed:
            raise ConnectionError(f"call ended ({self.closed_by})")
        x = np.asarray(audio, dtype=np.float32).reshape(-1)
        if rate != self.rate:
            x = resample(x, rate, self.rate)
        pcm = float_to_pcm16(x)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Said] = loop.create_future()
        if not pcm:
            done.set_result(Said(loop.time(), loop.time()))
            return done
        self._utterances.append(_Utterance(self._speech_queued, self._speech_queued + len(pcm), done))
        self._speech += pcm
        self._speech_queued += len(pcm)
        return done

    async def pause(self, seconds: float) -> None:
        """Say nothing for a while (silence frames keep flowing, as on a real call)."""
        await asyncio.sleep(seconds)

    async def dtmf(self, digit: str) -> None:
        """A keypad digit, as Asterisk forwards it (0x03, one ASCII byte), between audio frames."""
        await self.send_raw(message(KIND_DTMF, digit.encode("ascii")))

    async def send_error(self, code: int | None = 0x02) -> None:
        """An error message (0xff) with Asterisk's bit-packed code (None: no payload)."""
        await self.send_raw(message(KIND_ERROR, b"" if code is None else bytes((code,))))

    async def send_raw(self, data: bytes) -> None:
        """Any bytes, e.g. malformed messages built with `message()`."""
        assert self._writer is not None, "not connected"
        self._writer.write(data)
        await self._writer.drain()

    async def send_truncated(self, kind: int = RATE_KINDS[8000], length: int = 320, sent: int = 100) -> None:
        """A header promising `length` bytes, only `sent` of them, then the connection closes (EOF)."""
        await self.send_raw(struct.pack("!BH", kind, length) + bytes(sent))
        await self._shutdown("local")

    async def hangup(self, terminate: bool = False) -> None:
        """The caller hangs up: Asterisk closes the socket; `terminate` sends 0x00 before."""
        if self.closed_by is not None:
            return
        if terminate and self._writer is not None:
            with contextlib.suppress(ConnectionError):
                await self.send_raw(message(KIND_HANGUP))
        await self._shutdown("local")

    def abort(self) -> None:
        """The connection breaks (RST, no FIN): e.g. Asterisk crashed or the network went away."""
        if self._writer is None or self.closed_by is not None:
            return
        sock = self._writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._writer.transport.abort()
        self._mark_closed("local")
        for task in self._tasks:
            task.cancel()

    def stop_reading(self) -> None:
        """A stuck Asterisk: stop reading the socket (audio keeps being sent)."""
        for task in self._tasks:
            if task.get_name().startswith("audiosocket-peer-recv"):
                task.cancel()

    # -- what the caller heard -------------------------------------------------------------

    def played_audio(self, t0: float | None = None, t1: float | None = None) -> np.ndarray:
        """What the caller heard between loop times t0 and t1 (default: first played sample .. now),
        as one float32 signal at the call rate with silence where nothing played."""
        now = asyncio.get_running_loop().time()
        frames = [f for f in self.frames if f.start < now]
        if not frames:
            return np.zeros(0, dtype=np.float32)
        t0 = frames[0].start if t0 is None else t0
        t1 = min(now, max(f.end for f in frames)) if t1 is None else min(t1, now)
        out = np.zeros(max(0, round((t1 - t0) * self.rate)), dtype=np.float32)
        for f in frames:
            at = round((f.start - t0) * self.rate)
            audio = pcm16_to_float(f.pcm[: len(f.pcm) // 2 * 2])
            lo, hi = max(at, 0), min(at + len(audio), len(out))
            if hi > lo:
                out[lo:hi] = audio[lo - at : hi - at]
        return out

    def first_played_after(self, t: float, threshold: float = LOUD_RMS) -> float | None:
        """Loop time at which the first non-silent 10 ms of audio played at or after `t` started
        (onset of an answer: `first_played_after(said.end) - said.end`)."""
        block = self.rate // 100
        for f in self.frames:
            if f.end <= t:
                continue
            audio = pcm16_to_float(f.pcm[: len(f.pcm) // 2 * 2])
            for k in range(0, len(audio) - block + 1, block):
                at = f.start + k / self.rate
                if at >= t and float(np.sqrt(np.mean(audio[k : k + block] ** 2))) > threshold:
                    return at
        return None

    async def wait_audio(self, after: float = -math.inf, limit_s: float = 10.0) -> PlayedFrame:
        """Until a server audio frame arrives at or after `after`; returns it."""

        def found() -> PlayedFrame | None:
            return next((f for f in self.frames if f.received >= after), None)

        await self._wait(lambda: found() is not None or self.is_closed, limit_s)
        frame = found()
        if frame is None:
            raise ConnectionError(f"call ended ({self.closed_by}) before any audio")
        return frame

    async def wait_quiet(self, quiet_s: float = 0.5, limit_s: float = 15.0) -> None:
        """Until, from now on, nothing has played or arrived for `quiet_s`, or the call ended.

        Right after a question the answer has not started yet: `wait_audio()` first."""
        loop = asyncio.get_running_loop()
        since = loop.time()
        async with asyncio.timeout(limit_s):
            while not self.is_closed:
                last = max(since, self._play_end, self.frames[-1].received if self.frames else since)
                idle = loop.time() - last
                if idle >= quiet_s:
                    return
                await asyncio.sleep(quiet_s - idle)

    async def wait_for_answer(
        self, after: float | None = None, quiet_s: float = 0.6, limit_s: float = 15.0
    ) -> np.ndarray:
        """Until audio arrived after `after` (default: the end of the last `say()`) and then nothing
        played for `quiet_s`; returns what was heard from `after` on."""
        after = self._last_said_end if after is None else after
        await self.wait_audio(after=after, limit_s=limit_s)
        await self.wait_quiet(quiet_s, limit_s)
        return self.played_audio(t0=after)

    async def _wait(self, predicate: Callable[[], bool], limit_s: float) -> None:
        async with asyncio.timeout(limit_s):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

    # -- internals: sending ----------------------------------------------------------------

    async def _send_loop(self) -> None:
        """A frame per 20 ms of captured audio, late by jitter, sometimes in bunches; no drift."""
        loop = asyncio.get_running_loop()
        assert self._writer is not None
        t0 = loop.time()
        i = 0
        try:
            while True:
                k = self._rng.randint(2, self.max_bunch) if self._rng.random() < self.bunching else 1
                due = t0 + (i + k) * FRAME_S + self._rng.uniform(0.0, self.jitter_ms / 1000.0)
                await asyncio.sleep(max(0.0, due - loop.time()))
                data = b"".join(self._next_frames(k))
                i += k
                if not data:
                    continue
                self._writer.write(data)
                await self._writer.drain()
                self._speech_progress(loop.time())
        except (ConnectionError, OSError):
            # the receive side knows better why (a 0x00 or EOF may still be in its buffer)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await self._closed.wait()
            await self._shutdown("reset")

    def _next_frames(self, k: int) -> list[bytes]:
        frames = []
        for _ in range(k):
            if self._speech:
                chunk = bytes(self._speech[: self.frame_bytes])
                del self._speech[: self.frame_bytes]
                self._speech_sent += len(chunk)
                chunk += bytes(self.frame_bytes - len(chunk))
            elif self.send_silence:
                chunk = bytes(self.frame_bytes)
            else:
                continue
            frames.append(message(self.kind, chunk))
            self.sent_frames += 1
        return frames

    def _speech_progress(self, now: float) -> None:
        """Resolve `say()` calls whose audio has now gone out entirely."""
        for utt in list(self._utterances):
            if utt.start is None and self._speech_sent > utt.first_byte:
                utt.start = now
            if self._speech_sent >= utt.end_byte:
                self._utterances.remove(utt)
                if not utt.done.done():
                    utt.done.set_result(Said(utt.start if utt.start is not None else now, now))

    # -- internals: receiving (mirrors ast_audiosocket_receive_frame) ------------------------

    async def _recv_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                try:
                    header = await self._reader.readexactly(3)
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        self.protocol_errors.append("truncated header from the server")
                    await self._shutdown("server-eof")
                    return
                kind, length = struct.unpack("!BH", header)
                if kind == KIND_HANGUP:
                    await self._shutdown("server-hangup")
                    return
                if kind not in KIND_RATES or length < 1:
                    self.protocol_errors.append(
                        f"server sent type 0x{kind:02x} length {length}: Asterisk hangs up"
                    )
                    await self._shutdown("protocol-error")
                    return
                try:
                    payload = await self._reader.readexactly(length)
                except asyncio.IncompleteReadError:
                    self.protocol_errors.append("insufficient payload read from the server")
                    await self._shutdown("protocol-error")
                    return
                self._play(kind, payload)
        except (ConnectionError, OSError):
            await self._shutdown("reset")

    def _play(self, kind: int, payload: bytes) -> None:
        rate = KIND_RATES[kind]
        if rate != self.rate:
            self.protocol_errors.append(f"audio at {rate} Hz on a {self.rate} Hz call")
        if len(payload) % 2:
            self.protocol_errors.append(f"audio message of {len(payload)} bytes (odd)")
        now = asyncio.get_running_loop().time()
        start = max(now, self._play_end)
        if start - now > self.playback_buffer_s:
            self.dropped_frames += 1
            return
        frame = PlayedFrame(received=now, start=start, pcm=payload, rate=rate)
        self.frames.append(frame)
        self._play_end = frame.end
        self._changed.set()

    async def _shutdown(self, by: str) -> None:
        """Close our side once (Asterisk closes the socket whenever the call ends, whoever ended it)."""
        if self.closed_by is not None:
            return
        self._mark_closed(by)
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self._writer.wait_closed()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    def _mark_closed(self, by: str) -> None:
        self.closed_by = by
        self._closed.set()
        self._changed.set()
        for utt in self._utterances:
            if not utt.done.done():
                utt.done.set_exception(ConnectionError(f"call ended ({by}) before the utterance was sent"))
        self._utterances.clear()
