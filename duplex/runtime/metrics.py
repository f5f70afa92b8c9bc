"""Prometheus metrics of one service (`GET /metrics`), in a registry of its own.

Counted where things happen: the runner reports every event a session sends (`observe_event`),
the executor every batch it runs (`observe_batch`) and every stage failure (`observe_failure`),
the transports every refusal (`refused`) and limit hit (`limit_hit`).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from duplex.core.events import (
    ErrorEvent,
    Interrupted,
    ResponseDone,
    ServerEvent,
    SpeechStarted,
    TurnLatency,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
_STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 10.0)


class Metrics:
    """Every metric the service exports; `render()` is the /metrics body."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.sessions_active = Gauge("duplex_sessions_active", "sessions open now", registry=r)
        self.sessions = Counter("duplex_sessions", "sessions opened", ["transport"], registry=r)
        self.refused = Counter(
            "duplex_connections_refused", "connections refused before a session", ["reason"], registry=r
        )
        self.limit_hits = Counter("duplex_limit_hits", "limits a client ran into", ["limit"], registry=r)
        self.turns = Counter("duplex_turns", "user turns (speech or text) that ended", registry=r)
        self.responses = Counter("duplex_responses", "answers by final status", ["status"], registry=r)
        self.onset = Histogram(
            "duplex_onset_seconds",
            "end of the user's speech to the answer's first audio",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.barge_in = Histogram(
            "duplex_barge_in_seconds",
            "user speech over an answer to the answer being stopped",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_run = Histogram(
            "duplex_stage_run_seconds",
            "worker time of one stage batch, per budget label",
            ["label"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.stage_wait = Histogram(
            "duplex_stage_wait_seconds",
            "queue wait of a stage job, per budget label",
            ["label"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.overruns = Counter(
            "duplex_budget_overruns", "stage jobs that finished after their deadline", ["label"], registry=r
        )
        self.stage_failures = Counter(
            "duplex_stage_failures", "stage jobs that failed, by kind", ["stage", "kind"], registry=r
        )
        self.worker_restarts = Counter(
            "duplex_worker_restarts", "executor worker threads replaced", ["reason"], registry=r
        )
        self.errors = Counter("duplex_errors", "error events sent to clients, by code", ["code"], registry=r)
        self.draining = Gauge("duplex_draining", "1 while the server drains for shutdown", registry=r)
        self.heap_trims = Counter("duplex_heap_trims", "times freed heap memory was given back", registry=r)
        self.heap_released = Counter(
            "duplex_heap_released_bytes", "RSS given back to the OS by heap trims", registry=r
        )
        self.heap_trim_seconds = Counter(
            "duplex_heap_trim_seconds", "time spent trimming the heap", registry=r
        )
        self.gc_passes = Counter(
            "duplex_gc_collections", "cycle-collector passes, by generation", ["generation"], registry=r
        )
        self.gc_seconds = Counter(
            "duplex_gc_pause_seconds",
            "time every thread stood still in cycle-collector passes",
            ["generation"],
            registry=r,
        )
        self.gc_longest = Gauge(
            "duplex_gc_longest_pause_seconds", "the longest cycle-collector pass so far", registry=r
        )
        self.gc_collected = Counter(
            "duplex_gc_collected_objects",
            "objects the cycle collector freed (memory in reference cycles)",
            registry=r,
        )
        self._speech_started: dict[str, float] = {}
        self._gc_longest = 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- observers -------------------------------------------------------------------------

    def observe_event(self, event: ServerEvent) -> None:
        """Called for every event a session sends (on the event loop)."""
        if isinstance(event, ErrorEvent):
            self.errors.labels(event.code).inc()
        elif isinstance(event, SpeechStarted):
            self._speech_started[event.session_id] = event.t
        elif isinstance(event, TurnLatency):
            self.turns.inc()
            first_audio = event.stages.get("first_audio")
            if first_audio is not None:
                self.onset.observe(max(0.0, first_audio / 1000.0))
        elif isinstance(event, Interrupted):
            started = self._speech_started.get(event.session_id)
            if started is not None:
                self.barge_in.observe(max(0.0, event.t - started))
        elif isinstance(event, ResponseDone):
            self.responses.labels(event.status).inc()

    def session_closed(self, session_id: str) -> None:
        self._speech_started.pop(session_id, None)

    def observe_batch(self, label: str, wait_s: float, run_s: float, overrun: bool) -> None:
        """Called by the executor's workers for every job of a batch (thread-safe: prometheus-client)."""
        self.stage_run.labels(label).observe(run_s)
        self.stage_wait.labels(label).observe(max(0.0, wait_s))
        if overrun:
            self.overruns.labels(label).inc()

    def observe_failure(self, stage: str, kind: str) -> None:
        self.stage_failures.labels(stage, kind).inc()

    def observe_restart(self, reason: str) -> None:
        self.worker_restarts.labels(reason).inc()

    def observe_gc(self, generation: int, seconds: float, collected: int) -> None:
        """Called from inside the collector (any thread): one pass of `generation`."""
        self.gc_passes.labels(str(generation)).inc()
        self.gc_seconds.labels(str(generation)).inc(seconds)
        self.gc_collected.inc(collected)
        if seconds > self._gc_longest:
            self._gc_longest = seconds
            self.gc_longest.set(seconds)

    def observe_heap_trim(self, seconds: float, released_mb: float) -> None:
        self.heap_trims.inc()
        self.heap_trim_seconds.inc(seconds)
        self.heap_released.inc(released_mb * 1e6)


def sample(metrics_text: str, name: str, **labels: Any) -> float | None:
    """One sample's value from a /metrics body (for tests and the docs' examples)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # the exposition sorts labels
    prefix = f"{name}{{{want}}}" if want else name
    for line in metrics_text.splitlines():
        if line.startswith(prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    return None
