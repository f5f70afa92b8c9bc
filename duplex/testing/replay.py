"""Replay a whole conversation through a SessionCore on a fake clock, faster than real time and
deterministically: audio in at its own pace, each job's result returned after a scripted cost."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from codec.pcm import pcm16_to_float
from duplex.core.jobs import Job
from duplex.core.session import SR, SessionCore


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Timed:
    t: float
    item: Any  # a ServerEvent or bytes (a PCM16 audio frame)


@dataclass
class ReplayResult:
    outputs: list[Timed]
    core: SessionCore

    def events(self, type_: str | None = None) -> list[Any]:
        return [
            o.item
            for o in self.outputs
            if not isinstance(o.item, bytes) and (type_ is None or o.item.type == type_)
        ]

    def audio_frames(self) -> list[Timed]:
        return [o for o in self.outputs if isinstance(o.item, bytes)]

    def audio(self, t0: float = 0.0, t1: float = float("inf")) -> np.ndarray:
        return pcm16_to_float(b"".join(o.item for o in self.audio_frames() if t0 <= o.t < t1))


def replay(
    core: SessionCore,
    clock: FakeClock,
    audio: np.ndarray,
    costs: dict[str, float] | None = None,
    frame_seconds: float = 0.02,
    tail_seconds: float = 3.0,
    controls: Sequence[tuple[float, dict[str, Any]]] = (),
) -> ReplayResult:
    """Feed `audio` (16 kHz) in real-time frames on the fake clock; jobs take `costs[label]` s.

    Stage jobs run when their simulated compute time has elapsed (unlimited parallelism, so
    the outcome depends only on the costs). Returns every output with its time.
    """
    costs = costs or {}
    frame = int(SR * frame_seconds)
    n_frames = (len(audio) + frame - 1) // frame
    end_t = n_frames * frame_seconds + tail_seconds
    seq = itertools.count()
    queue: list[tuple[float, int, str, Any]] = []
    for i in range(n_frames):
        heapq.heappush(queue, (i * frame_seconds, next(seq), "audio", audio[i * frame : (i + 1) * frame]))
    for t, ev in controls:
        heapq.heappush(queue, (t, next(seq), "control", ev))
    outputs: list[Timed] = []
    stage_by_name = {
        "vad": core.stages.vad,
        "asr": core.stages.asr,
        "llm": core.stages.llm,
        "tts": core.stages.tts,
    }
    wake_pending: set[float] = set()

    def flush() -> None:
        for job in core.take_jobs():
            heapq.heappush(queue, (clock.t + costs.get(job.label, 0.001), next(seq), "job", job))
        for item in core.take_outputs():
            outputs.append(Timed(clock.t, item))
        wake = core.next_wakeup()
        if wake is not None and wake not in wake_pending:
            wake_pending.add(wake)
            heapq.heappush(queue, (max(wake, clock.t), next(seq), "tick", wake))

    while queue:
        t, _, kind, payload = heapq.heappop(queue)
        if t > end_t:
            break
        clock.t = max(clock.t, t)
        if kind == "audio":
            core.receive_audio(payload)
        elif kind == "control":
            core.receive_control(payload)
        elif kind == "job":
            job: Job = payload
            try:
                out, state = stage_by_name[job.stage].step(job.state, job.chunk)
            except Exception as exc:  # a failing fake stage is part of what tests check
                core.on_failure(job, exc)
            else:
                core.on_result(job, out, state)
        else:
            wake_pending.discard(payload)
        core.tick()
        flush()
    return ReplayResult(outputs, core)
