"""A Twilio Media Streams peer: Twilio's side of a bidirectional `<Connect><Stream>` call, simulated.

What it does, as Twilio does:

- connects (optionally with an `X-Twilio-Signature` computed from an auth token), sends `connected`
  and `start` (streamSid, callSid, mediaFormat mu-law 8 kHz, customParameters);
- streams the caller's microphone **continuously** from start to hang-up: 20 ms mu-law `media`
  messages (160 bytes, base64) paced on the wall clock, silence when the caller is not talking;
  `say()` puts speech into that stream. Network trouble is modelled with seeded random `jitter_s`
  (a late message delays the ones after it: one TCP stream) and `bunch_probability` (several frames
  held back and sent at once);
- plays what the server sends through a playback buffer in real time: media is played at 8 kHz in
  arrival order (after `playback_delay_s` of network/handset latency when the buffer was empty);
  each `mark` is echoed when the audio before it has been played; a `clear` drops the buffered
  audio and echoes the marks still pending at once;
- sends `dtmf` and `stop` on request, or drops the connection (`abort()`).

What it records, on the event loop's clock (`loop.time()`, the same clock as `time.monotonic()`):
the audio *played* to the caller with its times (`played_audio()`, `first_played_after()`), the
media received (`media`), every mark with its echo (`marks`), the clears (`clears`), and anything the
server sent that Twilio would reject (`protocol_errors`, which should stay empty).

    async with TwilioPeer("ws://127.0.0.1:8765/v1/twilio") as call:
        spoken = await call.say(question_16k)             # returns when the last frame has left
        answer = await call.wait_for_answer(after=spoken.end)
        onset = call.first_played_after(spoken.end) - spoken.end
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import hashlib
import hmac
import json
import logging
import random
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from codec.g711 import float_to_ulaw, ulaw_to_float
from codec.resample import resample

log = logging.getLogger("duplex.testing.twilio_sim")

RATE = 8000
FRAME = 160  # samples (and mu-law bytes) per 20 ms media message
FRAME_S = FRAME / RATE
LOUD_RMS = 0.02  # a 10 ms block above this is "audio" (not silence) in played-audio queries


@dataclass
class Utterance:
    """Speech put into the microphone stream; times are when it was spoken (nominal mic time)."""

    begin_sample: int  # in the microphone stream (8 kHz samples since start)
    end_sample: int
    start: float = 0.0  # loop time of its first sample
    end: float = 0.0  # loop time just after its last sample (the end of the question speech)
    sent_at: float | None = None  # loop time the media message holding its last sample left
    sent: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class PlayedChunk:
    """One media message as played: `audio` (8 kHz float32) starts playing at loop time `start`."""

    start: float
    audio: np.ndarray
    arrived: float

    @property
    def end(self) -> float:
        return self.start + len(self.audio) / RATE


@dataclass
class MarkRecord:
    name: str
    arrived: float  # when the server's mark arrived
    due: float  # when the audio before it will have played
    echoed_at: float | None = None
    cleared: bool = False  # echoed early because a clear dropped the audio before it


def twilio_signature(auth_token: str, url: str) -> str:
    """What Twilio puts in X-Twilio-Signature for a WebSocket: Base64(HMAC-SHA1(token, wss URL))."""
    return base64.b64encode(hmac.new(auth_token.encode(), url.encode(), hashlib.sha1).digest()).decode()


class TwilioPeer:
    """Twilio's side of one bidirectional Media Stream (see the module docstring).

    `signature_url`: the URL to sign (default: `url` with ws:// -> wss://, as a TLS proxy in front
    of the server would present it). `signature`: send this exact header value instead (tests).
    `auto_start`: send `connected` + `start` on entering (False: call `start()` yourself, e.g. to
    send something else first). `stream_audio=False`: no microphone stream at all, only the
    messages you send (tests of malformed input; real Twilio always streams).
    """

    def __init__(
        self,
        url: str,
        *,
        auth_token: str | None = None,
        signature_url: str | None = None,
        signature: str | None = None,
        stream_sid: str | None = None,
        call_sid: str | None = None,
        account_sid: str | None = None,
        custom_parameters: dict[str, str] | None = None,
        media_format: dict[str, Any] | None = None,
        jitter_s: float = 0.0,
        bunch_probability: float = 0.0,
        max_bunch: int = 4,
        playback_delay_s: float = 0.0,
        seed: int = 0,
        auto_start: bool = True,
        stream_audio: bool = True,
    ) -> None:
        self.url = url
        self._rng = random.Random(seed)
        self.stream_sid = stream_sid or "MZ" + self._hex(32)
        self.call_sid = call_sid or "CA" + self._hex(32)
        self.account_sid = account_sid or "AC" + self._hex(32)
        self.custom_parameters = dict(custom_parameters or {})
        self.media_format = media_format or {"encoding": "audio/x-mulaw", "sampleRate": RATE, "channels": 1}
        self.jitter_s = jitter_s
        self.bunch_probability = bunch_probability
        self.max_bunch = max(2, max_bunch)
        self.playback_delay_s = playback_delay_s
        self.auto_start = auto_start
        self.stream_audio = stream_audio
        self._signature = signature
        if signature is None and auth_token is not None:
            self._signature = twilio_signature(auth_token, signature_url or _as_wss(url))
        self.ws: ClientConnection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._send_lock = asyncio.Lock()
        self._seq = 0
        # microphone
        self.t0 = 0.0  # loop time the microphone stream started (sample 0)
        self._mic = np.zeros(0, np.float32)  # queued speech, from sample `_mic_pos` on
        self._mic_pos = 0  # samples of the stream already packetised
        self._utterances: list[Utterance] = []
        self.frames_sent = 0
        self.send_times: list[float] = []  # when each media message left (jitter / bunching show here)
        # playback
        self.chunks: list[PlayedChunk] = []  # scheduled, possibly cut by a clear
        self._play_end = 0.0
        self._pending_marks: list[MarkRecord] = []
        self._mark_wake = asyncio.Event()
        # records
        self.media: list[tuple[float, int]] = []  # (arrival time, payload bytes) of every media message
        self.marks: list[MarkRecord] = []
        self.clears: list[float] = []
        self.dropped_samples = 0  # buffered audio a clear dropped (never played)
        self.protocol_errors: list[str] = []
        self.closed: asyncio.Event = asyncio.Event()
        self.close_code: int | None = None
        self.stopped = False

    def _hex(self, n: int) -> str:
        return "".join(self._rng.choice("0123456789abcdef") for _ in range(n))

    # -- connection --------------------------------------------------------------------------

    async def __aenter__(self) -> TwilioPeer:
        await self.connect()
        if self.auto_start:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.stopped and not self.closed.is_set():
            with contextlib.suppress(Exception):
                await self.stop()
        await self.close()

    async def connect(self) -> None:
        """Open the WebSocket (raises websockets' InvalidStatus on e.g. 403) and start receiving."""
        self._loop = asyncio.get_running_loop()
        headers = {"X-Twilio-Signature": self._signature} if self._signature is not None else {}
        self.ws = await connect(
            self.url,
            additional_headers=headers,
            compression=None,
            user_agent_header="duplex-twilio-peer",
            open_timeout=10,
        )
        self._tasks.append(asyncio.create_task(self._receiver(), name="twilio-peer-rx"))
        self._tasks.append(asyncio.create_task(self._echoer(), name="twilio-peer-marks"))

    async def start(self) -> None:
        """`connected`, `start`, then the microphone stream begins (silence until `say`)."""
        await self.send_json({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await self.send_json(
            {
                "event": "start",
                "sequenceNumber": self._next_seq(),
                "streamSid": self.stream_sid,
                "start": {
                    "accountSid": self.account_sid,
                    "streamSid": self.stream_sid,
                    "callSid": self.call_sid,
                    "tracks": ["inbound"],
                    "mediaFormat": self.media_format,
                    "customParameters": self.custom_parameters,
                },
            },
            numbered=False,
        )
        self.t0 = self._now()
        if self.stream_audio:
            self._tasks.append(asyncio.create_task(self._microphone(), name="twilio-peer-mic"))

    async def stop(self) -> None:
        """The caller hangs up: Twilio sends `stop` and closes the WebSocket."""
        self.stopped = True
        await self._cancel("twilio-peer-mic", "twilio-peer-marks")  # nothing follows a stop
        with contextlib.suppress(ConnectionClosed):
            await self.send_json(
                {
                    "event": "stop",
                    "sequenceNumber": self._next_seq(),
                    "streamSid": self.stream_sid,
                    "stop": {"accountSid": self.account_sid, "callSid": self.call_sid},
                },
                numbered=False,
            )
        if self.ws is not None:
            await self.ws.close()

    def abort(self) -> None:
        """The network goes away: no `stop`, no close handshake."""
        self.stopped = True
        if self.ws is not None:
            self.ws.transport.abort()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()

    # -- sending -------------------------------------------------------------------------------

    async def send_json(self, message: dict[str, Any], numbered: bool = False) -> None:
        """Send one message (`numbered`: add the next sequenceNumber, as Twilio numbers them)."""
        if numbered:
            message = {**message, "sequenceNumber": self._next_seq()}
        await self.send_raw(json.dumps(message))

    async def send_raw(self, data: str | bytes) -> None:
        """Send anything at all (tests of malformed input)."""
        assert self.ws is not None, "connect() first"
        async with self._send_lock:
            await self.ws.send(data)

    async def send_dtmf(self, digit: str) -> None:
        await self.send_json(
            {
                "event": "dtmf",
                "streamSid": self.stream_sid,
                "dtmf": {"track": "inbound_track", "digit": digit},
            },
            numbered=True,
        )

    def _next_seq(self) -> str:
        self._seq += 1
        return str(self._seq)

    # -- microphone ----------------------------------------------------------------------------

    def say_nowait(self, audio: np.ndarray, rate: int = 16000) -> Utterance:
        """Queue speech (float32 at `rate`) right after what is queued; the mic sends it in real time."""
        x = np.asarray(audio, dtype=np.float32).reshape(-1)
        if rate != RATE:
            x = resample(x, rate, RATE)
        begin = self._mic_pos + len(self._mic)
        self._mic = np.concatenate([self._mic, x])
        utt = Utterance(begin, begin + len(x))
        utt.start = self.t0 + begin / RATE
        utt.end = self.t0 + utt.end_sample / RATE
        self._utterances.append(utt)
        return utt

    async def say(self, audio: np.ndarray, rate: int = 16000) -> Utterance:
        """Speak `audio` into the call; returns once its last media message has been sent.

        `Utterance.end` is when the last sample of `audio` was spoken: trim trailing silence first
        when it should mean the end of the speech (e.g. to measure onset latency)."""
        utt = self.say_nowait(audio, rate)
        await utt.sent.wait()
        return utt

    async def _microphone(self) -> None:
        """20 ms frames from t0 on, forever; each leaves at its nominal end time plus network delay."""
        last_send = self.t0
        i = 0
        while True:
            bunch = self._rng.randint(2, self.max_bunch) if self._rng.random() < self.bunch_probability else 1
            frames = [self._mic_frame() for _ in range(bunch)]
            due = (
                self.t0
                + (i + bunch) * FRAME_S
                + (self._rng.uniform(0, self.jitter_s) if self.jitter_s else 0.0)
            )
            last_send = max(last_send, due)
            await asyncio.sleep(max(0.0, last_send - self._now()))
            for frame in frames:
                await self._send_frame(i, frame)
                i += 1
            self._mark_utterances_sent()

    def _mic_frame(self) -> np.ndarray:
        frame = np.zeros(FRAME, np.float32)
        take = min(FRAME, len(self._mic))
        frame[:take] = self._mic[:take]
        self._mic = self._mic[take:]
        self._mic_pos += FRAME
        return frame

    async def _send_frame(self, index: int, frame: np.ndarray) -> None:
        await self.send_json(
            {
                "event": "media",
                "streamSid": self.stream_sid,
                "media": {
                    "track": "inbound",
                    "chunk": str(index + 1),
                    "timestamp": str(index * 20),
                    "payload": base64.b64encode(float_to_ulaw(frame)).decode(),
                },
            },
            numbered=True,
        )
        self.frames_sent += 1
        self.send_times.append(self._now())

    def _mark_utterances_sent(self) -> None:
        sent_until = self.frames_sent * FRAME
        now = self._now()
        for utt in self._utterances:
            if not utt.sent.is_set() and utt.end_sample <= sent_until:
                utt.sent_at = now
                utt.sent.set()

    async def _cancel(self, *names: str) -> None:
        for task in [t for t in self._tasks if t.get_name() in names]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- receiving and playback ----------------------------------------------------------------

    async def _receiver(self) -> None:
        assert self.ws is not None
        try:
            async for message in self.ws:
                await self._on_message(message, self._now())
        except ConnectionClosed:
            pass
        finally:
            self.close_code = self.ws.close_code
            self.closed.set()
            self._mark_wake.set()

    async def _on_message(self, message: str | bytes, now: float) -> None:
        if isinstance(message, bytes):
            self.protocol_errors.append(f"binary frame of {len(message)} bytes")
            return
        try:
            event = json.loads(message)
        except json.JSONDecodeError:
            self.protocol_errors.append(f"malformed JSON: {message[:60]!r}")
            return
        kind = event.get("event") if isinstance(event, dict) else None
        if kind not in ("media", "mark", "clear"):
            self.protocol_errors.append(f"unsupported message {message[:60]!r}")
            return
        if event.get("streamSid") != self.stream_sid:
            self.protocol_errors.append(f"{kind} for streamSid {event.get('streamSid')!r}")
            return
        if kind == "media":
            self._on_media(event, now)
        elif kind == "mark":
            self._on_mark(event, now)
        else:
            await self._on_clear(now)

    def _on_media(self, event: dict[str, Any], now: float) -> None:
        try:
            payload = base64.b64decode(event["media"]["payload"], validate=True)
        except (KeyError, TypeError, ValueError):
            self.protocol_errors.append("media without a valid base64 payload")
            return
        self.media.append((now, len(payload)))
        start = max(now + self.playback_delay_s, self._play_end)
        chunk = PlayedChunk(start, ulaw_to_float(payload), now)
        self.chunks.append(chunk)
        self._play_end = chunk.end

    def _on_mark(self, event: dict[str, Any], now: float) -> None:
        name = (event.get("mark") or {}).get("name") if isinstance(event.get("mark"), dict) else None
        if not isinstance(name, str):
            self.protocol_errors.append("mark without a name")
            return
        rec = MarkRecord(name, now, max(now, self._play_end))
        self.marks.append(rec)
        self._pending_marks.append(rec)
        self._mark_wake.set()

    async def _on_clear(self, now: float) -> None:
        self.clears.append(now)
        kept: list[PlayedChunk] = []
        for chunk in self.chunks:
            if chunk.start >= now:
                self.dropped_samples += len(chunk.audio)
                continue
            if chunk.end > now:
                keep = int(round((now - chunk.start) * RATE))
                self.dropped_samples += len(chunk.audio) - keep
                chunk.audio = chunk.audio[:keep]
            kept.append(chunk)
        self.chunks = kept
        self._play_end = min(self._play_end, now)
        pending, self._pending_marks = self._pending_marks, []
        for rec in pending:
            rec.cleared = True
            await self._echo(rec)

    async def _echoer(self) -> None:
        """Echo each mark when playback reaches it (in order; a clear echoes the rest at once)."""
        while True:
            if not self._pending_marks:
                self._mark_wake.clear()
                await self._mark_wake.wait()
                if self.closed.is_set():
                    return
                continue
            rec = self._pending_marks[0]
            wait = rec.due - self._now()
            if wait > 0:
                self._mark_wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._mark_wake.wait(), wait)
                continue  # a clear may have echoed it meanwhile
            self._pending_marks.pop(0)
            await self._echo(rec)

    async def _echo(self, rec: MarkRecord) -> None:
        if self.stopped:
            return  # Twilio sends nothing after `stop`
        rec.echoed_at = self._now()
        with contextlib.suppress(ConnectionClosed):
            await self.send_json(
                {"event": "mark", "streamSid": self.stream_sid, "mark": {"name": rec.name}}, numbered=True
            )

    # -- what the caller heard -----------------------------------------------------------------

    def played_chunks(self, until: float | None = None, since: float | None = None) -> list[PlayedChunk]:
        """The audio played by `until` (default: now), each chunk cut where playback was then;
        only chunks still playing after `since` (default: all)."""
        until = self._now() if until is None else until
        first = 0 if since is None else bisect.bisect_right(self.chunks, since, key=lambda c: c.end)  # sorted
        out = []
        for chunk in self.chunks[first:]:
            if chunk.start >= until:
                break
            keep = min(len(chunk.audio), int(round((until - chunk.start) * RATE)))
            out.append(PlayedChunk(chunk.start, chunk.audio[:keep], chunk.arrived))
        return out

    def played_audio(self, t0: float | None = None, t1: float | None = None) -> np.ndarray:
        """What the caller heard between loop times t0 and t1 (default: first played sample .. now),
        as one 8 kHz float32 signal with silence where nothing played."""
        chunks = self.played_chunks(t1, since=t0)
        if not chunks:
            return np.zeros(0, np.float32)
        t0 = chunks[0].start if t0 is None else t0
        t1 = max(c.end for c in chunks) if t1 is None else t1
        out = np.zeros(max(0, int(round((t1 - t0) * RATE))), np.float32)
        for chunk in chunks:
            at = int(round((chunk.start - t0) * RATE))
            lo, hi = max(at, 0), min(at + len(chunk.audio), len(out))
            if hi > lo:
                out[lo:hi] = chunk.audio[lo - at : hi - at]
        return out

    def first_played_after(self, t: float, threshold: float = LOUD_RMS) -> float | None:
        """Loop time at which the first non-silent 10 ms of played audio after `t` started."""
        block = RATE // 100
        for chunk in self.played_chunks(since=t):
            for k in range(0, len(chunk.audio) - block + 1, block):
                at = chunk.start + k / RATE
                if at >= t and float(np.sqrt(np.mean(chunk.audio[k : k + block] ** 2))) > threshold:
                    return at
        return None

    def loud_seconds(self, t0: float, t1: float, threshold: float = LOUD_RMS) -> float:
        """Seconds of non-silent audio played between t0 and t1 (10 ms resolution)."""
        x = self.played_audio(t0, t1)
        block = RATE // 100
        n = len(x) // block
        if n == 0:
            return 0.0
        rms = np.sqrt((x[: n * block].reshape(n, block) ** 2).mean(axis=1))
        return float((rms > threshold).sum()) / 100

    @property
    def play_end(self) -> float:
        """Loop time at which the playback buffer runs dry."""
        return self._play_end

    # -- waiting -------------------------------------------------------------------------------

    async def wait_for(self, predicate: Callable[[], Any], limit_s: float = 10.0, poll: float = 0.01) -> None:
        """Until `predicate()` is true (TimeoutError after `limit_s`).

        Polls: what a test waits for usually depends on time passing (audio *playing*), not on a
        message arriving, so there is no event to wait on."""
        async with asyncio.timeout(limit_s):
            while True:
                if predicate():
                    return
                await asyncio.sleep(poll)

    async def wait_for_answer(
        self, after: float | None = None, quiet_s: float = 0.6, limit_s: float = 15.0
    ) -> np.ndarray:
        """Wait until audio has played after `after` (default: the end of the last utterance) and
        playback then stayed idle for `quiet_s`; returns what was played from the answer's start."""
        if after is None:
            after = self._utterances[-1].end if self._utterances else self.t0

        def done() -> bool:
            now = self._now()
            started = bool(self.chunks) and self.chunks[-1].end > after  # chunks are in time order
            last_media = self.media[-1][0] if self.media else 0.0
            return started and now - self._play_end >= quiet_s and now - last_media >= quiet_s

        await self.wait_for(done, limit_s)
        first = next(c.start for c in self.chunks if c.end > after)
        return self.played_audio(max(first, after), self._play_end)

    async def wait_for_clear(self, count: int = 1, limit_s: float = 10.0) -> float:
        """Loop time of the `count`-th clear."""
        await self.wait_for(lambda: len(self.clears) >= count, limit_s)
        return self.clears[count - 1]

    def _now(self) -> float:
        loop = self._loop or asyncio.get_running_loop()
        return loop.time()


def _as_wss(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    scheme = {"ws": "wss", "http": "https"}.get(parts.scheme, parts.scheme)
    return urllib.parse.urlunsplit(parts._replace(scheme=scheme))
