"""Live mode (the default): the microphone to the server, the answers through the loudspeaker, the
transcript and per-turn latency in the terminal:

    mic (device rate) -> 16 kHz -> echo canceller -> PCM16 -> WebSocket
    WebSocket -> 24 kHz PCM16 -> device rate -> jitter buffer -> speaker -> (echo reference)

The client's own duties are real-time pacing, playing answers promptly, dropping queued audio at
once on `response.interrupted`, and keeping its own loudspeaker out of its microphone
(echo_path.py): without that the server hears the bot, takes it for the user, and the bot
interrupts itself."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from clients.talk.capture import Capture
from clients.talk.connection import closed_why, open_session
from clients.talk.conversation import Conversation
from clients.talk.devices import query_device
from clients.talk.echo_path import EchoPath
from clients.talk.errors import TalkError
from clients.talk.playback import Player
from clients.talk.screen import Screen
from clients.talk.wire import DEFAULT_SERVER, FRAME_S, SEND_RATE, parse_event
from codec.pcm import float_to_pcm16, pcm16_to_float
from codec.resample import StreamingResampler

ECHO_MODES = ("aec", "suppress", "off")


class LiveTalk:
    """Live mode: see the module docstring. `sd` is the sounddevice module (or a test's fake)."""

    def __init__(
        self,
        sd: Any,
        *,
        url: str = DEFAULT_SERVER,
        options: dict[str, Any] | None = None,
        echo: str = "aec",
        input_device: int | str | None = None,
        output_device: int | str | None = None,
        screen: Screen | None = None,
        prebuffer_s: float = 0.06,
        report_every_s: float = 0.25,
    ) -> None:
        if echo not in ECHO_MODES:
            raise TalkError(f"--echo must be one of {', '.join(ECHO_MODES)}, got {echo!r}")
        self.sd = sd
        self.url = url
        self.options = options or {}
        self.echo_mode = echo
        self.input_device = input_device
        self.output_device = output_device
        self.screen = screen or Screen()
        self.prebuffer_s = prebuffer_s
        self.report_every_s = report_every_s
        self.echo: EchoPath | None = None
        self.capture: Capture | None = None
        self.player: Player | None = None
        self.conversation: Conversation | None = None
        self._stop = asyncio.Event()
        self._out_resampler: StreamingResampler | None = None
        self._out_state: Any = None

    def stop(self) -> None:
        """Finish: Ctrl-C calls this."""
        self._stop.set()

    async def run(self) -> int:
        sd = self.sd
        in_dev, in_name, in_rate = query_device(sd, self.input_device, "input")
        out_dev, out_name, out_rate = query_device(sd, self.output_device, "output")
        ws, started = await open_session(self.url, self.options)
        loop = asyncio.get_running_loop()
        server_rate = int(started.get("output_sample_rate", 24000))
        if self.echo_mode != "off":
            # the suppressor takes sound that passes for longer than a barge-in takes for echo
            barge_in_ms = float((started.get("options") or {}).get("barge_in_min_speech_ms", 96))
            self.echo = EchoPath(self.echo_mode, double_talk_ms=max(400.0, barge_in_ms + 300.0))
        self.capture = capture = Capture(loop, in_rate)
        self.player = player = Player(out_rate, self.prebuffer_s)
        self._out_resampler = StreamingResampler(server_rate, out_rate)
        self._out_state = self._out_resampler.init_state()
        self.conversation = conv = Conversation(self.screen, self._locate, self._flush)
        streams: list[Any] = []
        try:
            streams.append(
                self._open(sd.OutputStream, out_dev, out_name, "output", out_rate, player.callback)
            )
            streams.append(self._open(sd.InputStream, in_dev, in_name, "input", in_rate, capture.callback))
            player.latency, capture.latency = _latency(streams[0]), _latency(streams[1])
            for stream in streams:
                stream.start()
            self.screen.note(
                f"talking to {self.url}: mic {in_name} ({in_rate} Hz), speaker {out_name} "
                f"({out_rate} Hz), echo {self.echo_mode}. Ctrl-C to quit."
            )
            return await self._converse(ws, conv)
        finally:
            for stream in streams:  # stop the callbacks first: nothing may touch a closed loop
                with contextlib.suppress(Exception):
                    stream.stop()
                    stream.close()
            with contextlib.suppress(Exception):
                await ws.close()

    def _open(
        self, cls: Any, device: Any, name: str, kind: str, rate: int, callback: Callable[..., None]
    ) -> Any:
        try:
            return cls(
                samplerate=rate,
                blocksize=int(rate * FRAME_S),
                device=device,
                channels=1,
                dtype="float32",
                latency="low",
                callback=callback,
            )
        except (self.sd.PortAudioError, ValueError) as exc:
            raise TalkError(
                f"cannot open the {kind} device {name} at {rate} Hz ({exc}); see "
                f"`duplex talk --list-devices` and pick another with --{kind}-device"
            ) from None

    async def _converse(self, ws: Any, conv: Conversation) -> int:
        uplink = asyncio.create_task(self._uplink(ws, conv))
        downlink = asyncio.create_task(self._downlink(ws, conv))
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait({uplink, downlink, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            assert self.capture is not None
            self.capture.close()  # the uplink ends after the frame it is sending
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(uplink, 2.0)
            for task in (downlink, stop):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self._stop.is_set():
            self.screen.note("")
            return 0
        self.screen.note(f"duplex talk: the server closed the connection ({closed_why(ws)})")
        return 1

    async def _downlink(self, ws: Any, conv: Conversation) -> None:
        """Server -> speaker and screen."""
        assert self.player is not None and self._out_resampler is not None
        async for msg in ws:
            if isinstance(msg, bytes):
                if conv.audio_turn is not None:  # audio after an interruption is stale: drop it
                    audio, self._out_state = self._out_resampler.step(self._out_state, pcm16_to_float(msg))
                    self.player.push(audio, conv.audio_turn)
            elif (ev := parse_event(msg)) is not None:
                conv.handle(ev, time.monotonic())

    async def _uplink(self, ws: Any, conv: Conversation) -> None:
        """Microphone -> 16 kHz -> echo canceller -> server, one device block at a time."""
        assert self.capture is not None and self.player is not None
        mic_rs = StreamingResampler(self.capture.rate, SEND_RATE)
        far_rs = StreamingResampler(self.player.rate, SEND_RATE)
        mic_state, far_state = mic_rs.init_state(), far_rs.init_state()
        next_report = 0.0
        while (block := await self.capture.get()) is not None:
            mic, mic_state = mic_rs.step(mic_state, block)
            while self.player.played:
                played = self.player.played.popleft()
                if self.echo is not None:
                    far, far_state = far_rs.step(far_state, played)
                    self.echo.far.append(far)
            if self.echo is not None:
                lag = self._lag()
                if lag is not None:
                    self.echo.set_lag(lag)
                mic = self.echo.process(mic)
            if mic.size:
                await ws.send(float_to_pcm16(mic))
            self._poll_player(conv)
            if time.monotonic() >= next_report:
                next_report = time.monotonic() + self.report_every_s
                await self._report_playout(ws, conv)

    def _lag(self) -> float | None:
        assert self.capture is not None and self.player is not None
        t_in, t_out = self.capture.clock.origin(), self.player.clock.origin()
        return None if t_in is None or t_out is None else (t_in - t_out) * SEND_RATE

    def _locate(self, audio_ms: int) -> float | None:
        """Local (monotonic) time at which the sent-stream position `audio_ms` was captured."""
        origin = self.capture.clock.origin() if self.capture else None
        if origin is None:
            return None
        delay = self.echo.latency if self.echo is not None else 0
        return origin + (audio_ms * SEND_RATE / 1000 - delay) / SEND_RATE

    def _flush(self) -> None:
        """Barge-in: drop the queued answer, and what the resampler holds of it."""
        if self.player is not None:
            self.player.flush()
        if self._out_resampler is not None:
            self._out_state = self._out_resampler.init_state()

    def _poll_player(self, conv: Conversation) -> None:
        assert self.player is not None
        for tid, turn in conv.turns.items():
            if turn.first_sound is None and (at := self.player.first_sound.get(tid)) is not None:
                conv.heard_first_sound(tid, at)

    async def _report_playout(self, ws: Any, conv: Conversation) -> None:
        """Tell the server how much of the current answer was really played (the jitter buffer and
        the device add delay), so that a barge-in keeps exactly the heard words in the history."""
        assert self.player is not None
        tid = conv.audio_turn
        played = self.player.played_samples.get(tid, 0) if tid is not None else 0
        if tid is not None and played:
            ms = int(1000 * played / self.player.rate)
            await ws.send(json.dumps({"type": "playout.position", "played_ms": ms, "turn_id": tid}))

    def idle(self) -> bool:
        """Nothing pending: nobody talks, no answer is generated or queued (tests wait for this)."""
        return bool(self.conversation and self.conversation.idle() and self.player and not self.player.busy())


def _latency(stream: Any) -> float:
    value = getattr(stream, "latency", 0.0)
    try:
        return float(value[0] if isinstance(value, (tuple, list)) else value)
    except (TypeError, ValueError):
        return 0.0
