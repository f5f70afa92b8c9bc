"""A test harness that ships with the package: tiny deterministic stages and a replay driver.

"Tone speech" stands in for speech in unit tests: every word of a small vocabulary is a 200 ms
sine at its own frequency, so a fake ASR can decode words from audio and a test can decode what
the bot *said* from the audio it sent. `replay()` runs a `SessionCore` against a fake clock as a
discrete-event simulation: a whole conversation replays deterministically, faster than real time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplex.base.messages import (
    AsrChunk,
    AsrResult,
    ListenOutput,
    ListenStep,
    OverlapOutput,
    OverlapStep,
    RespondOutput,
    RespondStep,
    TtsChunk,
    TtsInput,
    Word,
)
from duplex.base.stage import SequentialBatchMixin
from duplex.base.turn_policy import TurnPolicy
from duplex.core.session import SR
from duplex.core.stages import Stages

VOCAB = (
    "what is the capital of france paris yes no stop two plus four hello how are you "
    "fine thanks tell me a story once upon time there was cat i am and it very good"
).split()
WORD_SECONDS = 0.2
GAP_SECONDS = 0.05
OUT_SR = 24000


def word_freq(word: str) -> float:
    return 300.0 + 40.0 * VOCAB.index(word)


def tone_speech(text: str, sr: int = SR, amplitude: float = 0.3) -> np.ndarray:
    """Words as tones separated by short gaps (a pause inside a turn is explicit silence)."""
    parts: list[np.ndarray] = []
    t = np.arange(int(sr * WORD_SECONDS)) / sr
    gap = np.zeros(int(sr * GAP_SECONDS), dtype=np.float32)
    for word in text.lower().split():
        parts.append((amplitude * np.sin(2 * np.pi * word_freq(word) * t)).astype(np.float32))
        parts.append(gap)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def decode_tones(audio: np.ndarray, sr: int) -> list[str]:
    """Inverse of tone_speech: loud runs of 10 ms frames -> nearest vocabulary frequency."""
    return [w for w, _, _ in decode_tone_words(audio, sr)]


def decode_tone_words(audio: np.ndarray, sr: int, tonal_only: bool = False) -> list[tuple[str, float, float]]:
    """Words of tone speech with their start and end in seconds. With `tonal_only`, a loud frame
    counts only if one frequency dominates it, so noise is heard as no word at all (as a real
    recogniser hears a hum or a noisy room)."""
    hop = sr // 100
    n = len(audio) // hop
    if n == 0:
        return []
    frames = audio[: n * hop].reshape(n, hop)
    loud = np.sqrt((frames**2).mean(axis=1)) > 0.02
    if tonal_only:
        spectra = np.abs(np.fft.rfft(frames * np.hanning(hop), axis=1))
        loud &= spectra.max(axis=1) > 8.0 * spectra.mean(axis=1)
    words: list[tuple[str, float, float]] = []
    i = 0
    while i < n:
        if not loud[i]:
            i += 1
            continue
        j = i
        while j < n and loud[j]:
            j += 1
        if j - i >= 5:  # at least 50 ms: a (possibly cut) word
            seg = audio[i * hop : j * hop]
            spectrum = np.abs(np.fft.rfft(seg * np.hanning(len(seg))))
            freq = float(np.argmax(spectrum)) * sr / len(seg)
            k = int(round((freq - 300.0) / 40.0))
            if 0 <= k < len(VOCAB):
                words.append((VOCAB[k], i * hop / sr, j * hop / sr))
        i = j
    return words


# -- tiny stages -------------------------------------------------------------------------


@dataclass
class EnergyVadState:
    leftover: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    consumed: int = 0


class EnergyVad(SequentialBatchMixin[EnergyVadState, np.ndarray, list[tuple[int, float]]]):
    """512-sample windows, P(speech) = 1 when the RMS is above a floor."""

    kind = "vad"

    def init_state(self) -> EnergyVadState:
        return EnergyVadState()

    def step(
        self, state: EnergyVadState, chunk: np.ndarray
    ) -> tuple[list[tuple[int, float]], EnergyVadState]:
        buf = np.concatenate([state.leftover, chunk])
        out: list[tuple[int, float]] = []
        pos = 0
        while len(buf) - pos >= 512:
            w = buf[pos : pos + 512]
            pos += 512
            end = state.consumed + 512
            state = EnergyVadState(state.leftover, end)
            out.append((end, 1.0 if float(np.sqrt((w**2).mean())) > 0.02 else 0.0))
        return out, EnergyVadState(buf[pos:].copy(), state.consumed)


@dataclass
class ToneAsrState:
    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))


class ToneAsr(SequentialBatchMixin[ToneAsrState, AsrChunk, AsrResult | None]):
    """Decodes `tone_speech`; `voice_fn` scripts the acoustic end-of-turn cue from the words heard
    (P(complete) as `AsrResult.p_complete`; None: no cue, as without one)."""

    kind = "asr"
    voice_fn: Callable[[str], float | None] | None = None  # (a class default: subclasses need no super())

    def __init__(self, voice_fn: Callable[[str], float | None] | None = None) -> None:
        self.voice_fn = voice_fn

    def init_state(self) -> ToneAsrState:
        return ToneAsrState()

    def step(self, state: ToneAsrState, chunk: AsrChunk) -> tuple[AsrResult | None, ToneAsrState]:
        audio = np.concatenate([state.audio, chunk.samples])
        new = ToneAsrState(audio)
        if not chunk.transcribe:
            return None, new
        text = " ".join(decode_tones(audio, SR))
        p_complete = self.voice_fn(text) if self.voice_fn is not None else None
        return AsrResult(text, chunk.final, len(audio) / SR, p_complete=p_complete), new


class ToneStreamingAsr(ToneAsr):
    """A streaming ASR for tone speech, shaped like asr.nemo_streaming's output: words with times and
    the decoder's end-of-utterance signal (`eou` once `eou_silence_ms` with no word follows the last
    one). Noise is no word (`decode_tone_words(tonal_only=True)`), and the decoder only sees audio up
    to the last complete chunk, as a cache-aware model does."""

    streaming = True

    def __init__(self, eou_silence_ms: float = 640.0, chunk_ms: float = 160.0) -> None:
        self.eou_s = eou_silence_ms / 1000
        self.chunk = int(SR * chunk_ms / 1000)

    def step(self, state: ToneAsrState, chunk: AsrChunk) -> tuple[AsrResult | None, ToneAsrState]:
        audio = np.concatenate([state.audio, chunk.samples])
        new = ToneAsrState(audio)
        if not chunk.transcribe:
            return None, new
        seen = audio if chunk.final else audio[: len(audio) // self.chunk * self.chunk]
        words = tuple(Word(w, a, b) for w, a, b in decode_tone_words(seen, SR, tonal_only=True))
        trailing = len(seen) / SR - (words[-1].end if words else 0.0)
        return AsrResult(
            " ".join(w.word for w in words),
            chunk.final,
            len(audio) / SR,
            words=words,
            eou=bool(words) and trailing >= self.eou_s,
            trailing_silence_ms=round(1000 * trailing, 1),
            no_words=not words and trailing >= self.eou_s,
            heard_seconds=len(seen) / SR,
        ), new


@dataclass
class ScriptedLlmState:
    context: list[dict[str, str]] = field(default_factory=list)
    reply: list[str] = field(default_factory=list)
    pos: int = 0
    prompts: int = 0  # how many times a prompt was (re)built: the test checks context handling


class ScriptedLlm(SequentialBatchMixin[ScriptedLlmState, RespondStep, RespondOutput]):
    """Replies with `reply_fn(history)` one word per token; records the context it was given."""

    kind = "llm"

    def __init__(self, reply_fn: Callable[[list[dict[str, str]]], str]) -> None:
        self.reply_fn = reply_fn
        self.seen: list[list[dict[str, str]]] = []  # every prompt, for assertions

    def init_state(self) -> ScriptedLlmState:
        return ScriptedLlmState()

    def step(self, state: ScriptedLlmState, chunk: RespondStep) -> tuple[RespondOutput, ScriptedLlmState]:
        if chunk.messages is not None:
            msgs = [dict(m) for m in chunk.messages]
            self.seen.append(msgs)
            state = ScriptedLlmState(msgs, self.reply_fn(msgs).split(), 0, state.prompts + 1)
        words = state.reply[state.pos : state.pos + chunk.max_tokens]
        pos = state.pos + len(words)
        text = "".join((" " if (state.pos + i) else "") + w for i, w in enumerate(words))
        new = ScriptedLlmState(state.context, state.reply, pos, state.prompts)
        return RespondOutput(text, pos >= len(state.reply), len(words)), new


@dataclass
class ToneTtsState:
    pending: str = ""


class ToneTts(SequentialBatchMixin[ToneTtsState, TtsInput, list[TtsChunk]]):
    """Speaks each complete word as a tone at 24 kHz, one chunk per word."""

    kind = "tts"

    def init_state(self) -> ToneTtsState:
        return ToneTtsState()

    def step(self, state: ToneTtsState, chunk: TtsInput) -> tuple[list[TtsChunk], ToneTtsState]:
        text = state.pending + chunk.text
        if chunk.final:
            ready, rest = text, ""
        else:
            cut = text.rfind(" ")
            ready, rest = (text[:cut], text[cut:]) if cut >= 0 else ("", text)
        chunks = [TtsChunk(tone_speech(w, OUT_SR), w) for w in ready.split() if w in VOCAB]
        return chunks, ToneTtsState(rest)


@dataclass
class OwingToneTtsState:
    pending: str = ""
    owed: tuple[TtsChunk, ...] = ()


class OwingToneTts(SequentialBatchMixin[OwingToneTtsState, TtsInput, list[TtsChunk]]):
    """ToneTts that hands back one chunk per call and owes the rest (`IncrementalStage`), as the flow voice
    does with `chunks_per_call`; `whole` inputs are spoken in one call."""

    kind = "tts"

    def __init__(self) -> None:
        self.tones = ToneTts()
        self.calls = 0

    def init_state(self) -> OwingToneTtsState:
        return OwingToneTtsState()

    def pending(self, state: OwingToneTtsState) -> bool:
        return bool(state.owed)

    def step(self, state: OwingToneTtsState, chunk: TtsInput) -> tuple[list[TtsChunk], OwingToneTtsState]:
        self.calls += 1
        new, rest = self.tones.step(ToneTtsState(state.pending), chunk)
        owed = [*state.owed, *new]
        n = len(owed) if chunk.whole else 1
        return owed[:n], OwingToneTtsState(rest.pending, tuple(owed[n:]))


def scripted_answer(history: list[dict[str, str]]) -> str:
    """A reply function for ScriptedLlm: Paris for capitals, a long story on request, else small talk."""
    last = history[-1]["content"]
    if "capital" in last:
        return "paris is the capital of france"
    if "two plus two" in last:
        return "two plus two is four"
    if "story" in last:
        return "once upon a time there was a cat and it was very very good " * 4
    return "i am fine thanks"


def fake_stages(reply_fn: Callable[[list[dict[str, str]]], str]) -> Stages:
    """The tiny deterministic stage set used by the session-core tests."""
    return Stages(
        vad=EnergyVad(),
        asr=ToneAsr(),
        llm=ScriptedLlm(reply_fn),
        tts=ToneTts(),
    )


# -- learned turn-taking, scripted ------------------------------------------------------------

#: words that end a complete thought in tone speech (the scripted turn head's rule)
FINAL_WORDS = frozenset("france paris you four story good fine thanks hello time cat".split())
#: what a listener says without taking the turn (tone speech has "yes")
BACKCHANNEL_WORDS = frozenset({"yes"})


def scripted_turn(text: str) -> tuple[float, float, float]:
    """P(listen, backchannel, speak): complete if the last word ends a thought; a long turn that
    stops after "and" invites a backchannel; anything else is mid-sentence."""
    words = text.lower().split()
    if words and words[-1] in FINAL_WORDS:
        return (0.05, 0.05, 0.9)
    if len(words) >= 6 and words[-1] == "and":
        return (0.2, 0.7, 0.1)
    return (0.9, 0.05, 0.05)


def scripted_overlap(text: str) -> float:
    """P(interruption) of speech heard while the service spoke."""
    words = text.lower().split()
    return 0.05 if words and all(w in BACKCHANNEL_WORDS for w in words) else 0.95


class ScriptedTurnLlm(ScriptedLlm):
    """ScriptedLlm that also listens (scripted turn head) and classifies overlapping speech."""

    def __init__(
        self,
        reply_fn: Callable[[list[dict[str, str]]], str],
        turn_fn: Callable[[str], tuple[float, float, float]] = scripted_turn,
        overlap_fn: Callable[[str], float] = scripted_overlap,
    ) -> None:
        super().__init__(reply_fn)
        self.turn_fn = turn_fn
        self.overlap_fn = overlap_fn
        self.listened: list[str] = []  # every text the turn head saw, in order
        self.relays: list[bool] = []  # the relay flag of every answer
        self.relay_checks: list[str | None] = []  # ... and how its draft is checked

    def step(self, state: ScriptedLlmState, chunk: Any) -> tuple[Any, ScriptedLlmState]:
        if isinstance(chunk, ListenStep):
            self.listened.append(chunk.text)
            return ListenOutput(self.turn_fn(chunk.text)), state
        if isinstance(chunk, OverlapStep):
            p = self.overlap_fn(chunk.text)
            return OverlapOutput(p, p >= 0.5), state
        if chunk.messages is not None:
            self.relays.append(chunk.relay)
            self.relay_checks.append(chunk.relay_check)
        return super().step(state, chunk)


def fake_turn_stages(
    reply_fn: Callable[[list[dict[str, str]]], str],
    turn_fn: Callable[[str], tuple[float, float, float]] = scripted_turn,
    overlap_fn: Callable[[str], float] = scripted_overlap,
    asr: ToneAsr | None = None,
) -> Stages:
    """fake_stages with learned turn-taking switched on (scripted heads)."""
    return Stages(
        vad=EnergyVad(),
        asr=asr or ToneAsr(),
        llm=ScriptedTurnLlm(reply_fn, turn_fn, overlap_fn),
        tts=ToneTts(),
        asr_streaming=isinstance(asr, ToneStreamingAsr),
        policy=TurnPolicy(speak_threshold=0.5, backchannel_threshold=0.5),
        backchannel_text="yes",
    )


@dataclass
class CounterState:
    total: int = 0
    steps: int = 0


class CounterStage(SequentialBatchMixin[CounterState, Any, int]):
    """A stage for the stage-process tests: adds each integer chunk to its state's total and returns the
    total. The chunks "raise", "exit" and "unpicklable" make it raise, end its process, or raise an
    exception that cannot be pickled; "pid" returns its process id."""

    kind = "counter"

    def __init__(self, start: int = 0) -> None:
        self.start = start
        self.listens = True

    def init_state(self) -> CounterState:
        return CounterState(self.start)

    def step(self, state: CounterState, chunk: Any) -> tuple[int, CounterState]:
        if chunk == "raise":
            raise ValueError("the counter was asked to fail")
        if chunk == "exit":
            os._exit(3)
        if chunk == "unpicklable":
            raise _Unpicklable(lambda: None)
        if chunk == "pid":
            return os.getpid(), state
        state.total += int(chunk)  # in place, as the dialogue engine updates its caches
        state.steps += 1
        return state.total, state


class _Unpicklable(Exception):
    def __init__(self, fn: Callable[[], None]) -> None:
        super().__init__("holds a lambda")
        self.fn = fn


def counter_stage(start: int = 0, fail_to_load: bool = False) -> CounterStage:
    """The factory a StageProcess test spawns (module-level, so the child can import it)."""
    if fail_to_load:
        raise RuntimeError("the counter's weights are missing")
    return CounterStage(start)
