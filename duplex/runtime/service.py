"""The service: one profile's stages, one device executor, and the sessions sharing them.

It also owns what is shared by every transport: the limits (`ServiceLimits`), the metrics, the
runners of open sessions (a drain ends them) and the draining flag (`/readyz`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from duplex.base.config import Profile, SessionOptions, load_profile
from duplex.base.limits import CLOSE_GOING_AWAY, SERVER_SHUTDOWN, ServerLimits
from duplex.base.messages import (
    AsrChunk,
    AsrResult,
    ListenOutput,
    ListenStep,
    OverlapOutput,
    RespondOutput,
    RespondStep,
    TtsInput,
)
from duplex.core.session import SR, SessionCore
from duplex.core.stages import Stages
from duplex.runtime.executor import DeviceExecutor
from duplex.runtime.heap import GcPauses, HeapTrimmer, freeze_loaded
from duplex.runtime.metrics import Metrics
from duplex.runtime.openmp import loading_without_pools
from duplex.runtime.runner import SessionRunner
from duplex.runtime.stage_process import StageProcess, by_name
from tts.loading import BACKENDS as TTS_BACKENDS

log = logging.getLogger("duplex.runtime.service")


class CapacityError(RuntimeError):
    """The service already holds its maximum number of sessions."""


def build_stages(profile: Profile, progress: bool = True, llm_process: StageProcess | None = None) -> Stages:
    """Load the real stages a profile names (this imports the model packages). With `llm_process` (started
    by `start_llm_process`) the dialogue engine is the one that process loads meanwhile."""
    from asr.vad import load_vad_stage
    from tts.loading import load_tts

    backends = {name: c.backend for name, c in profile.components.items()}
    expected = {
        "vad": ("silero-onnx",),
        "asr": ("moonshine", "moonshine-stream", "nemo-streaming"),
        "llm": ("transformers-gguf", "openai-chat"),
        "tts": TTS_BACKENDS,
        "drafter": ("transformers-gguf",),
    }
    for name, backend in expected.items():
        if backends.get(name) is not None and backends.get(name) not in backend:
            raise ValueError(
                f"profile {profile.name!r}: {name} backend {backends.get(name)!r} is not available "
                f"in this build (known: {backend})"
            )
    t0 = time.perf_counter()
    vad = load_vad_stage(profile.component("vad"))
    asr = load_asr(profile.component("asr"))
    tts = load_tts(profile.component("tts"))
    if llm_process is not None:
        llm: Any = llm_process.wait_ready()
    else:
        from dialogue.engine import load_dialogue_stage

        llm = load_dialogue_stage(
            profile.component("llm"), profile.components.get("drafter"), progress=progress
        )
    log.info("stages loaded in %.1f s", time.perf_counter() - t0)
    return Stages(
        vad=vad,
        asr=asr,
        llm=llm,
        tts=tts,
        asr_streaming=asr.streaming,
        policy=llm.policy if llm.listens else None,
        # the first step decodes until the TTS can speak (its first phrase), not a fixed token count
        phrase_words=int(tts.segmenter.first_phrase_words),
    )


def start_llm_process(profile: Profile, progress: bool = True) -> StageProcess:
    """Start loading the profile's dialogue engine in a process of its own (`limits.llm_process`): its steps
    then no longer wait for the event loop's GIL (duplex/runtime/stage_process.py)."""
    return StageProcess(
        by_name,
        ("dialogue.engine:load_dialogue_stage", profile.component("llm"), profile.components.get("drafter")),
        {"progress": progress},
        name="llm",
    )


def load_asr(cfg: Any) -> Any:
    """The ASR stage for a models.yaml `asr` component; NeMo is imported only for nemo-streaming."""
    if cfg.backend == "moonshine-stream":
        from asr.moonshine_stream_stage import load_moonshine_stream_stage

        return load_moonshine_stream_stage(cfg)
    if cfg.backend == "nemo-streaming":
        from asr.nemo_streaming import load_streaming_asr_stage

        return load_streaming_asr_stage(cfg)
    from asr.moonshine import load_asr_stage

    return load_asr_stage(cfg)


def _asyncio_tasks() -> int | None:
    """Tasks alive on the running event loop (a soak watches it for leaks); None off the loop."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return None


def warm_up(stages: Stages) -> dict[str, float]:
    """Run each stage once so the first user does not pay for lazy initialisation."""
    times: dict[str, float] = {}
    t = time.perf_counter()
    stages.vad.step(stages.vad.init_state(), np.zeros(SR // 2, dtype=np.float32))
    times["vad"] = time.perf_counter() - t
    t = time.perf_counter()
    noise = (0.01 * np.random.default_rng(0).standard_normal(SR)).astype(np.float32)
    stages.asr.step(stages.asr.init_state(), AsrChunk(noise, transcribe=True, final=True))
    times["asr"] = time.perf_counter() - t
    t = time.perf_counter()
    state = stages.llm.init_state()
    if stages.policy is not None:
        stages.llm.step(state, ListenStep([], "Hi there", True, None))
    stages.llm.step(state, RespondStep([{"role": "user", "content": "Hi there."}], 2))
    times["llm"] = time.perf_counter() - t
    t = time.perf_counter()
    stages.tts.step(stages.tts.init_state(), TtsInput("Hello there.", True))
    times["tts"] = time.perf_counter() - t
    return times


def _torch_stages(profile: Profile) -> bool:
    """Whether the profile's VAD, ASR or TTS run on torch (the streaming Conformer, the own voice)."""
    asr = profile.component("asr").backend
    return asr in ("nemo-streaming", "moonshine-stream") or profile.component("tts").backend == "flow"


def _children_usage(proc: Any) -> dict[str, float]:
    """RSS and peak RSS (bytes) and CPU seconds of this process's children (the model process), summed."""
    rss = peak = 0
    user = system = 0.0
    for child in proc.children():
        try:
            rss += child.memory_info().rss
            times = child.cpu_times()
            user, system = user + times.user, system + times.system
            with open(f"/proc/{child.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue  # it exited meanwhile
    return {"rss": rss, "peak": peak, "user": user, "system": system}


@dataclass(frozen=True)
class ServiceLimits(ServerLimits):
    """The server's limits (`duplex.base.limits.ServerLimits`, `bulk_workers` included), as the service
    takes them."""


# -- output checks: a stage result that would poison a session fails that job instead ----------


def _finite(x: Any, what: str) -> None:
    a = np.asarray(x)
    if a.size and (a.dtype.kind not in "fiu" or not np.isfinite(a).all()):
        raise ValueError(f"{what} has non-finite values")


def check_vad(out: Any) -> None:
    for _, p in out:
        if not (isinstance(p, (int, float, np.floating)) and 0.0 <= float(p) <= 1.0):
            raise ValueError(f"speech probability {p!r} is not in [0, 1]")


def check_asr(out: Any) -> None:
    if out is not None and (not isinstance(out, AsrResult) or not isinstance(out.text, (str, type(None)))):
        raise ValueError(f"not an AsrResult: {type(out).__name__}")


def check_llm(out: Any) -> None:
    if isinstance(out, RespondOutput):
        if not isinstance(out.text, str):
            raise ValueError("respond text is not a string")
    elif isinstance(out, ListenOutput):
        if len(out.probs) != 3 or not all(math.isfinite(p) for p in out.probs):
            raise ValueError(f"turn probabilities {out.probs!r} are not finite")
    elif isinstance(out, OverlapOutput):
        if not math.isfinite(out.p_interrupt):
            raise ValueError("overlap probability is not finite")


def check_tts(out: Any) -> None:
    for chunk in out:
        _finite(chunk.audio, "TTS audio")


STAGE_CHECKS: dict[str, Callable[[Any], None]] = {
    "vad": check_vad,
    "asr": check_asr,
    "llm": check_llm,
    "tts": check_tts,
}


class DuplexService:
    """Owns the stages and the executor; creates session cores for transports."""

    def __init__(
        self,
        profile: Profile,
        stages: Stages,
        *,
        limits: ServiceLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.profile = profile
        self.stages = stages
        self.limits = limits or ServiceLimits()
        self.capacity_source = "configured"
        if self.limits.max_sessions_auto:
            from duplex.runtime.capacity import resolve_max_sessions

            n, self.capacity_source = resolve_max_sessions(profile.name)
            self.limits = dataclasses.replace(self.limits, max_sessions=n)
        self.clock = clock
        self.metrics = Metrics()
        # limits.engine_lane: an engine in its own process gets a lane of its own, so that TTS chunks and
        # transcriptions run here while it computes there instead of waiting behind its step (off by default)
        remote = ("llm",) if self.limits.engine_lane and isinstance(stages.llm, StageProcess) else ()
        self.executor = DeviceExecutor(
            bulk_workers=self.limits.bulk_workers,
            remote_stages=remote,
            remote_workers=self.limits.bulk_workers,
            clock=clock,
            stage_timeout_s=self.limits.stage_timeout_s,
            on_batch=self.metrics.observe_batch,
            on_failure=self.metrics.observe_failure,
            on_restart=self.metrics.observe_restart,
            gather_ms={"llm": self.limits.llm_gather_ms},
        )
        for stage_name in ("vad", "asr", "llm", "tts"):
            self.executor.register(
                getattr(stages, stage_name), name=stage_name, check=STAGE_CHECKS[stage_name]
            )
        self.sessions: dict[str, SessionCore] = {}
        self.runners: dict[str, SessionRunner] = {}
        self.heap = HeapTrimmer(self.limits.heap_trim_s, on_trim=self.metrics.observe_heap_trim)
        self.heap.start()
        self.gc_pauses = GcPauses(self.metrics.observe_gc)
        self.gc_pauses.install()
        self.started = time.time()
        self.sessions_total = 0
        self.draining = False
        self._llm_tokens_closed = 0  # LLM tokens generated by sessions already closed

    @classmethod
    def load(
        cls,
        profile_name: str | None = None,
        *,
        progress: bool = True,
        warm: bool = True,
        limits: ServiceLimits | None = None,
    ) -> DuplexService:
        profile = load_profile(profile_name)
        # the stages run on the executor's threads: OpenMP pools left on the loading threads would make
        # every torch parallel region there wait on a futex (duplex/runtime/openmp.py)
        llm_process = None
        if (limits or ServiceLimits()).llm_process:
            llm_process = start_llm_process(profile, progress=progress)
        try:
            # with the engine in its own process, a profile whose other stages are ONNX never imports torch here
            with loading_without_pools(import_torch=llm_process is None or _torch_stages(profile)):
                stages = build_stages(profile, progress=progress, llm_process=llm_process)
                if warm:
                    log.info("warm-up: %s", {k: round(v, 3) for k, v in warm_up(stages).items()})
        except BaseException:
            if llm_process is not None:
                llm_process.close()
            raise
        if llm_process is not None:
            llm_process.disconnect()  # the warm-up's thread there ends; the executor's workers connect anew
        t0 = time.perf_counter()
        frozen = freeze_loaded()
        log.info(
            "gc: %d objects alive after loading frozen in %.0f ms", frozen, 1000 * (time.perf_counter() - t0)
        )
        return cls(profile, stages, limits=limits)

    def full(self) -> bool:
        return len(self.sessions) >= self.limits.max_sessions

    def ready(self) -> bool:
        """Whether a load balancer should send new sessions here (`/readyz`)."""
        return not self.draining and not self.full()

    def attach(self, runner: SessionRunner, transport: str) -> None:
        """Register a started session's runner (for drain and metrics)."""
        self.runners[runner.core.session_id] = runner
        self.metrics.sessions.labels(transport).inc()
        self.metrics.sessions_active.set(len(self.sessions))

    def answering(self) -> int:
        """Sessions with an answer in progress."""
        return sum(1 for r in self.runners.values() if r.answering())

    async def drain(self, deadline_s: float, poll_s: float = 0.05) -> None:
        """Stop taking sessions, let answers in progress finish (up to `deadline_s`), then end every
        session with 1001 "going away" and wait (briefly) for them to close."""
        self.draining = True
        self.metrics.draining.set(1)
        loop = asyncio.get_running_loop()
        until = loop.time() + deadline_s
        # answers end in many places of many cores: a 50 ms poll is simpler than an event per core
        while self.answering() and loop.time() < until:  # noqa: ASYNC110
            await asyncio.sleep(poll_s)
        left = self.answering()
        log.info(
            "drain: %s; closing %d sessions",
            "answers finished" if not left else f"{left} cut off",
            len(self.runners),
        )
        for runner in list(self.runners.values()):
            runner.end(
                CLOSE_GOING_AWAY,
                "server shutting down",
                SERVER_SHUTDOWN,
                "the server is shutting down; reconnect to another instance",
            )
        close_until = loop.time() + 5.0
        while self.sessions and loop.time() < close_until:  # noqa: ASYNC110 (as above)
            await asyncio.sleep(poll_s)

    def open_session(self, options: SessionOptions | None = None) -> SessionCore:
        if self.draining:
            raise CapacityError("server is shutting down")
        if self.full():
            raise CapacityError(f"server is at capacity ({self.limits.max_sessions} sessions)")
        session_id = uuid.uuid4().hex[:12]
        core = SessionCore(session_id, self.profile, self.stages, self.clock, options=options)
        self.sessions[session_id] = core
        self.sessions_total += 1
        return core

    def close_session(self, session_id: str) -> None:
        core = self.sessions.pop(session_id, None)
        self.runners.pop(session_id, None)
        if core is not None:
            self._llm_tokens_closed += core.llm_tokens
        self.metrics.session_closed(session_id)
        self.metrics.sessions_active.set(len(self.sessions))
        if core is not None:
            core.close()

    def health(self) -> dict[str, Any]:
        return {
            "status": "draining" if self.draining else "ok",
            "profile": self.profile.name,
            "sessions": len(self.sessions),
            "max_sessions": self.limits.max_sessions,
            "available": max(0, self.limits.max_sessions - len(self.sessions)),
            "capacity_source": self.capacity_source,
            "sessions_total": self.sessions_total,
            "uptime_s": round(time.time() - self.started, 1),
        }

    def stats(self) -> dict[str, Any]:
        """Health, per-stage executor statistics, and this process's CPU time and memory."""
        import resource

        import psutil

        proc = psutil.Process()
        cpu = proc.cpu_times()
        rss = proc.memory_info().rss
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        children = _children_usage(proc)
        return {
            **self.health(),
            "executor": self.executor.stats(),
            "queue_depth": self.executor.queue_depth(),
            # generated for answers since start (the load bench's tokens/s: the difference over a level)
            "llm": {
                "tokens": self._llm_tokens_closed + sum(c.llm_tokens for c in list(self.sessions.values()))
            },
            "process": {
                # with the model process's: the load bench's "cores" is CPU seconds over wall time
                "cpu_user_s": round(cpu.user + children["user"], 3),
                "cpu_system_s": round(cpu.system + children["system"], 3),
                # with the model process's (the dialogue engine's caches live there)
                "rss_mb": round((rss + children["rss"]) / 2**20, 1),
                "peak_rss_mb": round((peak_kb * 1024 + children["peak"]) / 2**20, 1),
                "model_process_rss_mb": round(children["rss"] / 2**20, 1),
                "threads": proc.num_threads(),
                "asyncio_tasks": _asyncio_tasks(),
            },
        }

    def close(self) -> None:
        for sid in list(self.sessions):
            self.close_session(sid)
        self.heap.close()
        self.gc_pauses.remove()
        self.executor.close()
        if isinstance(self.stages.llm, StageProcess):
            self.stages.llm.close()
