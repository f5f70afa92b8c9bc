"""How many callers this machine holds: N benchmark sessions at once against one server.

`duplex bench --sessions 1,2,4`: for each N, N callers connect to the same server, their starts
staggered (`stagger_s` apart), each one long session of the serve bench (`serve.run_session`: question
turns and barge-in trials spoken like a microphone). Per N: answer onset and barge-in stop
percentiles over every caller's samples, gaps inside answers' audio (`common.playback_gaps`), the server's
budget overruns, jobs and batch sizes per stage (`/stats` before and after), its CPU and memory (RSS
sampled while the level runs: `memory_per_session_mb`, the slope of RSS with every caller connected
against N), and the sessions it refused (an HTTP 503 at capacity is a result, not a crash).

`duplex bench --soak 10m --sessions N`: N callers run such sessions back to back for the duration
while the server's RSS, threads, asyncio tasks (in-process server only) and overruns are sampled
every `sample_every_s`; leaks show as growth from the first sample to the last.

A gap is where a client playing the answer would have run dry: the server releases each answer
frame `playout_lead_ms` (120 ms) before its play time on a clock that starts when the answer's
first audio is sent, so a client that plays from the first frame's arrival has that much slack for
every later frame. `common.playback_gaps` replays the arrival times of one answer's frames against their
durations and returns each stretch of silence the speaker would have played.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from duplex.bench.common import (
    INTERRUPTIONS,
    LONG_PROMPTS,
    MIN_GAP_S,
    QUESTIONS,
    BenchError,
    HibariSynth,
    Progress,
    Synth,
    answer_gaps,
    count_leaks,
    fetch_stats,
    percentiles,
)
from duplex.bench.serve import SessionPlan, SessionRefused, SessionRun, plan_session, run_session, synthesise

DEFAULT_LEAD_MS = 120  # `playout_lead_ms` of the profile, when session.started does not say
DEFAULT_STAGGER_S = 1.5
#: the barge-in target of a load level: the single-session bench's P50 target, applied to the P90
#: what a caller must get for N callers to count as served (issue 22): answers start within 1 s
#: (P90), a barge-in stops the answer within 200 ms (P90), no gap inside an answer's audio
ONSET_P90_TARGET_S = 1.0
BARGE_IN_P90_TARGET_S = 0.2

ServerProbe = Callable[[], dict[str, Any]]

# -- parsing the options -------------------------------------------------------------------


def parse_sessions(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: positive session counts, in the order given."""
    try:
        counts = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise BenchError(
            f"--sessions takes a comma list of session counts, e.g. 1,2,4; got {text!r}"
        ) from None
    if not counts or min(counts) < 1:
        raise BenchError(f"--sessions needs positive session counts, got {text!r}")
    return counts


_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """'90s', '10m', '1.5h' or plain seconds '45' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text).lower())
    if m is None or float(m.group(1)) <= 0:
        raise BenchError(f"a duration is a positive number with s, m or h (90s, 10m), got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def merge_gaps(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    gaps_ms = [g for p in parts for g in p["gaps_ms"]]
    return {
        "answers": sum(p["answers"] for p in parts),
        "answers_with_gaps": sum(p["answers_with_gaps"] for p in parts),
        "count": len(gaps_ms),
        "worst_ms": max(gaps_ms, default=0.0),
        "total_ms": round(sum(gaps_ms), 1),
        "gaps_ms": gaps_ms,
    }


# -- the server's side ---------------------------------------------------------------------


def stage_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per stage (vad, asr, llm, tts) from two /stats: jobs, overruns, failures and run seconds in
    between; per budget label the batch size P50 and max of the executor's recent batches (its last
    2000 per label: mostly this run's, not only)."""
    b_ex, a_ex = before.get("executor", {}), after.get("executor", {})
    stages: dict[str, dict[str, Any]] = {}
    batches: dict[str, dict[str, Any]] = {}
    for label in sorted(a_ex):
        a, b = a_ex[label], b_ex.get(label, {})
        st = stages.setdefault(label.split(".")[0], {"jobs": 0, "overruns": 0, "failures": 0, "run_s": 0.0})
        for key in ("jobs", "overruns", "failures"):
            st[key] += int(a.get(key, 0)) - int(b.get(key, 0))
        st["run_s"] = round(
            st["run_s"] + float(a.get("run_total_s", 0.0)) - float(b.get("run_total_s", 0.0)), 3
        )
        batches[label] = {"batch_p50": a.get("batch_p50"), "batch_max": a.get("batch_max")}
        if "batch_mean" in a:  # executors that report them: the mean, and jobs a gather window added
            batches[label]["batch_mean"] = a["batch_mean"]
        if "gathered" in a:
            batches[label]["gathered"] = int(a["gathered"]) - int(b.get("gathered", 0))
    return {"stages": stages, "batches": batches}


def server_usage(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The server process between two /stats: CPU seconds and cores busy, RSS, peak RSS, threads."""
    bp, ap = before.get("process") or {}, after.get("process") or {}
    cpu_s = None
    if bp and ap:
        cpu_s = (ap["cpu_user_s"] + ap["cpu_system_s"]) - (bp["cpu_user_s"] + bp["cpu_system_s"])
    return {
        "cpu_s": None if cpu_s is None else round(cpu_s, 2),
        "cpu_cores_busy": None if cpu_s is None or wall_s <= 0 else round(cpu_s / wall_s, 3),
        "rss_mb": ap.get("rss_mb"),
        "rss_mb_before": bp.get("rss_mb"),
        "peak_rss_mb": ap.get("peak_rss_mb"),
        "threads": ap.get("threads"),
    }


def open_rss(samples: Sequence[tuple[int, float]], n: int) -> float | None:
    """The server's median RSS (MB, with the model process's) over the `(sessions, rss_mb)` samples taken while
    all `n` of a level's callers were connected (the median: the allocator's transient peaks and trims move a
    single sample by ~100 MB); None when no sample caught them all."""
    full = [rss for sessions, rss in samples if sessions >= n]
    return float(np.median(full)) if full else None


def memory_per_session(levels: Sequence[dict[str, Any]]) -> float | None:
    """MB the server's RSS grows per extra caller: the least-squares slope of each level's RSS with all its
    callers connected (`server.rss_mb_open`) against N, over the levels that have it; None with fewer than
    two distinct N. An upper bound on what a session keeps: it also counts what the device's work for more
    sessions at once allocates (larger batches, more queued audio)."""
    pts = [(lv["sessions"], lv["server"].get("rss_mb_open")) for lv in levels]
    pts = [(n, r) for n, r in pts if r is not None]
    if len({n for n, _ in pts}) < 2:
        return None
    n, rss = np.array(pts, dtype=float).T
    return round(float(np.polyfit(n, rss, 1)[0]), 1)


def llm_tokens_per_s(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> float | None:
    """LLM tokens generated per second, when /stats counts them (`llm.tokens`); None otherwise."""
    a, b = (after.get("llm") or {}).get("tokens"), (before.get("llm") or {}).get("tokens")
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or wall_s <= 0:
        return None
    return round((a - b) / wall_s, 2)


LLM_TOKENS_NOTE = (
    "the server's /stats does not count LLM tokens (a server older than llm.tokens); not measured"
)


# -- the callers ---------------------------------------------------------------------------


@dataclass
class CallerResult:
    """What one caller of a load level got: its session, or why it had none."""

    caller: int
    run: SessionRun | None = None
    refused: SessionRefused | None = None
    error: str | None = None


@dataclass
class Callers:
    """The prompts of up to `n` callers (each its own rotation and seed) and their speech."""

    plans: list[SessionPlan]
    speech: dict[str, np.ndarray] = field(default_factory=dict)


def make_callers(
    n: int,
    turns: int,
    barge_ins: int,
    synth: Synth,
    say: Progress,
    *,
    seed: int = 0,
    questions: Sequence[str] = QUESTIONS,
    long_prompts: Sequence[str] = LONG_PROMPTS,
    interruptions: Sequence[str] = INTERRUPTIONS,
) -> Callers:
    plans = [
        plan_session(
            turns,
            barge_ins,
            questions=questions,
            long_prompts=long_prompts,
            interruptions=interruptions,
            seed=seed + k,
            offset=k,
        )
        for k in range(n)
    ]
    texts = list(dict.fromkeys(t for p in plans for t in p.texts()))
    return Callers(plans, synthesise(texts, synth, say))


async def _call(
    k: int,
    url: str,
    callers: Callers,
    delay_s: float,
    say: Progress,
    *,
    turn_timeout_s: float,
    session_options: dict[str, Any] | None,
) -> CallerResult:
    await asyncio.sleep(delay_s)
    try:
        run = await run_session(
            url,
            callers.plans[k],
            callers.speech,
            turn_timeout_s=turn_timeout_s,
            session_options=session_options,
            progress=lambda msg: say(f"[caller {k + 1}] {msg}"),
        )
    except SessionRefused as exc:
        say(f"[caller {k + 1}] refused: {exc}")
        return CallerResult(k, refused=exc)
    except BenchError as exc:
        say(f"[caller {k + 1}] failed: {exc}")
        return CallerResult(k, error=str(exc))
    return CallerResult(k, run=run)


async def hang_up_call(url: str, speech: np.ndarray, *, answer_within_s: float = 20.0) -> dict[str, Any]:
    """One caller who asks a question and hangs up as soon as the answer's first audio arrives: the TCP
    connection is aborted (no WebSocket close), as a dropped phone line or a killed browser tab does, so
    the server finds out from a failed send or a dead read. Returns {"reached_audio": bool, "error": str}."""
    import json

    from websockets.asyncio.client import connect

    from duplex.bench.common import FRAME_SAMPLES, FRAME_SECONDS, SR, float_to_pcm16

    loop = asyncio.get_running_loop()
    try:
        ws = await connect(url, max_size=2**20, compression=None, open_timeout=10)
    except Exception as exc:  # refused (503 at capacity) or nothing listening
        return {"reached_audio": False, "error": f"connect: {exc}"}
    heard = asyncio.Event()

    async def listen() -> None:
        async for msg in ws:
            if isinstance(msg, bytes):
                heard.set()
                return

    reader = asyncio.create_task(listen(), name="hangup-rx")
    try:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": SR}))
        audio = np.concatenate([speech, np.zeros(int(answer_within_s * SR), np.float32)])
        start = loop.time()
        for i, k in enumerate(range(0, audio.size, FRAME_SAMPLES)):
            if heard.is_set() or reader.done():
                break
            await ws.send(float_to_pcm16(audio[k : k + FRAME_SAMPLES]))
            await asyncio.sleep(max(0.0, start + (i + 1) * FRAME_SECONDS - loop.time()))  # like a microphone
        reached = heard.is_set()
        return {"reached_audio": reached, "error": "" if reached else "no answer audio"}
    except Exception as exc:
        return {"reached_audio": False, "error": str(exc)}
    finally:
        ws.transport.abort()  # hang up: no close handshake
        reader.cancel()
        with contextlib.suppress(BaseException):
            await reader


def level_record(
    n: int,
    results: Sequence[CallerResult],
    before: dict[str, Any],
    after: dict[str, Any],
    wall_s: float,
    rss_samples: Sequence[tuple[int, float]] = (),
) -> dict[str, Any]:
    """One load level's numbers (see the module docstring and docs/operations.md); `rss_samples` are the
    `(sessions, rss_mb)` the server reported while the level ran."""
    runs = [r.run for r in results if r.run is not None]
    turns = [t for run in runs for t in run.conv.turns]
    barge = [b for run in runs for b in run.conv.barge_ins]
    ok = [t for t in turns if t.get("ok")]
    gaps = merge_gaps([answer_gaps(run.rx.log) for run in runs])
    onset = percentiles([t["onset_s"] for t in ok])
    reaction = percentiles(
        [b["reaction_s"] for b in barge if b.get("ok") and b.get("reaction_s") is not None]
    )
    refused = [r.refused for r in results if r.refused is not None]
    record: dict[str, Any] = {
        "sessions": n,
        "started": len(runs),
        "refused": len(refused),
        "refusals": [{"status": e.status, "code": e.code, "message": str(e)} for e in refused],
        "errors": [r.error for r in results if r.error],
        "lost": sum(1 for run in runs if run.lost),
        "answers_by_caller": [sum(1 for t in run.conv.turns if t.get("ok")) for run in runs],
        "onset_s": onset,
        "barge_in_reaction_s": reaction,
        "barge_in_event_s": percentiles([b["event_after_onset_s"] for b in barge if b.get("ok")]),
        "turns_failed": sum(1 for t in turns if not t.get("ok")),
        "barge_ins_failed": sum(1 for b in barge if not b.get("ok")),
        "barge_ins_stalled": sum(1 for b in barge if b.get("answer_stalled_at_onset")),
        "leaked_frames": sum(count_leaks(run.rx.log) for run in runs),
        "gaps": {k: v for k, v in gaps.items() if k != "gaps_ms"},
        **stage_deltas(before, after),
        "server": {**server_usage(before, after, wall_s), "rss_mb_open": open_rss(rss_samples, n)},
        "llm_tokens_per_s": llm_tokens_per_s(before, after, wall_s),
        "client": {"mic_max_lag_ms": max((round(run.mic.max_lag_s * 1000, 1) for run in runs), default=None)},
        "wall_s": round(wall_s, 2),
    }
    record["overruns"] = sum(st["overruns"] for st in record["stages"].values())
    missed = []
    if onset["p90"] is None or onset["p90"] > ONSET_P90_TARGET_S:
        missed.append("onset_p90")
    if reaction["p90"] is not None and reaction["p90"] > BARGE_IN_P90_TARGET_S:
        missed.append("barge_in_p90")
    if gaps["count"]:
        missed.append("gaps")
    if refused or record["lost"] or record["errors"]:
        missed.append("sessions")
    record["targets_missed"] = missed
    return record


async def run_load(
    url: str,
    counts: Sequence[int],
    turns: int,
    barge_ins: int,
    synth: Synth | None = None,
    out_dir: str | Path | None = "bench-out",
    *,
    stagger_s: float = DEFAULT_STAGGER_S,
    settle_s: float = 2.0,
    seed: int = 0,
    session_options: dict[str, Any] | None = None,
    turn_timeout_s: float = 30.0,
    questions: Sequence[str] = QUESTIONS,
    long_prompts: Sequence[str] = LONG_PROMPTS,
    interruptions: Sequence[str] = INTERRUPTIONS,
    progress: Progress | None = print,
    plot: bool = True,
    rss_every_s: float = 1.0,
) -> dict[str, Any]:
    """For each N of `counts`, N staggered callers of one long session each; returns the result
    also written to `out_dir/load.json` and `load.png` (unless `out_dir` is None). The server's RSS is
    sampled every `rss_every_s` while a level runs (`memory_per_session_mb`)."""
    from duplex.bench.load_report import write_load_outputs

    say = progress or (lambda _msg: None)
    await asyncio.to_thread(fetch_stats, url)  # nothing listens: fail before the synthesis
    if synth is None:
        say("loading hibari for the prompts ...")
        synth = HibariSynth()
    callers = make_callers(
        max(counts),
        turns,
        barge_ins,
        synth,
        say,
        seed=seed,
        questions=questions,
        long_prompts=long_prompts,
        interruptions=interruptions,
    )
    loop = asyncio.get_running_loop()
    levels: list[dict[str, Any]] = []
    lead_ms: Any = None
    for n in counts:
        say(f"== {n} caller(s) at once, {stagger_s:g} s apart ==")
        before = await asyncio.to_thread(fetch_stats, url)
        t0 = loop.time()
        rss_samples: list[tuple[int, float]] = []
        sampler = asyncio.create_task(_sample_rss(url, rss_samples, rss_every_s))
        try:
            results = await asyncio.gather(
                *(
                    _call(
                        k,
                        url,
                        callers,
                        k * stagger_s,
                        say,
                        turn_timeout_s=turn_timeout_s,
                        session_options=session_options,
                    )
                    for k in range(n)
                )
            )
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        wall_s = loop.time() - t0
        await asyncio.sleep(0.2)  # the server accounts the sessions' last jobs
        after = await asyncio.to_thread(fetch_stats, url)
        levels.append(level_record(n, results, before, after, wall_s, rss_samples))
        for r in results:
            if r.run is not None and lead_ms is None:
                lead_ms = (r.run.session.get("options") or {}).get("playout_lead_ms")
        say(format_level(levels[-1]))
        if n != counts[-1]:
            await asyncio.sleep(settle_s)  # closed sessions leave the server before the next level
    kept = [lv["sessions"] for lv in levels if not lv["targets_missed"]]
    result: dict[str, Any] = {
        "settings": {
            "url": url,
            "sessions": list(counts),
            "turns": turns,
            "barge_ins": barge_ins,
            "stagger_s": stagger_s,
            "seed": seed,
            "session_options": session_options or {},
            "turn_timeout_s": turn_timeout_s,
            "playout_lead_ms": lead_ms if lead_ms is not None else DEFAULT_LEAD_MS,
            "min_gap_ms": MIN_GAP_S * 1000,
            "targets": {
                "onset_p90_s": ONSET_P90_TARGET_S,
                "barge_in_p90_s": BARGE_IN_P90_TARGET_S,
                "gaps": 0,
                "refused": 0,
            },
            "started_at": time.time(),
        },
        "levels": levels,
        # the largest N that kept every target, if every smaller N measured kept them too
        "max_sessions_within_targets": max(
            (n for n in kept if all(m in kept for m in counts if m <= n)), default=0
        ),
        "llm_tokens_note": None
        if any(lv["llm_tokens_per_s"] is not None for lv in levels)
        else LLM_TOKENS_NOTE,
        "memory_per_session_mb": memory_per_session(levels),
    }
    if out_dir is not None:
        await asyncio.to_thread(write_load_outputs, result, out_dir, plot)
    return result


async def _sample_rss(url: str, out: list[tuple[int, float]], every_s: float) -> None:
    """Append the server's (sessions, RSS MB) every `every_s` until cancelled; a failed poll is skipped."""
    while True:
        with contextlib.suppress(BenchError):
            stats = await asyncio.to_thread(fetch_stats, url)
            rss = (stats.get("process") or {}).get("rss_mb")
            if isinstance(rss, (int, float)) and isinstance(stats.get("sessions"), int):
                out.append((stats["sessions"], float(rss)))
        await asyncio.sleep(every_s)


def format_level(lv: dict[str, Any]) -> str:
    """One line per load level for the progress output."""
    on, bi = lv["onset_s"], lv["barge_in_reaction_s"]
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731 (a local formatter)
    return (
        f"N={lv['sessions']}: onset P50/P90 {ms(on['p50'])}/{ms(on['p90'])} ms (n={on['n']}), barge-in P90 "
        f"{ms(bi['p90'])} ms (n={bi['n']}), gaps {lv['gaps']['count']} (worst {lv['gaps']['worst_ms']:.0f} ms), "
        f"overruns {lv['overruns']}, refused {lv['refused']}"
    )


# -- the soak ------------------------------------------------------------------------------


async def run_soak(
    url: str,
    n: int,
    duration_s: float,
    turns: int,
    barge_ins: int,
    synth: Synth | None = None,
    out_dir: str | Path | None = "bench-out",
    *,
    sample_every_s: float = 30.0,
    stagger_s: float = DEFAULT_STAGGER_S,
    settle_s: float = 2.0,
    seed: int = 0,
    session_options: dict[str, Any] | None = None,
    turn_timeout_s: float = 30.0,
    questions: Sequence[str] = QUESTIONS,
    long_prompts: Sequence[str] = LONG_PROMPTS,
    interruptions: Sequence[str] = INTERRUPTIONS,
    server_probe: ServerProbe | None = None,
    progress: Progress | None = print,
    plot: bool = True,
    hangups: int = 0,
) -> dict[str, Any]:
    """`n` callers run sessions back to back for `duration_s`; the server sampled every
    `sample_every_s` (and once more idle, after the callers left). `hangups` more callers each ask a
    question and hang up at the answer's first audio, again and again (`hang_up_call`): a session whose
    transport died must leave nothing behind either. Writes soak.json and soak.png."""
    from duplex.bench.load_report import write_soak_outputs

    say = progress or (lambda _msg: None)
    await asyncio.to_thread(fetch_stats, url)
    if synth is None:
        say("loading hibari for the prompts ...")
        synth = HibariSynth()
    callers = make_callers(
        n,
        turns,
        barge_ins,
        synth,
        say,
        seed=seed,
        questions=questions,
        long_prompts=long_prompts,
        interruptions=interruptions,
    )
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = t0 + duration_s
    results: list[CallerResult] = []

    async def sample(phase: str) -> dict[str, Any]:
        stats = await asyncio.to_thread(fetch_stats, url)
        proc = stats.get("process") or {}
        ex = stats.get("executor") or {}
        row: dict[str, Any] = {
            "t_s": round(loop.time() - t0, 2),
            "phase": phase,
            "sessions": stats.get("sessions"),
            "rss_mb": proc.get("rss_mb"),
            "threads": proc.get("threads"),
            "server_tasks": proc.get("asyncio_tasks"),  # None from a server older than this field
            "client_tasks": len(asyncio.all_tasks()),
            "overruns": sum(int(v.get("overruns", 0)) for v in ex.values()),
            "failures": sum(int(v.get("failures", 0)) for v in ex.values()),
            "jobs": sum(int(v.get("jobs", 0)) for v in ex.values()),
            "cpu_s": (proc["cpu_user_s"] + proc["cpu_system_s"]) if proc else None,
        }
        if server_probe is not None:
            row.update(await asyncio.to_thread(server_probe))
        return row

    async def caller(k: int) -> None:
        await asyncio.sleep(k * stagger_s)
        while loop.time() < deadline:
            r = await _call(
                k, url, callers, 0.0, say, turn_timeout_s=turn_timeout_s, session_options=session_options
            )
            results.append(r)
            if r.run is None:  # refused or failed: try again a little later, as a caller would
                await asyncio.sleep(min(2.0, max(0.0, deadline - loop.time())))

    hung: list[dict[str, Any]] = []

    async def hanger(k: int) -> None:
        await asyncio.sleep((n + k) * stagger_s)
        asked = [t for t in callers.speech if t in set(questions)] or list(callers.speech)
        question = callers.speech[asked[k % len(asked)]]
        while loop.time() < deadline - 2.0:
            hung.append(await hang_up_call(url, question))
            await asyncio.sleep(0.5)

    samples = [await sample("idle")]
    say(
        f"soak: {n} caller(s)"
        + (f" and {hangups} hanging up at each answer's first audio" if hangups else "")
        + f" for {duration_s:g} s, sampling every {sample_every_s:g} s"
    )
    tasks = [asyncio.create_task(caller(k), name=f"soak-caller-{k}") for k in range(n)]
    tasks += [asyncio.create_task(hanger(k), name=f"soak-hangup-{k}") for k in range(hangups)]
    try:
        while loop.time() < deadline:
            await asyncio.sleep(min(sample_every_s, max(0.0, deadline - loop.time())))
            samples.append(await sample("load"))
            s = samples[-1]
            say(
                f"soak t={s['t_s']:.0f} s: sessions {s['sessions']}, RSS {s['rss_mb']} MB, threads {s['threads']}, "
                f"server tasks {s['server_tasks']}, overruns {s['overruns']}"
            )
    finally:
        for t in tasks:  # the sessions in progress end here (their partial results are kept)
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    await asyncio.sleep(settle_s)
    # closing sessions leave the server asynchronously (slower on a loaded machine): the idle sample is the
    # first with no session and no more tasks than before the callers, or the one 10 s later
    first, end = samples[0], loop.time() + 10.0
    while True:
        last = await sample("idle")
        tasks_back = (
            not isinstance(first.get("server_tasks"), int) or last["server_tasks"] <= first["server_tasks"]
        )
        if (last["sessions"] == 0 and tasks_back) or loop.time() >= end:
            break
        await asyncio.sleep(0.25)
    samples.append(last)
    result = soak_result(url, n, duration_s, sample_every_s, samples, results, t0)
    result["settings"].update(
        {
            "turns": turns,
            "barge_ins": barge_ins,
            "stagger_s": stagger_s,
            "session_options": session_options or {},
            "hangup_callers": hangups,
        }
    )
    result["totals"]["hangups"] = {
        "calls": len(hung),
        "at_first_audio": sum(1 for h in hung if h["reached_audio"]),
        "errors": sorted({h["error"] for h in hung if h["error"]})[:5],
    }
    if out_dir is not None:
        await asyncio.to_thread(write_soak_outputs, result, out_dir, plot)
    return result


def _growth_pct(first: Any, last: Any) -> float | None:
    if not isinstance(first, (int, float)) or not isinstance(last, (int, float)) or first <= 0:
        return None
    return round(100.0 * (last - first) / first, 2)


def soak_result(
    url: str,
    n: int,
    duration_s: float,
    sample_every_s: float,
    samples: list[dict[str, Any]],
    results: Sequence[CallerResult],
    t0: float,
) -> dict[str, Any]:
    """The soak's totals and verdicts from its samples and every session's records."""
    runs = [r.run for r in results if r.run is not None]
    per_run = [answer_gaps(run.rx.log) for run in runs]
    gap_times = sorted(t - t0 for g in per_run for t in g["times"])
    for s in samples:  # gaps up to each sample, for the timeline
        s["gaps"] = sum(1 for t in gap_times if t <= s["t_s"])
    load = [s for s in samples if s["phase"] == "load"]
    idle = [s for s in samples if s["phase"] == "idle"]
    first, last = (load[0], load[-1]) if load else (samples[0], samples[-1])
    turns = [t for run in runs for t in run.conv.turns]
    gaps = merge_gaps(per_run)
    totals = {
        "sessions_started": len(runs),
        "sessions_refused": sum(1 for r in results if r.refused is not None),
        "sessions_failed": sum(1 for r in results if r.error) + sum(1 for run in runs if run.lost),
        "answers": sum(1 for t in turns if t.get("ok")),
        "turns_failed": sum(1 for t in turns if not t.get("ok")),
        "onset_s": percentiles([t["onset_s"] for t in turns if t.get("ok")]),
        "gaps": {k: v for k, v in gaps.items() if k != "gaps_ms"},
        "leaked_frames": sum(count_leaks(run.rx.log) for run in runs),
        "overruns": samples[-1]["overruns"] - samples[0]["overruns"],
        "stage_failures": samples[-1]["failures"] - samples[0]["failures"],
        "mic_max_lag_ms": max((round(run.mic.max_lag_s * 1000, 1) for run in runs), default=None),
    }
    verdict = {
        # from the first sample under load to the last: warm-up allocations are in the first
        "rss_growth_pct": _growth_pct(first["rss_mb"], last["rss_mb"]),
        "rss_growth_from_idle_pct": _growth_pct(samples[0]["rss_mb"], samples[-1]["rss_mb"]),
        "threads_grew": _grew(idle, "threads"),
        "server_tasks_grew": _grew(idle, "server_tasks"),
        "client_tasks_grew": _grew(idle, "client_tasks"),
        "threads_idle": [s["threads"] for s in idle],
        "server_tasks_idle": [s["server_tasks"] for s in idle],
        "dropped_frames_note": "the server does not count dropped frames; reported from the client: gaps "
        "inside answers' audio and frames leaked after response.interrupted",
    }
    return {
        "settings": {
            "url": url,
            "sessions": n,
            "duration_s": duration_s,
            "sample_every_s": sample_every_s,
            "min_gap_ms": MIN_GAP_S * 1000,
            "started_at": time.time(),
        },
        "samples": samples,
        "totals": totals,
        "verdict": verdict,
    }


def _grew(idle: Sequence[dict[str, Any]], key: str) -> bool | None:
    """Idle before the callers vs idle after them: did the count grow (a leak)? None: not measured."""
    if len(idle) < 2 or not all(isinstance(s.get(key), int) for s in (idle[0], idle[-1])):
        return None
    return bool(idle[-1][key] > idle[0][key])
