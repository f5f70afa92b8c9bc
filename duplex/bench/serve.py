"""`duplex bench`: stream synthesised user turns to a running server in real time and measure.

The client behaves like a microphone: 20 ms PCM16 frames at 16 kHz leave on the wall clock,
continuously (silence included) from connect to close, also while the answer plays. What is
measured, per turn:

- **onset latency**: from the end of the user's speech (the wall time at which the frame holding the
  last speech sample of the synthesised prompt was sent; the prompt's trailing silence is trimmed
  first, so that instant is known exactly) to the first answer audio frame received. The server's
  own `turn.latency` breakdown (end_of_turn, final_transcript, first_llm_token, first_tts_chunk,
  first_audio; ms from the end of speech as its VAD saw it) is recorded next to it.
- **barge-in reaction**: a question with a long answer, then, 1.0-1.5 s after its audio starts, an
  interruption ("Stop. What is two plus two?"). Reaction = from the send time of the frame holding
  the interruption's first speech sample to the last answer audio frame received before
  `response.interrupted`. Audio frames received after `response.interrupted` and before the next
  `response.audio.started` are a server bug; they are counted (`leaked_frames`). The answers to the
  long question and to the interruption are onset samples too.
- **real-time factors**: `GET /stats` before and after the run; per executor budget label the delta
  of `run_total_s` divided by the input audio seconds sent (vad, asr.*) or the answer audio seconds
  received (llm.*, tts); the server process's CPU time (user + system) and peak RSS; overruns.

Every measure is reported as n / P50 / P90 / P99 (and min / max), never as a mean alone. Results go
to OUT/bench.json (raw samples, summary, settings, the server's /stats before and after) and
OUT/bench.png.

Standalone use, which keeps the server's work out of the client's process (and its GIL):

    duplex serve                 # terminal 1
    duplex bench --turns 20 --barge-ins 10 --out bench-out   # terminal 2

`duplex bench --serve` loads the service in this process (a background thread with its own event
loop) as a convenience; the client's frame pacing and receive timestamps then share the GIL with
the server's stage threads, and the "server process" CPU figures include the client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("duplex.bench.serve")

SR = 16000
FRAME_SAMPLES = SR // 50  # 20 ms
FRAME_SECONDS = FRAME_SAMPLES / SR

#: targets drawn on the plot and checked in the summary
TARGETS = {"onset_p50_s": 1.2, "onset_p90_s": 2.0, "barge_in_p50_s": 0.2}
STALL_S = 0.1  # no answer frame for this long before the interruption's onset: the audio had stalled
LATENCY_STAGES = ("end_of_turn", "final_transcript", "first_llm_token", "first_tts_chunk", "first_audio")

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


def to_pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


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

            sentences = [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
            parts: list[np.ndarray] = []
            for s in sentences:
                if parts:
                    parts.append(np.zeros(int(SR * self.pause_s), np.float32))
                audio = self._tts.synthesize(s)
                parts.append(trim_speech(resample(audio, self.rate, SR)))
            self._cache[text] = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return self._cache[text]


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

    def __init__(self, ws: Any, loop: asyncio.AbstractEventLoop,
                 send: Callable[[np.ndarray], Any] | None = None) -> None:
        self.ws = ws
        self.loop = loop
        # how a frame leaves: PCM16 bytes on the native WebSocket, or a transport link's own `send`
        self._send = send if send is not None else (lambda frame: ws.send(to_pcm16(frame)))
        self.frames_sent = 0
        self.max_lag_s = 0.0
        self._buf = np.zeros(0, np.float32)
        self._marks: list[tuple[int, asyncio.Future[float]]] = []  # global sample index -> send time

    @property
    def seconds_sent(self) -> float:
        return self.frames_sent * FRAME_SECONDS

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


# -- one conversation --------------------------------------------------------------------


@dataclass
class Conversation:
    mic: Mic
    rx: Listener
    timeout: float
    progress: Progress
    turns: list[dict[str, Any]] = field(default_factory=list)
    barge_ins: list[dict[str, Any]] = field(default_factory=list)

    async def _answer(self, utt: Utterance, kind: str, trial: int, start: int) -> dict[str, Any]:
        """Wait for the answer to `utt` (said when the log had `start` entries) and its first audio
        frame: one onset sample."""
        rec: dict[str, Any] = {"kind": kind, "trial": trial, "text": utt.text, "ok": False}
        t_end = await asyncio.wait_for(asyncio.shield(utt.last_sent), self.timeout + utt.samples / SR)
        t_first = utt.first_sent.result()
        rec["t_speech_start"] = t_first
        rec["t_speech_end"] = t_end
        rx = self.rx
        # the turn this speech ends is the first final after the end of speech; finals in between
        # mean the VAD split the utterance into two turns (a pause longer than the hangover)
        i = await rx.wait(lambda r: r.is_event("transcript.final") and r.t >= t_end, start=start, within_s=self.timeout)
        rec["split_finals"] = sum(1 for r in rx.log[start:i] if r.is_event("transcript.final") and r.t > t_first)
        final = rx.log[i].event
        assert final is not None
        rec["transcript"] = final["text"]
        turn = int(final["turn_id"])
        rec["turn_id"] = turn
        if not final["text"].strip():
            rec["error"] = "empty transcript (no answer follows)"
            return rec
        i = await rx.wait(
            lambda r: r.is_event("response.audio.started", turn) or r.is_event("response.done", turn),
            start=i, within_s=self.timeout,
        )
        if rx.log[i].is_event("response.done"):
            rec["error"] = f"response {rx.log[i].event['status']} without audio"  # type: ignore[index]
            return rec
        rec["audio_started_index"] = i
        j = await rx.wait(lambda r: r.is_audio or r.is_event("response.done", turn), start=i, within_s=self.timeout)
        if not rx.log[j].is_audio:
            rec["error"] = "response.done before any audio frame"
            return rec
        rec["t_first_audio"] = rx.log[j].t
        rec["onset_s"] = rx.log[j].t - t_end
        rec["first_audio_index"] = j
        with contextlib.suppress(TimeoutError):
            k = await rx.wait(lambda r: r.is_event("turn.latency", turn), start=i, within_s=5.0)
            rec["server_latency_ms"] = dict(rx.log[k].event["stages"])  # type: ignore[index]
            rec["relay"] = dict(rx.log[k].event.get("relay") or {})  # type: ignore[union-attr]
        rec["ok"] = True
        return rec

    async def _finish(self, rec: dict[str, Any]) -> None:
        """Wait for response.done of the turn, the audio to finish playing, and a pause."""
        turn = rec.get("turn_id")
        rx = self.rx
        if turn is not None:
            with contextlib.suppress(TimeoutError):
                k = await rx.wait(lambda r: r.is_event("response.done", turn), start=rec.get("audio_started_index", 0),
                                  within_s=self.timeout * 4)
                done = rx.log[k].event
                assert done is not None
                rec["status"] = done.get("status")
                rec["answer"] = done.get("text", "")
        await rx.wait_quiet()
        if "first_audio_index" in rec:
            rec["answer_audio_s"] = sum(
                r.audio_s for r in rx.log[rec["first_audio_index"] :] if r.is_audio
            )
        await asyncio.sleep(0.5)

    def _line(self, rec: dict[str, Any], label: str) -> str:
        if not rec.get("ok"):
            return f"{label} {rec['text']!r}: FAILED ({rec.get('error', '?')})"
        lat = rec.get("server_latency_ms") or {}
        parts = " ".join(f"{k}={lat[k]:.0f}" for k in LATENCY_STAGES if isinstance(lat.get(k), (int, float)))
        return f"{label} {rec['text']!r} -> {rec.get('transcript', '')!r}: onset {rec['onset_s'] * 1000:.0f} ms  [server ms: {parts}]"

    async def _ask(self, kind: str, trial: int, text: str, speech: np.ndarray) -> dict[str, Any]:
        """Speak `text` into the mic and record the answer it gets as one onset sample."""
        start = len(self.rx.log)
        utt = self.mic.say(text, speech)
        try:
            rec = await self._answer(utt, kind, trial, start)
        except TimeoutError:
            rec = {"kind": kind, "trial": trial, "text": text, "ok": False, "error": "timed out"}
        self.turns.append(rec)
        return rec

    async def turn(self, trial: int, n: int, text: str, speech: np.ndarray) -> None:
        rec = await self._ask("question", trial, text, speech)
        await self._finish(rec)
        self.progress(self._line(rec, f"[turn {trial + 1}/{n}]"))

    async def barge_in(self, trial: int, n: int, prompt: str, speech: np.ndarray, interruption: str,
                       interruption_speech: np.ndarray, wait_s: float) -> None:
        rx = self.rx
        trial_rec: dict[str, Any] = {"trial": trial, "prompt": prompt, "interruption": interruption,
                                     "wait_s": wait_s, "ok": False}
        self.barge_ins.append(trial_rec)
        label = f"[barge-in {trial + 1}/{n}]"
        rec = await self._ask("long", trial, prompt, speech)
        if not rec.get("ok"):
            trial_rec["error"] = f"long answer: {rec.get('error')}"
            await self._finish(rec)
            self.progress(f"{label} FAILED ({trial_rec['error']})")
            return
        turn = rec["turn_id"]
        await asyncio.sleep(max(0.0, rec["t_first_audio"] + wait_s - rx.loop.time()))
        t_said = rx.loop.time()
        istart = len(rx.log)
        iutt = self.mic.say(interruption, interruption_speech)
        t_onset = await asyncio.wait_for(asyncio.shield(iutt.first_sent), 5.0)
        trial_rec["t_interrupt_onset"] = t_onset
        trial_rec["mic_delay_s"] = t_onset - t_said
        # the answer may have finished before the user interrupted: then there is nothing to measure
        done_i = rx.find(lambda r: r.is_event("response.done", turn), start=rec["audio_started_index"])
        generated = done_i is not None and rx.log[done_i].t < t_onset
        playing = rx.play_end > t_onset
        trial_rec["answer_done_before_onset"] = generated
        trial_rec["answer_playing_at_onset"] = playing
        i: int | None
        try:
            # an answer that had finished playing before the user spoke cannot be interrupted
            i = await rx.wait(lambda r: r.is_event("response.interrupted", turn), start=rec["audio_started_index"],
                              within_s=self.timeout if (playing or not generated) else 2.0)
        except TimeoutError:
            i = None
        if i is None:
            trial_rec["error"] = (
                "no response.interrupted"
                + ("" if playing or not generated else " (the answer had finished playing before the interruption)")
            )
        else:
            ev = rx.log[i].event
            assert ev is not None
            trial_rec["t_interrupted_event"] = rx.log[i].t
            trial_rec["played_ms"] = ev.get("played_ms")
            trial_rec["played_text"] = ev.get("played_text")
            last = None
            for r in reversed(rx.log[rec["first_audio_index"] : i]):
                if r.is_audio:
                    last = r.t
                    break
            trial_rec["t_last_answer_audio"] = last
            trial_rec["frames_after_onset"] = sum(1 for r in rx.log[rec["first_audio_index"] : i]
                                                  if r.is_audio and r.t > t_onset)
            raw = (last - t_onset) if last is not None else None
            trial_rec["reaction_raw_s"] = raw
            # the last frame came a little before the onset (frames are 40 ms apart): the server stopped
            # at once (0). Much earlier: the answer's audio had stalled (TTS/LLM slower than real time),
            # there was nothing to stop and the reaction is not measurable; counted apart.
            stalled = raw is None or raw < -STALL_S
            trial_rec["answer_stalled_at_onset"] = stalled
            trial_rec["reaction_s"] = None if stalled else max(0.0, raw)
            trial_rec["event_after_onset_s"] = rx.log[i].t - t_onset
            trial_rec["ok"] = True
        with contextlib.suppress(TimeoutError):
            await rx.wait(lambda r: r.is_event("response.done", turn), start=rec["audio_started_index"],
                          within_s=self.timeout)
        rec["status"] = next(
            (r.event.get("status") for r in rx.log[rec["audio_started_index"]:]  # type: ignore[union-attr]
             if r.is_event("response.done", turn)), None)
        # the answer to the interruption is one more onset sample
        start_idx = istart if i is None else i
        try:
            irec = await self._answer(iutt, "interruption", trial, istart)
        except TimeoutError:
            irec = {"kind": "interruption", "trial": trial, "text": interruption, "ok": False, "error": "timed out"}
        self.turns.append(irec)
        await self._finish(irec)
        stop = irec.get("audio_started_index")
        trial_rec["leaked_frames"] = count_leaks(rx.log, start_idx, stop)
        if trial_rec["ok"]:
            reaction = ("n/a (answer audio had stalled)" if trial_rec["reaction_s"] is None
                        else f"{trial_rec['reaction_s'] * 1000:.0f} ms")
            self.progress(
                f"{label} {prompt!r} interrupted after {wait_s:.2f} s: reaction {reaction}, "
                f"leaked frames {trial_rec['leaked_frames']}; " + self._line(irec, "answer")
            )
        else:
            self.progress(f"{label} {prompt!r}: FAILED ({trial_rec['error']}); " + self._line(irec, "answer"))


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


def real_time_factors(before: dict[str, Any], after: dict[str, Any], input_s: float, output_s: float,
                      wall_s: float) -> dict[str, Any]:
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
        st = stage_totals.setdefault(label.split(".")[0], {"run_s": 0.0, "audio_s": audio_s, "jobs": 0, "overruns": 0})
        st["run_s"] += run_s
        st["jobs"] += row["jobs"]
        st["overruns"] += row["overruns"]
    stages = {
        k: {**v, "run_s": round(v["run_s"], 4), "rtf": v["run_s"] / v["audio_s"] if v["audio_s"] > 0 else None}
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


# -- the run -----------------------------------------------------------------------------


def _summary(turns: list[dict[str, Any]], barge_ins: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [t for t in turns if t.get("ok")]
    server = {
        stage: percentiles([t["server_latency_ms"][stage] for t in ok
                            if isinstance((t.get("server_latency_ms") or {}).get(stage), (int, float))])
        for stage in LATENCY_STAGES
    }
    onset = percentiles([t["onset_s"] for t in ok])
    reaction = percentiles([b["reaction_s"] for b in barge_ins if b.get("ok") and b.get("reaction_s") is not None])
    summary = {
        "onset_s": onset,
        "onset_by_kind_s": {k: percentiles([t["onset_s"] for t in ok if t["kind"] == k])
                            for k in ("question", "long", "interruption")},
        "server_latency_ms": server,
        "barge_in_reaction_s": reaction,
        "barge_in_event_s": percentiles([b["event_after_onset_s"] for b in barge_ins if b.get("ok")]),
        "leaked_frames": int(sum(b.get("leaked_frames", 0) for b in barge_ins)),
        "barge_ins_stalled": sum(1 for b in barge_ins if b.get("answer_stalled_at_onset")),
        "turns_failed": sum(1 for t in turns if not t.get("ok")),
        "barge_ins_failed": sum(1 for b in barge_ins if not b.get("ok")),
        "split_turns": int(sum(t.get("split_finals", 0) for t in turns)),
        # answers the relay's drafter started (committed prefix) out of those it drafted for
        "relay_committed": sum(1 for t in ok if (t.get("relay") or {}).get("committed")),
        "relay_drafted": sum(1 for t in ok if t.get("relay")),
    }
    summary["targets"] = {
        "onset_p50_s": {"target": TARGETS["onset_p50_s"], "value": onset["p50"],
                        "met": onset["p50"] is not None and onset["p50"] <= TARGETS["onset_p50_s"]},
        "onset_p90_s": {"target": TARGETS["onset_p90_s"], "value": onset["p90"],
                        "met": onset["p90"] is not None and onset["p90"] <= TARGETS["onset_p90_s"]},
        "barge_in_p50_s": {"target": TARGETS["barge_in_p50_s"], "value": reaction["p50"],
                           "met": reaction["p50"] is not None and reaction["p50"] <= TARGETS["barge_in_p50_s"]},
    }
    return summary


async def run_bench(
    url: str,
    turns: int,
    barge_ins: int,
    synth: Synth | None = None,
    out_dir: str | Path | None = "bench-out",
    *,
    questions: Sequence[str] = QUESTIONS,
    long_prompts: Sequence[str] = LONG_PROMPTS,
    interruptions: Sequence[str] = INTERRUPTIONS,
    barge_wait_s: tuple[float, float] = (1.0, 1.5),
    turn_timeout_s: float = 30.0,
    lead_silence_s: float = 1.0,
    seed: int = 0,
    session_options: dict[str, Any] | None = None,
    progress: Progress | None = print,
    plot: bool = True,
) -> dict[str, Any]:
    """Run `turns` question turns, then `barge_ins` barge-in trials, over one session at `url`.

    `synth(text)` returns float32 speech at 16 kHz (default: hibari); its output is trimmed of
    leading/trailing silence and cached in memory before the connection opens. Returns the result
    dict that is also written to `out_dir/bench.json` (with `bench.png`) unless `out_dir` is None.
    Raises BenchError when the server cannot be reached.
    """
    from websockets.asyncio.client import connect

    say = progress or (lambda _msg: None)
    rng = random.Random(seed)
    plan_q = [questions[i % len(questions)] for i in range(turns)]
    plan_b = [
        (long_prompts[i % len(long_prompts)], interruptions[i % len(interruptions)], rng.uniform(*barge_wait_s))
        for i in range(barge_ins)
    ]
    # fail fast (and clearly) when nothing listens, before spending time on synthesis
    await asyncio.to_thread(fetch_stats, url)

    if synth is None:
        say("loading hibari for the prompts ...")
        synth = HibariSynth()
    texts = list(dict.fromkeys([*plan_q, *(p for p, _, _ in plan_b), *(x for _, x, _ in plan_b)]))
    say(f"synthesising {len(texts)} prompts ...")
    t_syn = time.perf_counter()
    speech: dict[str, np.ndarray] = {}
    for text in texts:
        audio = trim_speech(np.asarray(synth(text), dtype=np.float32))
        if len(audio) == 0:
            raise BenchError(f"the synthesiser returned silence for {text!r}")
        speech[text] = audio
    say(f"  done in {time.perf_counter() - t_syn:.1f} s; {sum(len(a) for a in speech.values()) / SR:.1f} s of speech")

    before = await asyncio.to_thread(fetch_stats, url)
    loop = asyncio.get_running_loop()
    started_at = time.time()
    t0 = loop.time()
    interrupted = False
    try:
        ws_cm = connect(url, max_size=2**20, compression=None, open_timeout=10)
        ws = await ws_cm.__aenter__()
    except (OSError, TimeoutError) as exc:
        raise BenchError(f"cannot open {url}: {exc}. Is `duplex serve` running?") from None
    except Exception as exc:  # an HTTP status instead of the upgrade (e.g. 503 at capacity)
        raise BenchError(f"the server refused the WebSocket at {url}: {exc}") from None
    mic = Mic(ws, loop)
    rx = Listener(ws, loop)
    conv = Conversation(mic, rx, turn_timeout_s, say)
    tasks: list[asyncio.Task[None]] = []
    session: dict[str, Any] = {}
    try:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": SR, "options": session_options or {}}))
        tasks = [asyncio.create_task(rx.run(), name="bench-rx")]
        i = await rx.wait(lambda r: r.is_event("session.started") or r.is_event("error"), within_s=10)
        first = rx.log[i].event
        assert first is not None
        if first["type"] == "error":
            raise BenchError(f"session.start refused: {first.get('code')}: {first.get('message')}")
        session = first
        tasks.append(asyncio.create_task(mic.run(), name="bench-mic"))
        await asyncio.sleep(lead_silence_s)
        try:
            for k, text in enumerate(plan_q):
                await conv.turn(k, turns, text, speech[text])
            for k, (prompt, intr, wait_s) in enumerate(plan_b):
                await conv.barge_in(k, barge_ins, prompt, speech[prompt], intr, speech[intr], wait_s)
        except asyncio.CancelledError:  # Ctrl-C: keep what was measured
            interrupted = True
            say("interrupted: writing the partial results")
        except ConnectionError as exc:
            raise BenchError(f"lost the connection to {url} during the run: {exc}") from None
    finally:
        await cancel_tasks(tasks)
        with contextlib.suppress(Exception):
            await ws_cm.__aexit__(None, None, None)
    wall_s = loop.time() - t0
    await asyncio.sleep(0.2)  # let the server account the session's last jobs
    after = await asyncio.to_thread(fetch_stats, url)

    summary = _summary(conv.turns, conv.barge_ins)
    summary["leaked_frames_total"] = count_leaks(rx.log)
    summary["rtf"] = real_time_factors(before, after, mic.seconds_sent, rx.audio_seconds, wall_s)
    summary["client"] = {"mic_max_lag_ms": round(mic.max_lag_s * 1000, 1),
                         "server_errors": [r.event for r in rx.log if r.is_event("error")]}
    result: dict[str, Any] = {
        "settings": {
            "url": url,
            "turns": turns,
            "barge_ins": barge_ins,
            "sample_rate": SR,
            "frame_ms": FRAME_SECONDS * 1000,
            "barge_wait_s": list(barge_wait_s),
            "turn_timeout_s": turn_timeout_s,
            "seed": seed,
            "session_options": session_options or {},
            "session": session,
            "synth": getattr(synth, "__qualname__", type(synth).__name__),
            "started_at": started_at,
            "wall_s": round(wall_s, 3),
            "interrupted": interrupted,
            "targets": TARGETS,
            "clock": "client monotonic seconds (loop.time()); t_* fields are on this clock",
        },
        "summary": summary,
        "samples": {"turns": conv.turns, "barge_ins": conv.barge_ins},
        "server_stats": {"before": before, "after": after},
    }
    if out_dir is not None:
        await asyncio.to_thread(write_outputs, result, out_dir, plot)
    return result


def write_outputs(result: dict[str, Any], out_dir: str | Path, plot: bool = True) -> None:
    """OUT/bench.json (everything) and OUT/bench.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2, default=_json_default))
    if plot:
        plot_results(result, out / "bench.png")


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


# -- report ------------------------------------------------------------------------------


def _fmt(v: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def format_table(result: dict[str, Any]) -> str:
    s = result["summary"]
    rows: list[tuple[str, dict[str, Any], float, str]] = [
        ("onset: end of speech -> first audio (client)", s["onset_s"], 1000.0, "P50<=1200 P90<=2000"),
    ]
    for kind, st in s["onset_by_kind_s"].items():
        if st["n"]:
            rows.append((f"  onset, {kind} turns", st, 1000.0, ""))
    for stage in LATENCY_STAGES:
        rows.append((f"  server turn.latency {stage}", s["server_latency_ms"][stage], 1.0, ""))
    rows.append(("barge-in: speech onset -> last answer frame", s["barge_in_reaction_s"], 1000.0, "P50<=200"))
    rows.append(("  barge-in: speech onset -> response.interrupted", s["barge_in_event_s"], 1000.0, ""))
    lines = [f"{'measure (ms)':<50} {'n':>4} {'P50':>7} {'P90':>7} {'P99':>7} {'min':>7} {'max':>7}  target"]
    for name, st, scale, target in rows:
        lines.append(
            f"{name:<50} {st['n']:>4} {_fmt(st['p50'], scale):>7} {_fmt(st['p90'], scale):>7} "
            f"{_fmt(st['p99'], scale):>7} {_fmt(st['min'], scale):>7} {_fmt(st['max'], scale):>7}  {target}"
        )
    tg = s["targets"]
    lines.append(
        "targets: "
        + ", ".join(f"{k} {'not measured' if v['value'] is None else 'met' if v['met'] else 'MISSED'} "
                    f"({_fmt(v['value'], 1000)} ms vs {v['target'] * 1000:.0f})" for k, v in tg.items())
    )
    lines.append(
        f"failures: {s['turns_failed']} turns, {s['barge_ins_failed']} barge-ins; leaked frames after "
        f"response.interrupted: {s['leaked_frames_total']}; VAD-split turns: {s['split_turns']}; barge-ins "
        f"not measurable (answer audio stalled at the interruption): {s['barge_ins_stalled']}"
    )
    if s.get("relay_drafted"):
        lines.append(f"relay: {s['relay_committed']} of {s['relay_drafted']} answers started by the drafter "
                     "(committed prefix)")
    rtf = s["rtf"]
    lines.append("")
    lines.append(f"{'stage label':<14} {'jobs':>6} {'overruns':>8} {'run s':>8} {'per':>7} {'audio s':>8} {'RTF':>7}")
    for label, r in rtf["labels"].items():
        lines.append(f"{label:<14} {r['jobs']:>6} {r['overruns']:>8} {r['run_s']:>8.2f} {r['per']:>7} "
                     f"{r['audio_s']:>8.1f} {_fmt(r['rtf'], 1, 3):>7}")
    for stage, r in rtf["stages"].items():
        if sum(1 for label in rtf["labels"] if label.split(".")[0] == stage) < 2:
            continue  # the label row says it all
        lines.append(f"{stage + ' (all)':<14} {r['jobs']:>6} {r['overruns']:>8} {r['run_s']:>8.2f} {'':>7} "
                     f"{r['audio_s']:>8.1f} {_fmt(r['rtf'], 1, 3):>7}")
    p = rtf["process"]
    lines.append(
        f"server process: CPU {_fmt(p['cpu_s'], 1, 1)} s over {rtf['wall_s']:.1f} s wall "
        f"({_fmt(p['cpu_cores_busy'], 1, 2)} cores busy, {_fmt(p['cpu_per_input_audio_s'], 1, 2)} CPU s per input s); "
        f"peak RSS {p['peak_rss_mb']} MB; input {rtf['input_audio_s']:.1f} s sent, answer audio "
        f"{rtf['output_audio_s']:.1f} s received; client mic max lag {s['client']['mic_max_lag_ms']} ms"
    )
    return "\n".join(lines)


def plot_results(result: dict[str, Any], path: str | Path) -> None:
    """Strip plot over box plot: onset and its server breakdown; barge-in reaction; targets as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [t for t in result["samples"]["turns"] if t.get("ok")]
    groups: list[tuple[str, list[float]]] = []
    for stage in LATENCY_STAGES:
        vals = [t["server_latency_ms"][stage] / 1000 for t in turns
                if isinstance((t.get("server_latency_ms") or {}).get(stage), (int, float))]
        groups.append((f"server\n{stage}", vals))
    groups.append(("client\nonset", [t["onset_s"] for t in turns]))
    reaction = [b["reaction_s"] for b in result["samples"]["barge_ins"] if b.get("ok") and b.get("reaction_s") is not None]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [5, 1.4]})
    rng = np.random.default_rng(0)

    def strip(ax: Any, data: list[list[float]], labels: list[str], scale: float = 1.0) -> None:
        for x, vals in enumerate(data, start=1):
            if vals:
                v = np.asarray(vals) * scale
                ax.boxplot([v], positions=[x], widths=0.5, showfliers=False)
                ax.scatter(x + rng.uniform(-0.15, 0.15, len(v)), v, s=14, alpha=0.6, zorder=3)
                ax.annotate(f"n={len(v)}", (x, 0), xytext=(0, -4), textcoords="offset points",
                            ha="center", va="top", fontsize=7, annotation_clip=False)
            else:
                ax.text(x, 0, "no samples", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(1, len(data) + 1), labels, fontsize=8)
        ax.set_xlim(0.4, len(data) + 0.6)

    strip(ax1, [g[1] for g in groups], [g[0] for g in groups])
    ax1.axhline(TARGETS["onset_p50_s"], color="tab:green", ls="--", label=f"onset P50 target {TARGETS['onset_p50_s']} s")
    ax1.axhline(TARGETS["onset_p90_s"], color="tab:red", ls="--", label=f"onset P90 target {TARGETS['onset_p90_s']} s")
    ax1.axhline(0, color="grey", lw=0.5)
    ax1.set_ylabel("seconds after the end of the user's speech")
    ax1.set_title("answer onset and the server's stage breakdown")
    ax1.legend(loc="upper left", fontsize=8)

    strip(ax2, [reaction], ["barge-in\nreaction"], scale=1000.0)
    ax2.axhline(TARGETS["barge_in_p50_s"] * 1000, color="tab:red", ls="--",
                label=f"target {TARGETS['barge_in_p50_s'] * 1000:.0f} ms")
    ax2.set_ylabel("ms from interruption onset to last answer frame")
    ax2.set_title("barge-in")
    ax2.legend(loc="upper left", fontsize=8)
    top = max([TARGETS["barge_in_p50_s"] * 1000 * 1.5, *(np.asarray(reaction) * 1000 * 1.1)])
    ax2.set_ylim(min([0.0, *(np.asarray(reaction) * 1000)]) - 10, top)  # no barge-ins: just 0

    s = result["settings"]
    fig.suptitle(f"duplex bench: {s['turns']} turns, {s['barge_ins']} barge-ins, {s['url']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
        from duplex.runtime.gateway import Gateway, GatewaySettings
        from duplex.transports.native import ServerSettings

        ready = threading.Event()
        failure: list[BaseException] = []

        def target() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                settings = GatewaySettings(http=ServerSettings(host=self.host, port=0), audiosocket=(self.host, 0))
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

    def stop(self) -> None:
        loop, gateway = self._loop, self._gateway
        if loop is not None and gateway is not None and loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(gateway.close(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)


def main(args: argparse.Namespace) -> int:
    """`duplex bench`: see the module docstring."""
    transports = _transports(getattr(args, "transport", None))
    if transports is None:
        print("duplex bench: --transport takes 'all' or a comma list of native, twilio, audiosocket, realtime",
              file=sys.stderr)
        return 2
    if not transports and (args.turns < 0 or args.barge_ins < 0 or args.turns + args.barge_ins == 0):
        print("duplex bench: --turns and --barge-ins must be >= 0 and not both 0", file=sys.stderr)
        return 2
    options: dict[str, Any] = {}
    if getattr(args, "session", None):
        try:
            options = json.loads(args.session)
        except ValueError as exc:
            print(f"duplex bench: --session is not JSON ({exc}); e.g. --session '{{\"relay\": true}}'",
                  file=sys.stderr)
            return 2
        if not isinstance(options, dict):
            print("duplex bench: --session must be a JSON object of session options", file=sys.stderr)
            return 2
    tones = bool(getattr(args, "tones", False))
    if tones and not (args.serve and transports):
        print("duplex bench: --tones needs --serve and --transport (it measures the adapters alone)", file=sys.stderr)
        return 2
    url = args.url
    audiosocket = None
    if getattr(args, "audiosocket", None):
        from duplex.runtime.gateway import parse_host_port

        try:
            audiosocket = parse_host_port(args.audiosocket)
        except ValueError as exc:
            print(f"duplex bench: --audiosocket: {exc}", file=sys.stderr)
            return 2
    server: InProcessServer | None = None
    service: Any = None
    if args.serve:
        from duplex.base.config import ConfigError, load_profile
        from duplex.runtime.service import DuplexService

        try:
            if tones:
                from duplex.testing.fakes import fake_stages, scripted_answer

                print("duplex bench: tone stages in this process (--tones): the adapters' own cost, no models")
                service = DuplexService(load_profile(args.profile), fake_stages(scripted_answer))
            else:
                print("duplex bench: loading the service in this process (--serve) ...", flush=True)
                service = DuplexService.load(args.profile)
        except (ConfigError, RuntimeError, ValueError) as exc:
            print(f"duplex bench: cannot load models: {exc}", file=sys.stderr)
            print("hint: `duplex models` shows what is missing and how to fix it", file=sys.stderr)
            return 2
        server = InProcessServer(service)
        try:
            url = server.start()
        except BenchError as exc:
            print(f"duplex bench: {exc}", file=sys.stderr)
            service.close()
            return 2
        audiosocket = audiosocket or server.audiosocket
        print(f"duplex bench: serving on {url} (in-process; for clean timings run `duplex serve` separately)")
    try:
        if transports:
            return _bench_transports(url, transports, audiosocket, args, tones)
        result = asyncio.run(run_bench(url, args.turns, args.barge_ins, out_dir=args.out,
                                       session_options=options))
    except BenchError as exc:
        print(f"duplex bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("duplex bench: interrupted", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()
        if service is not None:
            service.close()
    print()
    print(format_table(result))
    print(f"\nwrote {Path(args.out) / 'bench.json'} and {Path(args.out) / 'bench.png'}")
    s = result["summary"]
    return 1 if (s["turns_failed"] or s["barge_ins_failed"] or s["leaked_frames_total"]) else 0


def _transports(value: str | None) -> list[str] | None:
    """--transport: None/'' -> [] (the classic bench); 'all' or a comma list; None when invalid."""
    from duplex.bench.transport import TRANSPORTS

    if not value:
        return []
    names = list(TRANSPORTS) if value == "all" else [v.strip() for v in value.split(",") if v.strip()]
    if not names or any(n not in TRANSPORTS for n in names):
        return None
    if len(names) > 1 and "native" not in names:
        names.insert(0, "native")  # the baseline the adapters are compared with
    return list(dict.fromkeys(names))


def _bench_transports(url: str, transports: list[str], audiosocket: tuple[str, int] | None,
                      args: argparse.Namespace, tones: bool) -> int:
    from duplex.bench.transport import (
        format_transport_table,
        plot_transport_results,
        run_transport_bench,
        synthesise_prompts,
        write_transport_outputs,
    )

    base = url.split("/v1/", 1)[0]
    prompts = list(QUESTIONS[: max(1, args.turns)])
    if tones:
        from duplex.testing.fakes import tone_speech

        prompts = ["what is the capital of france", "what is two plus two", "hello how are you"]
        speech = {p: tone_speech(p) for p in prompts}
    else:
        print("loading hibari for the prompts ...", flush=True)
        speech = synthesise_prompts(prompts, HibariSynth())
    rounds = max(1, args.rounds)
    result = asyncio.run(run_transport_bench(base, transports, prompts, speech, audiosocket=audiosocket, rounds=rounds))
    result["settings"] = {"url": url, "transports": transports, "prompts": prompts, "rounds": rounds,
                          "tones": tones, "audiosocket": audiosocket, "started_at": time.time()}
    path = write_transport_outputs(result, args.out)
    png = plot_transport_results(result, Path(args.out) / "bench-transport.png")
    print()
    print(format_transport_table(result))
    print(f"\nwrote {path} and {png}")
    return 1 if any(row["failed"] for row in result["transports"].values()) else 0
