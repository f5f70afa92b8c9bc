"""A job: one step of one stage for one session, as the session core asks for it.

The core only builds jobs and reads their results; the device executor (duplex.runtime.executor)
runs them, and resolves `future` with (out, new_state) or the stage's exception.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    """One step of one stage for one session."""

    stage: str  # which registered stage runs it (also the batching key)
    label: str  # budget label, e.g. "asr.partial"; overruns are counted per label
    session_id: str
    turn_id: int
    state: Any
    chunk: Any
    deadline: float  # executor clock time by which it should be done
    submitted: float = 0.0
    tag: Any = None  # opaque to the executor; the session core uses it to match results
    future: Future[tuple[Any, Any]] = field(default_factory=Future)
