"""File mode (`--input-wav`, `--output-wav`): a wav file replaces the microphone, streamed in real
time (20 ms frames, then silence), and a *virtual speaker* replaces the loudspeaker: the output wav
is what a listener would have heard, each answer on the conversation's timeline, cut where a
barge-in flushed it. It needs no sound card and no PortAudio, which makes it the mode for demos,
scripts and tests."""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clients.talk.connection import closed_why, open_session
from clients.talk.conversation import Conversation, Turn
from clients.talk.screen import Screen
from clients.talk.timeline import Timeline
from clients.talk.wav import load_wav, write_wav
from clients.talk.wire import DEFAULT_SERVER, FRAME_S, SEND_RATE, parse_event
from codec.pcm import float_to_pcm16, pcm16_to_float


@dataclass
class FileResult:
    """What a file run produced; `audio` is the listener's side at `rate`."""

    exit_code: int
    error: str | None
    audio: np.ndarray
    rate: int
    turns: list[Turn]
    events: list[dict[str, Any]]


class FileTalk:
    """File mode: `audio` (16 kHz) is the user, streamed in real time; see the module docstring."""

    def __init__(
        self,
        audio: np.ndarray,
        *,
        url: str = DEFAULT_SERVER,
        options: dict[str, Any] | None = None,
        speed: float = 1.0,
        timeout: float | None = None,
        name: str = "the input",
        screen: Screen | None = None,
        settle_s: float = 0.3,
    ) -> None:
        self.audio = np.asarray(audio, np.float32)
        self.url = url
        self.options = options or {}
        self.speed = speed
        self.timeout = timeout if timeout is not None else len(self.audio) / SEND_RATE / speed + 30.0
        self.name = name
        self.screen = screen or Screen()
        self.settle_s = settle_s
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> FileResult:
        ws, started = await open_session(self.url, self.options)
        loop = asyncio.get_running_loop()
        rate = int(started.get("output_sample_rate", 24000))
        eot_s = float((started.get("options") or {}).get("end_of_turn_silence_ms", 500)) / 1000
        t0 = loop.time()
        timeline = Timeline(rate, self.speed, t0)
        conv = Conversation(
            self.screen, locate=lambda ms: ms / 1000.0, on_interrupt=lambda: timeline.flush(loop.time())
        )
        receiver = asyncio.create_task(self._receive(ws, conv, timeline))
        error, code, frames = None, 0, 0
        try:
            frames, error = await self._send(ws, conv, timeline, receiver, t0, eot_s)
        finally:
            with contextlib.suppress(Exception):
                await ws.close()
            with contextlib.suppress(BaseException):
                await receiver
        if error is not None:
            code = 130 if self._stop.is_set() else 1
        elif conv.answers == 0:
            heard = [t.you for t in conv.turns.values() if t.you]
            error = (
                f"no answer came; the server heard {'; '.join(map(repr, heard))}"
                if heard
                else f"no answer came: the server heard no speech in {self.name}"
            )
            code = 1
        turns = [conv.turns[k] for k in sorted(conv.turns)]
        return FileResult(code, error, timeline.render(frames * FRAME_S), rate, turns, conv.events)

    async def _send(
        self,
        ws: Any,
        conv: Conversation,
        timeline: Timeline,
        receiver: asyncio.Task[None],
        t0: float,
        eot_s: float,
    ) -> tuple[int, str | None]:
        """The microphone: 20 ms frames on the wall clock (divided by `speed`), the file, then
        silence until every answer has been heard. Returns (frames sent, error or None)."""
        loop = asyncio.get_running_loop()
        n = int(SEND_RATE * FRAME_S)
        file_frames = math.ceil(len(self.audio) / n)
        # enough trailing silence for the server to end the last turn before "idle" means anything
        min_frames = file_frames + math.ceil((eot_s + 0.5) / FRAME_S)
        k = 0
        while True:
            delay = t0 + (k + 1) * FRAME_S / self.speed - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            now = loop.time()
            if self._stop.is_set():
                return k, "interrupted"
            if receiver.done():
                return k, f"the server closed the connection ({closed_why(ws)})"
            if now - t0 > self.timeout:
                return k, f"timed out after {self.timeout:.0f} s waiting for the answers"
            chunk = self.audio[k * n : (k + 1) * n]
            if len(chunk) < n:
                chunk = np.concatenate([chunk, np.zeros(n - len(chunk), np.float32)])
            try:
                await ws.send(float_to_pcm16(chunk))
            except Exception:  # the connection dropped under us
                return k, f"the server closed the connection ({closed_why(ws)})"
            k += 1
            quiet = now - conv.last_event_at >= self.settle_s
            if k >= min_frames and conv.idle() and not timeline.playing(now) and quiet:
                return k, None

    async def _receive(self, ws: Any, conv: Conversation, timeline: Timeline) -> None:
        loop = asyncio.get_running_loop()
        async for msg in ws:
            now = loop.time()
            if isinstance(msg, bytes):
                if conv.audio_turn is not None:  # audio after an interruption is stale: drop it
                    at = timeline.feed(pcm16_to_float(msg), now)
                    conv.heard_first_sound(conv.audio_turn, at)
            elif (ev := parse_event(msg)) is not None:
                conv.handle(ev, now)


async def talk_files(
    input_wav: str | Path,
    output_wav: str | Path | None = None,
    *,
    url: str = DEFAULT_SERVER,
    options: dict[str, Any] | None = None,
    speed: float = 1.0,
    max_seconds: float | None = None,
    output_rate: int | None = None,
    screen: Screen | None = None,
) -> FileResult:
    """File mode as a coroutine, for scripts and tests; writes `output_wav` if given. Raises
    TalkError when the run cannot start."""
    talk = FileTalk(
        load_wav(input_wav),
        url=url,
        options=options,
        speed=speed,
        timeout=max_seconds,
        name=str(input_wav),
        screen=screen,
    )
    result = await talk.run()
    if output_wav is not None:
        write_wav(output_wav, result.audio, result.rate, output_rate)
    return result
