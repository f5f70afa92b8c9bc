"""Fault injection for the fault-isolation tests: a stage wrapper that fails on chosen inputs.

`FaultyStage(inner, fault, trigger)` behaves like `inner` except for chunks where `trigger(chunk)`
is true; there it raises (`raise`), raises `MemoryError` (`oom`), sleeps past any budget (`hang`),
returns corrupt output (`nan`: NaN audio or probabilities), or raises `SystemExit`, which ends
the worker thread (`die`). The tests route one session's input to the trigger and check that only
that session fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from duplex.base.messages import RespondOutput, TtsChunk
from duplex.core.stages import Stages

FAULTS = ("raise", "oom", "hang", "nan")


class FaultyStage:
    """`inner` with a fault on the chunks `trigger` picks (see the module docstring)."""

    def __init__(self, inner: Any, fault: str, trigger: Callable[[Any], bool], hang_s: float = 1.5) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.fault = fault
        self.trigger = trigger
        self.hang_s = hang_s
        self.fired = 0
        for name in ("streaming", "policy", "listens", "segmenter"):
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    def init_state(self) -> Any:
        return self.inner.init_state()

    def step(self, state: Any, chunk: Any) -> tuple[Any, Any]:
        if not self.trigger(chunk):
            return self.inner.step(state, chunk)  # type: ignore[no-any-return]
        self.fired += 1
        if self.fault == "raise":
            raise RuntimeError(f"injected failure in {self.kind}")
        if self.fault == "oom":
            raise MemoryError(f"injected out-of-memory in {self.kind}")
        if self.fault == "die":
            raise SystemExit(f"injected worker death in {self.kind}")
        if self.fault == "hang":
            time.sleep(self.hang_s)
            return self.inner.step(state, chunk)  # type: ignore[no-any-return]
        out, new_state = self.inner.step(state, chunk)
        return corrupt(self.kind, out), new_state

    def step_batch(self, items: Sequence[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
        return [self.step(state, chunk) for state, chunk in items]


def corrupt(kind: str, out: Any) -> Any:
    """What a broken model returns: NaN audio, NaN probabilities, the wrong type."""
    if kind == "vad":
        return [(end, float("nan")) for end, _ in out] or [(0, float("nan"))]
    if kind == "tts":
        return [TtsChunk(np.full(2400, np.nan, dtype=np.float32), getattr(c, "text", "")) for c in out] or [
            TtsChunk(np.full(2400, np.nan, dtype=np.float32), "")
        ]
    if kind == "llm":
        return RespondOutput(text=None, done=True)  # type: ignore[arg-type]
    return float("nan")  # asr: not an AsrResult


def loud(chunk: Any) -> bool:
    """Audio (or an ASR chunk's audio) louder than tone speech: the victim session's marker."""
    samples = getattr(chunk, "samples", chunk)
    a = np.asarray(samples)
    return bool(a.size) and float(np.abs(a).max()) > 0.8


def asks(word: str) -> Callable[[Any], bool]:
    """An LLM step whose conversation's last user message contains `word`."""

    def trigger(chunk: Any) -> bool:
        messages = getattr(chunk, "messages", None) or []
        users = [m for m in messages if m.get("role") == "user"]
        return bool(users) and word in str(users[-1].get("content", ""))

    return trigger


def says(word: str) -> Callable[[Any], bool]:
    """A TTS input containing `word`."""
    return lambda chunk: word in str(getattr(chunk, "text", ""))


def with_fault(stages: Stages, stage: str, fault: str, trigger: Callable[[Any], bool], **kw: Any) -> Stages:
    """`stages` with one of them wrapped in a `FaultyStage`."""
    import dataclasses

    return dataclasses.replace(stages, **{stage: FaultyStage(getattr(stages, stage), fault, trigger, **kw)})
