"""`duplex talk`: a conversation with the service from a terminal, or from a wav file.

Live mode (the default) streams the microphone to the native protocol (docs/protocol.md) and plays
the answers through the loudspeaker, with the transcript and per-turn latency in the terminal:

    mic (device rate) -> 16 kHz -> echo canceller -> PCM16 -> WebSocket
    WebSocket -> 24 kHz PCM16 -> device rate -> jitter buffer -> speaker -> (echo reference)

Everything here is a thin client: the server decides turns, barge-in and what was heard. The
client's own duties are real-time pacing, playing answers promptly, dropping queued audio at once on
`response.interrupted`, and keeping its own loudspeaker out of its microphone (clients/echo.py):
without that the server hears the bot, takes it for the user, and the bot interrupts itself.

File mode (`--input-wav`, `--output-wav`) replaces the sound card by a wav file streamed in real
time (20 ms frames, then silence) and a *virtual speaker*: the output wav is what a listener would
have heard, each answer on the conversation's timeline, cut where a barge-in flushed it. It needs no
sound card and no PortAudio, which makes it the mode for demos, scripts and tests.

Exit codes: 0 done (Ctrl-C in live mode is a normal way to finish), 1 the conversation failed (no
answer came, a timeout, the connection dropped), 2 it could not start (no PortAudio, no device,
server unreachable or refusing, a bad argument), 130 a file run interrupted by Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from clients.echo import EchoCanceller, EchoChunk, EchoConfig, FarEndBuffer
from codec.pcm import float_to_pcm16, pcm16_to_float
from codec.resample import SUPPORTED_RATES, StreamingResampler, resample

DEFAULT_SERVER = "ws://127.0.0.1:8765/v1/duplex"
SEND_RATE = 16000  # what the client sends: the server's own rate, and the echo canceller's
FRAME_S = 0.02  # microphone frame / device block
ECHO_MODES = ("aec", "suppress", "off")
STAGE_NAMES = {
    "end_of_turn": "end of turn",
    "final_transcript": "transcript",
    "first_llm_token": "first token",
    "first_tts_chunk": "first speech",
    "first_audio": "first audio",
}
PORTAUDIO_MISSING = (
    "PortAudio is not installed (sudo apt install libportaudio2 / brew install portaudio); "
    "use --input-wav/--output-wav to run from files"
)
SERVE_HINT = "start one with `duplex serve` (or point --server at a running one)"


class TalkError(Exception):
    """Something the user must fix or know; the message is printed as is, without a traceback."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


# -- command line ---------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `duplex talk` (the lead wires this into duplex/cli.py)."""
    p.add_argument("--server", default=DEFAULT_SERVER, metavar="URL", help=f"native protocol URL (default {DEFAULT_SERVER})")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="session option for session.start, e.g. end_of_turn_silence_ms=700 (repeatable)")
    live = p.add_argument_group("live mode (microphone and speaker)")
    live.add_argument("--input-device", metavar="ID", help="microphone: index or part of the name (see --list-devices)")
    live.add_argument("--output-device", metavar="ID", help="speaker: index or part of the name")
    live.add_argument("--list-devices", action="store_true", help="list the sound devices and exit")
    live.add_argument("--echo", choices=ECHO_MODES, default="aec",
                      help="aec: echo canceller + suppressor (default); suppress: duck the mic while the bot "
                           "talks; off: no processing (headphones)")
    live.add_argument("--headphones", action="store_true", help="the speaker cannot reach the mic: same as --echo off")
    files = p.add_argument_group("file mode (no sound card)")
    files.add_argument("--input-wav", metavar="PATH", help="stream this wav (any rate and channels) instead of the mic")
    files.add_argument("--output-wav", metavar="PATH", help="write what a listener would have heard")
    files.add_argument("--output-rate", type=int, default=None, metavar="HZ", help="rate of --output-wav (default: the server's, 24000)")
    files.add_argument("--speed", type=float, default=1.0, help="stream the file this many times faster than real time")
    files.add_argument("--timeout", type=float, default=None, metavar="S", help="give up after this long (default: file length + 30 s)")


def run(args: argparse.Namespace) -> int:
    """`duplex talk`: live mode, or file mode when --input-wav is given. Returns the exit code."""
    try:
        options = parse_options(args.option)
        if args.list_devices:
            return list_devices(import_sounddevice())
        if args.input_wav or args.output_wav:
            return _run_files(args, options)
        echo = "off" if args.headphones else args.echo
        sd = import_sounddevice()
        talk = LiveTalk(sd, url=args.server, options=options, echo=echo,
                        input_device=device_arg(args.input_device), output_device=device_arg(args.output_device))
        return asyncio.run(_until_ctrl_c(talk))
    except TalkError as exc:
        print(f"duplex talk: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:  # where no signal handler could be installed (Windows)
        print(file=sys.stderr)
        return 0


def _run_files(args: argparse.Namespace, options: dict[str, Any]) -> int:
    if not args.input_wav:
        raise TalkError("--output-wav needs --input-wav (file mode reads the user's side from a wav)")
    if not args.speed > 0:
        raise TalkError(f"--speed must be > 0, got {args.speed}")
    if args.timeout is not None and not args.timeout > 0:
        raise TalkError(f"--timeout must be > 0, got {args.timeout}")
    if args.output_rate is not None and not 1000 <= args.output_rate <= 384000:
        raise TalkError(f"--output-rate must be a sample rate in Hz, got {args.output_rate}")
    audio = load_wav(args.input_wav)
    talk = FileTalk(audio, url=args.server, options=options, speed=args.speed, timeout=args.timeout,
                    name=args.input_wav)
    try:
        result = asyncio.run(_until_ctrl_c(talk))
    except KeyboardInterrupt:  # where no signal handler could be installed (Windows)
        return 130
    if args.output_wav:
        rate = write_wav(args.output_wav, result.audio, result.rate, args.output_rate)
        print(f"wrote {args.output_wav} ({len(result.audio) / result.rate:.1f} s at {rate} Hz)")
    if result.error:
        print(f"duplex talk: {result.error}", file=sys.stderr)
    return result.exit_code


async def _until_ctrl_c(talk: Any) -> Any:
    """Run `talk` with Ctrl-C (SIGINT) asking it to stop cleanly instead of raising mid-send."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, talk.stop)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
        return await talk.run()
    try:
        return await talk.run()
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def parse_options(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings -> session.start options; values are JSON when they parse (700, 0.6, true)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise TalkError(f"--option wants KEY=VALUE, got {item!r}")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def device_arg(value: str | None) -> int | str | None:
    """A device given on the command line: an index when it is a number, else part of a name."""
    if value is None:
        return None
    return int(value) if value.strip().isdigit() else value


# -- the terminal ---------------------------------------------------------------------------


class Screen:
    """The live transcript. On a terminal the user's partial transcript is redrawn in place with
    `\\r`; the bot's answer streams on its own line; notes (latency) wait until that line ends."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._line: str | None = None  # "you" (a partial on screen) or "bot" (an answer streaming)
        self._bot_printed = False  # some of the current answer is on screen
        self._deferred: list[str] = []

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _end_line(self) -> None:
        if self._line == "you":
            self._write("\r\x1b[K")
        elif self._line == "bot":
            self._write("\n")
        self._line = None
        for note in self._deferred:
            self._write(note + "\n")
        self._deferred.clear()

    def user_partial(self, text: str) -> None:
        if not self.tty or not text:
            return
        if self._line == "bot":
            self._end_line()
        self._write(f"\r\x1b[K you: {text} ...")
        self._line = "you"

    def user_final(self, text: str) -> None:
        self._end_line()
        if text:
            self._write(f" you: {text}\n")

    def bot_delta(self, delta: str) -> None:
        if self._line != "bot":
            self._end_line()
            self._write(" bot:" + ("" if delta.startswith(" ") else " "))
            self._line = "bot"
        self._write(delta)
        self._bot_printed = True

    def bot_done(self, status: str, text: str, heard: str | None) -> None:
        """The answer ended; an interrupted one shows the words that were never heard struck out."""
        if not self._bot_printed and text:
            self.bot_delta(text)
        self._bot_printed = False
        lost = unheard(text, heard) if status == "interrupted" else ""
        if self._line == "bot":
            self._write("\n")
            self._line = None
        if status == "interrupted":
            self.note(f"      (interrupted; not heard: {self.strike(lost)})" if lost else "      (interrupted)")
        elif status not in ("completed", ""):
            self.note(f"      (answer {status})")
        self._end_line()

    def cut(self, text: str, heard: str) -> None:
        """A finished answer was cut while it was still playing."""
        lost = unheard(text, heard)
        self.note(f"      (interrupted while playing; not heard: {self.strike(lost)})" if lost else "      (interrupted)")

    def strike(self, text: str) -> str:
        return f"\x1b[9m{text}\x1b[0m" if self.tty else f"~~{text}~~"

    def note(self, text: str) -> None:
        """A line of its own; while an answer streams it waits for the end of that answer."""
        if self._line == "bot":
            self._deferred.append(text)
            return
        self._end_line()
        self._write(text + "\n")


def unheard(text: str, heard: str | None) -> str:
    """The words of `text` after the `heard` ones (the server says which words were played)."""
    words, got = text.split(), (heard or "").split()
    return " ".join(words[len(got) :]) if words[: len(got)] == got else (text if not got else "")


# -- the conversation -----------------------------------------------------------------------


@dataclass
class Turn:
    """One user turn and the answer to it, as the client saw them."""

    turn_id: int
    you: str = ""
    bot: str = ""
    status: str = ""  # response.done status; "" while there is none
    heard: str | None = None  # played_text of an interrupted answer
    stages: dict[str, float] = field(default_factory=dict)  # turn.latency, ms from the end of speech
    speech_end: float | None = None  # local clock (s): when the user's speech ended
    first_sound: float | None = None  # local clock (s): when the answer started to be heard
    reported: bool = False

    @property
    def onset_ms(self) -> float | None:
        """Client-side latency: from the end of the user's speech to the first answer sound."""
        if self.speech_end is None or self.first_sound is None:
            return None
        return 1000.0 * (self.first_sound - self.speech_end)


class Conversation:
    """Bookkeeping of the server's events shared by live and file mode: turns, what is still
    pending, and the screen. `locate(audio_ms)` turns an input-stream position into local time."""

    def __init__(self, screen: Screen, locate: Callable[[int], float | None], on_interrupt: Callable[[], None]) -> None:
        self.screen = screen
        self.locate = locate
        self.on_interrupt = on_interrupt
        self.turns: dict[int, Turn] = {}
        self.events: list[dict[str, Any]] = []
        self.user_speaking = False
        self.open_responses: set[int] = set()
        self.audio_turn: int | None = None  # whose audio is arriving; None after an interruption
        self.answers = 0  # answers that were completed or interrupted
        self.last_event_at = 0.0

    def turn(self, turn_id: int) -> Turn:
        return self.turns.setdefault(turn_id, Turn(turn_id))

    def idle(self) -> bool:
        """Nobody is talking and no answer is being generated (audio may still be playing)."""
        return not self.user_speaking and not self.open_responses

    def handle(self, ev: dict[str, Any], now: float) -> None:
        self.events.append(ev)
        self.last_event_at = now
        kind = ev.get("type")
        tid = ev.get("turn_id") if isinstance(ev.get("turn_id"), int) else 0
        if kind == "speech.started":
            self.user_speaking = True
        elif kind == "transcript.partial":
            self.screen.user_partial(str(ev.get("text", "")))
        elif kind == "speech.stopped":
            self.turn(tid).speech_end = self.locate(int(ev.get("audio_ms", 0)))
        elif kind == "transcript.final":
            self.user_speaking = False
            self.turn(tid).you = str(ev.get("text", ""))
            self.screen.user_final(self.turn(tid).you)
        elif kind == "response.started":
            self.open_responses.add(tid)
        elif kind == "response.text.delta":
            self.turn(tid).bot += str(ev.get("delta", ""))
            self.screen.bot_delta(str(ev.get("delta", "")))
        elif kind == "response.audio.started":
            self.audio_turn = tid
        elif kind == "turn.latency":
            self.turn(tid).stages = dict(ev.get("stages") or {})
        elif kind == "response.interrupted":
            self._interrupted(tid, str(ev.get("played_text", "")))
        elif kind == "response.done":
            self._done(tid, ev)
        elif kind == "error":
            self.screen.note(f"  server error: {ev.get('code')}: {ev.get('message')}")
        self._report(tid)

    def _interrupted(self, tid: int, heard: str) -> None:
        self.audio_turn = None
        self.on_interrupt()  # drop queued audio at once
        turn = self.turn(tid)
        turn.heard = heard
        if turn.status == "completed":  # it had finished generating and was still playing
            turn.status = "interrupted"
            self.screen.cut(turn.bot, heard)

    def _done(self, tid: int, ev: dict[str, Any]) -> None:
        self.open_responses.discard(tid)
        turn = self.turn(tid)
        turn.status = str(ev.get("status", ""))
        turn.bot = str(ev.get("text") or turn.bot).strip()
        if turn.status == "interrupted" and turn.heard is None:
            turn.heard = str(ev.get("played_text", ""))
        if turn.status in ("completed", "interrupted"):
            self.answers += 1
        self.screen.bot_done(turn.status, turn.bot, turn.heard)

    def heard_first_sound(self, tid: int, at: float) -> None:
        turn = self.turn(tid)
        if turn.first_sound is None:
            turn.first_sound = at
            self._report(tid)

    def _report(self, tid: int) -> None:
        """One latency line per answer, once the server's breakdown and the first sound are known."""
        turn = self.turns.get(tid)
        if turn is None or turn.reported or not turn.stages:
            return
        if turn.first_sound is None and not turn.status:
            return
        turn.reported = True
        server = ", ".join(f"{STAGE_NAMES.get(k, k)} {v:.0f}" for k, v in turn.stages.items() if isinstance(v, (int, float)))
        onset = turn.onset_ms
        head = f"answer began {onset:.0f} ms after you stopped" if onset is not None else "latency"
        self.screen.note(f"      [{head}; server ms from end of speech: {server}]")


# -- the connection -------------------------------------------------------------------------


async def open_session(url: str, options: dict[str, Any], sample_rate: int = SEND_RATE,
                       wait_s: float = 10.0) -> tuple[Any, dict[str, Any]]:
    """Connect and start a session; returns (websocket, the session.started event). Raises
    TalkError with what to do when the server is unreachable, refuses, or rejects the options."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

    try:
        ws = await connect(url, max_size=2**20, compression=None, open_timeout=wait_s, close_timeout=2)
    except InvalidURI:
        raise TalkError(f"{url!r} is not a WebSocket URL; expected e.g. {DEFAULT_SERVER}") from None
    except InvalidStatus as exc:
        status = exc.response.status_code
        why = " (the server is at capacity; try again later)" if status == 503 else ""
        raise TalkError(f"the server at {url} refused the connection: HTTP {status}{why}") from None
    except (OSError, TimeoutError) as exc:
        raise TalkError(f"cannot reach the server at {url} ({exc or type(exc).__name__}); {SERVE_HINT}") from None
    except InvalidHandshake as exc:
        raise TalkError(f"{url} did not accept a WebSocket connection: {exc}") from None
    try:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": sample_rate, "options": options}))
        async with asyncio.timeout(wait_s):
            while True:
                ev = parse_event(await ws.recv())
                if ev is None:
                    continue
                if ev.get("type") == "session.started":
                    return ws, ev
                if ev.get("type") == "error":
                    raise TalkError(f"the server refused session.start: {ev.get('code')}: {ev.get('message')}")
    except TimeoutError:
        await ws.close()
        raise TalkError(f"no session.started from {url} within {wait_s:.0f} s; is it a duplex server?") from None
    except ConnectionClosed as exc:
        raise TalkError(f"the server at {url} closed the connection at once: {exc}") from None
    except BaseException:
        await ws.close()
        raise


def parse_event(msg: str | bytes) -> dict[str, Any] | None:
    """A server event, or None for audio and for anything that is not a JSON object."""
    if isinstance(msg, bytes):
        return None
    try:
        ev = json.loads(msg)
    except ValueError:
        return None
    return ev if isinstance(ev, dict) else None


def closed_why(ws: Any) -> str:
    """The close code and reason of a closed connection, for the user."""
    code, reason = getattr(ws, "close_code", None), getattr(ws, "close_reason", "")
    if code is None:
        return "the connection dropped"
    return f"code {code}" + (f": {reason}" if reason else "")


# -- file mode ------------------------------------------------------------------------------


def load_wav(path: str | Path) -> np.ndarray:
    """Any file soundfile reads -> mono (channels averaged) float32 at 16 kHz."""
    import soundfile as sf

    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (OSError, RuntimeError, sf.LibsndfileError) as exc:
        raise TalkError(f"cannot read {path}: {exc}") from None
    mono = data.mean(axis=1).astype(np.float32)
    return to_rate(mono, int(rate), SEND_RATE)


def to_rate(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    if rate == target:
        return np.ascontiguousarray(x, np.float32)
    if rate in SUPPORTED_RATES and target in SUPPORTED_RATES:
        return resample(x, rate, target)
    import soxr

    return soxr.resample(np.ascontiguousarray(x, np.float32), rate, target, quality="HQ").astype(np.float32)


def write_wav(path: str | Path, audio: np.ndarray, rate: int, out_rate: int | None = None) -> int:
    """Write PCM16 mono at `out_rate` (default: `rate`); returns the rate written."""
    import soundfile as sf

    target = out_rate or rate
    try:
        sf.write(str(path), to_rate(audio, rate, target), target, subtype="PCM_16")
    except (OSError, RuntimeError, ValueError, sf.LibsndfileError) as exc:
        raise TalkError(f"cannot write {path}: {exc}") from None
    return target


@dataclass
class Run:
    """Answer audio played back to back: started at `wall` (loop time), placed at `at` (s)."""

    wall: float
    at: float
    chunks: list[np.ndarray] = field(default_factory=list)
    samples: int = 0
    closed: bool = False


class Timeline:
    """The virtual speaker of file mode: plays frames in order, in real time, like a sound card,
    and remembers where each stretch of sound falls on the conversation's clock (0 = the start of
    the input file; wall seconds times `speed`). A flush cuts the stretch where playback was."""

    def __init__(self, rate: int, speed: float, t0: float) -> None:
        self.rate = rate
        self.speed = speed
        self.t0 = t0
        self.runs: list[Run] = []

    def conv_time(self, wall: float) -> float:
        return (wall - self.t0) * self.speed

    def _end(self, run: Run) -> float:
        return run.wall + run.samples / self.rate

    def feed(self, samples: np.ndarray, wall: float) -> float:
        """Queue a frame that arrived at `wall`; returns where (s) on the timeline it starts."""
        last = self.runs[-1] if self.runs else None
        if last is None or last.closed or wall > self._end(last):  # the speaker had gone quiet
            at = self.conv_time(wall)
            if last is not None:
                at = max(at, last.at + last.samples / self.rate)
            last = Run(wall, at)
            self.runs.append(last)
        start = last.at + last.samples / self.rate
        last.chunks.append(samples)
        last.samples += len(samples)
        return start

    def flush(self, wall: float) -> None:
        """Barge-in: what had not been played by `wall` is dropped."""
        if not self.runs or self.runs[-1].closed:
            return
        last = self.runs[-1]
        keep = max(0, min(last.samples, int(round((wall - last.wall) * self.rate))))
        audio = np.concatenate(last.chunks)[:keep] if last.chunks else np.zeros(0, np.float32)
        last.chunks, last.samples, last.closed = [audio], keep, True

    def playing(self, wall: float) -> bool:
        return bool(self.runs) and not self.runs[-1].closed and wall < self._end(self.runs[-1])

    def render(self, seconds: float) -> np.ndarray:
        """The listener's audio from 0 to `seconds` (longer if an answer goes on), float32."""
        end = max([int(round(r.at * self.rate)) + r.samples for r in self.runs] + [int(round(seconds * self.rate))])
        out = np.zeros(end, np.float32)
        for r in self.runs:
            if r.samples:
                start = int(round(r.at * self.rate))
                out[start : start + r.samples] = np.concatenate(r.chunks)
        return out


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

    def __init__(self, audio: np.ndarray, *, url: str = DEFAULT_SERVER, options: dict[str, Any] | None = None,
                 speed: float = 1.0, timeout: float | None = None, name: str = "the input",
                 screen: Screen | None = None, settle_s: float = 0.3) -> None:
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
        conv = Conversation(self.screen, locate=lambda ms: ms / 1000.0, on_interrupt=lambda: timeline.flush(loop.time()))
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
            error = (f"no answer came; the server heard {'; '.join(map(repr, heard))}" if heard
                     else f"no answer came: the server heard no speech in {self.name}")
            code = 1
        turns = [conv.turns[k] for k in sorted(conv.turns)]
        return FileResult(code, error, timeline.render(frames * FRAME_S), rate, turns, conv.events)

    async def _send(self, ws: Any, conv: Conversation, timeline: Timeline, receiver: asyncio.Task[None],
                    t0: float, eot_s: float) -> tuple[int, str | None]:
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


async def talk_files(input_wav: str | Path, output_wav: str | Path | None = None, *, url: str = DEFAULT_SERVER,
                     options: dict[str, Any] | None = None, speed: float = 1.0, max_seconds: float | None = None,
                     output_rate: int | None = None, screen: Screen | None = None) -> FileResult:
    """File mode as a coroutine (what `duplex talk --input-wav` runs); writes `output_wav` if given.
    Raises TalkError when the run cannot start."""
    talk = FileTalk(load_wav(input_wav), url=url, options=options, speed=speed, timeout=max_seconds,
                    name=str(input_wav), screen=screen)
    result = await talk.run()
    if output_wav is not None:
        write_wav(output_wav, result.audio, result.rate, output_rate)
    return result


# -- live mode: the sound card --------------------------------------------------------------


def import_sounddevice() -> Any:
    """`import sounddevice`, which fails with OSError when the PortAudio library is missing."""
    try:
        import sounddevice
    except OSError:
        raise TalkError(PORTAUDIO_MISSING) from None
    except ImportError:
        raise TalkError("the sounddevice package is missing (pip install sounddevice); "
                        "use --input-wav/--output-wav to run from files") from None
    return sounddevice


def list_devices(sd: Any) -> int:
    """`--list-devices`: PortAudio's table (`>` marks the default input, `<` the default output)."""
    devices = sd.query_devices()
    if not len(devices):
        raise TalkError("PortAudio found no sound devices (no sound card, or no access to it); "
                        "use --input-wav/--output-wav to run from files")
    print(devices)
    return 0


def query_device(sd: Any, device: int | str | None, kind: str) -> tuple[Any, str, int]:
    """(device, name, sample rate) of the input or output device, or a TalkError naming it."""
    what = f"{kind} device {device!r}" if device is not None else f"default {kind} device"
    try:
        info = sd.query_devices(device, kind)
    except (ValueError, sd.PortAudioError) as exc:
        raise TalkError(f"no {what} ({exc}); see `duplex talk --list-devices` and pick one with "
                        f"--{kind}-device, or run from files with --input-wav/--output-wav") from None
    if int(info.get(f"max_{kind}_channels", 0)) < 1:
        raise TalkError(f"the {what} ({info.get('name')}) has no {kind} channels; see `duplex talk --list-devices`")
    rate = int(info.get("default_samplerate") or 48000)
    return device, str(info.get("name", device)), rate if rate in SUPPORTED_RATES else 48000


def _stream_time(time_info: Any, name: str) -> tuple[float, float] | None:
    """(currentTime, the named buffer time) from PortAudio's callback times, if it gives them."""
    cur = float(getattr(time_info, "currentTime", 0.0) or 0.0)
    at = float(getattr(time_info, name, 0.0) or 0.0)
    return (cur, at) if cur > 0 and at > 0 else None


class StreamClock:
    """When (time.monotonic) sample 0 of a stream was captured or played, from the callbacks'
    timestamps: the median of the recent estimates, which drops callback scheduling jitter."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.count = 0
        self._estimates: deque[float] = deque(maxlen=64)
        self._lock = threading.Lock()

    def mark(self, first_sample_at: float, frames: int) -> None:
        with self._lock:
            self._estimates.append(first_sample_at - self.count / self.rate)
            self.count += frames

    def origin(self) -> float | None:
        with self._lock:
            return statistics.median(self._estimates) if self._estimates else None


class Capture:
    """The microphone side (PortAudio's thread): mono blocks into an asyncio queue, timestamped.
    If the event loop falls more than `max_backlog_s` behind, blocks are dropped (and counted)
    rather than queued without bound."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rate: int, max_backlog_s: float = 2.0) -> None:
        self.loop = loop
        self.rate = rate
        self.latency = 0.0  # the stream's input latency (s), once it is open
        self.clock = StreamClock(rate)
        self.queue: asyncio.Queue[np.ndarray | None] = asyncio.Queue()
        self.overflows = 0  # PortAudio's input overflows
        self.dropped = 0  # blocks dropped because the loop was behind
        self._backlog = 0  # blocks handed to the loop and not yet taken
        self._max_backlog = max(1, int(max_backlog_s / FRAME_S))
        self._lock = threading.Lock()

    def callback(self, indata: np.ndarray, frames: int, time_info: Any, status: Any) -> None:
        now = time.monotonic()
        if status:
            self.overflows += 1
        block = np.asarray(indata, np.float32)
        mono = block.mean(axis=1, dtype=np.float32) if block.ndim == 2 else block.copy()
        times = _stream_time(time_info, "inputBufferAdcTime")
        first = now - (times[0] - times[1]) if times else now - self.latency - frames / self.rate
        self.clock.mark(first, frames)
        with self._lock:
            if self._backlog >= self._max_backlog:
                self.dropped += 1
                return
            self._backlog += 1
        with contextlib.suppress(RuntimeError):  # the loop is closing
            self.loop.call_soon_threadsafe(self.queue.put_nowait, mono)

    async def get(self) -> np.ndarray | None:
        """The next block, or None once `close` was called."""
        block = await self.queue.get()
        if block is not None:
            with self._lock:
                self._backlog -= 1
        return block

    def close(self) -> None:
        self.queue.put_nowait(None)


class Player:
    """The loudspeaker side (PortAudio's thread): a small jitter buffer that starts once
    `prebuffer_s` is queued (or has waited that long), is flushed at once on barge-in, and logs
    every block it played, silence included, as the echo canceller's reference."""

    def __init__(self, rate: int, prebuffer_s: float = 0.06) -> None:
        self.rate = rate
        self.prebuffer_s = prebuffer_s
        self.latency = 0.0  # the stream's output latency (s), once it is open
        self.clock = StreamClock(rate)
        self.played: deque[np.ndarray] = deque(maxlen=int(5 / FRAME_S))  # drained by the asyncio side
        self.first_sound: dict[int, float] = {}  # turn id -> when its first sample reached the speaker
        self.played_samples: dict[int, int] = {}
        self._lock = threading.Lock()
        self._queue: deque[list[Any]] = deque()  # [samples, turn id, offset]
        self._queued = 0
        self._playing = False
        self._waiting_since: float | None = None

    def push(self, samples: np.ndarray, turn_id: int) -> None:
        if not samples.size:
            return
        with self._lock:
            self._queue.append([samples, turn_id, 0])
            self._queued += samples.size
            if self._waiting_since is None:
                self._waiting_since = time.monotonic()

    def flush(self) -> None:
        with self._lock:
            self._queue.clear()
            self._queued, self._playing, self._waiting_since = 0, False, None

    def busy(self) -> bool:
        with self._lock:
            return self._queued > 0

    def callback(self, outdata: np.ndarray, frames: int, time_info: Any, status: Any) -> None:
        now = time.monotonic()
        times = _stream_time(time_info, "outputBufferDacTime")
        dac = now + (times[1] - times[0]) if times else now + self.latency
        block = np.zeros(frames, np.float32)
        with self._lock:
            if not self._playing and self._queued:
                waited = now - (self._waiting_since or now)
                self._playing = self._queued >= self.prebuffer_s * self.rate or waited >= self.prebuffer_s
            pos = 0
            while self._playing and pos < frames and self._queue:
                item = self._queue[0]
                samples, turn, offset = item
                take = min(frames - pos, samples.size - offset)
                self.first_sound.setdefault(turn, dac + pos / self.rate)
                block[pos : pos + take] = samples[offset : offset + take]
                self.played_samples[turn] = self.played_samples.get(turn, 0) + take
                pos, item[2], self._queued = pos + take, offset + take, self._queued - take
                if item[2] >= samples.size:
                    self._queue.popleft()
            if self._playing and not self._queue:
                self._playing, self._waiting_since = False, None
        outdata[:] = block.reshape(-1, 1)
        self.clock.mark(dac, frames)
        self.played.append(block)


class EchoPath:
    """Aligns the far end (what the speaker played) with the microphone on one 16 kHz clock and
    runs the echo canceller. The two sound streams have separate clocks; `lag` (the far-end sample
    that was playing when mic sample 0 was captured) comes from their timestamps. The reference is
    taken `margin_s` early so that timestamp error cannot put the echo before its reference."""

    def __init__(self, mode: str, rate: int = SEND_RATE, margin_s: float = 0.02, max_wait_s: float = 0.2,
                 double_talk_ms: float = 400.0) -> None:
        self.canceller = EchoCanceller(EchoConfig.for_mode(mode, sample_rate=rate, double_talk_ms=double_talk_ms))
        self.state = self.canceller.init_state()
        self.far = FarEndBuffer(rate * 4)
        self.rate = rate
        self.margin = int(rate * margin_s)
        self.max_wait = int(rate * max_wait_s)
        self.mic_index = 0  # mic samples handed to the canceller so far
        self.lag: int | None = None
        self._pending = np.zeros(0, np.float32)

    @property
    def latency(self) -> int:
        return self.canceller.latency

    def set_lag(self, lag: float) -> None:
        """Follow the clocks, but ignore sub-2 ms wobble: each change shifts the filter's view."""
        if self.lag is None or abs(lag - self.lag) > self.rate * 0.002:
            self.lag = int(round(lag))

    def process(self, mic: np.ndarray) -> np.ndarray:
        """Cleaned microphone samples (whole canceller blocks, `latency` late). Mic samples wait
        (up to `max_wait_s`) for their far-end reference to arrive."""
        self._pending = np.concatenate([self._pending, mic])
        n = len(self._pending)
        start = self.mic_index + (self.lag - self.margin if self.lag is not None else 0)
        if self.lag is not None and n <= self.max_wait:
            n = max(0, min(n, self.far.written - start))
        n -= n % self.canceller.n
        if n == 0:
            return np.zeros(0, np.float32)
        far = self.far.read(start, n) if self.lag is not None else np.zeros(n, np.float32)
        out, self.state = self.canceller.step(self.state, EchoChunk(self._pending[:n], far))
        self._pending = self._pending[n:]
        self.mic_index += n
        return out


class LiveTalk:
    """Live mode: see the module docstring. `sd` is the sounddevice module (or a test's fake)."""

    def __init__(self, sd: Any, *, url: str = DEFAULT_SERVER, options: dict[str, Any] | None = None,
                 echo: str = "aec", input_device: int | str | None = None,
                 output_device: int | str | None = None, screen: Screen | None = None,
                 prebuffer_s: float = 0.06, report_every_s: float = 0.25) -> None:
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
        self.sent_samples = 0
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
            streams.append(self._open(sd.OutputStream, out_dev, out_name, "output", out_rate, player.callback))
            streams.append(self._open(sd.InputStream, in_dev, in_name, "input", in_rate, capture.callback))
            player.latency, capture.latency = _latency(streams[0]), _latency(streams[1])
            for stream in streams:
                stream.start()
            self.screen.note(f"talking to {self.url}: mic {in_name} ({in_rate} Hz), speaker {out_name} "
                             f"({out_rate} Hz), echo {self.echo_mode}. Ctrl-C to quit.")
            return await self._converse(ws, conv)
        finally:
            for stream in streams:  # stop the callbacks first: nothing may touch a closed loop
                with contextlib.suppress(Exception):
                    stream.stop()
                    stream.close()
            with contextlib.suppress(Exception):
                await ws.close()

    def _open(self, cls: Any, device: Any, name: str, kind: str, rate: int, callback: Callable[..., None]) -> Any:
        try:
            return cls(samplerate=rate, blocksize=int(rate * FRAME_S), device=device, channels=1,
                       dtype="float32", latency="low", callback=callback)
        except (self.sd.PortAudioError, ValueError) as exc:
            raise TalkError(f"cannot open the {kind} device {name} at {rate} Hz ({exc}); see "
                            f"`duplex talk --list-devices` and pick another with --{kind}-device") from None

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
                self.sent_samples += mic.size
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
