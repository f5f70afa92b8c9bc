"""The streaming stage contract shared by every neural stage (VAD, ASR, LLM, TTS).

A stage is stateless code plus per-session state that the caller owns:

    state = stage.init_state()
    out, state = stage.step(state, chunk)
    results = stage.step_batch([(state_a, chunk_a), (state_b, chunk_b)])

State is a dataclass the stage defines; it is never stored on the stage object, so one
stage instance serves every session. Offline processing is `step` with one big chunk, and
each stage has a test that streaming output equals offline output for several chunk sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar, runtime_checkable

StateT = TypeVar("StateT")
InT = TypeVar("InT")
OutT = TypeVar("OutT")
# a protocol's input type variable is contravariant (a stage taking a wider input is a stage)
InT_contra = TypeVar("InT_contra", contravariant=True)
StateT_contra = TypeVar("StateT_contra", contravariant=True)


@runtime_checkable
class StreamingStage(Protocol[StateT, InT_contra, OutT]):
    """What the session core and the device executor need from a stage."""

    #: executor job kind, also the key of the stage's latency budget in models.yaml
    kind: str

    def init_state(self) -> StateT: ...

    def step(self, state: StateT, chunk: InT_contra) -> tuple[OutT, StateT]: ...

    def step_batch(self, items: Sequence[tuple[StateT, InT_contra]]) -> list[tuple[OutT, StateT]]: ...


@runtime_checkable
class IncrementalStage(Protocol[StateT_contra]):
    """A stage that may return before it has produced all its input asks for (a TTS that hands back its
    first chunk at once): `pending(state)` is True while more is owed, and the core steps it again, with an
    empty input, until it is not."""

    def pending(self, state: StateT_contra) -> bool: ...


@runtime_checkable
class RestartableStage(Protocol[StateT]):
    """A segment stage that can start over on the whole input yet keep what an earlier state learnt (an ASR
    whose final re-reads the segment from a fresh state but uses the partials' transcript as a draft)."""

    def restart_state(self, state: StateT) -> StateT: ...


class SequentialBatchMixin(Generic[StateT, InT, OutT]):
    """`step_batch` for stages whose model has no batched kernel yet: steps sessions in turn.

    Stages with a real batched kernel (for example the VAD) override `step_batch`.
    """

    def step(self, state: StateT, chunk: InT) -> tuple[OutT, StateT]:  # pragma: no cover
        raise NotImplementedError

    def step_batch(self, items: Sequence[tuple[StateT, InT]]) -> list[tuple[OutT, StateT]]:
        return [self.step(state, chunk) for state, chunk in items]
