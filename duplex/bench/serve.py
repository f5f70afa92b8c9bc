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

What a caller cares about beyond speed, in the same run (each off by default):

- **facts** (`facts=N`): N questions of data/dialogue/facts_eval.jsonl (a seeded draw), each answer
  (`response.done`'s text) scored by its keyword groups (`conversation.keywords_match`); wrong
  answers are listed, and those whose relay had committed a draft are counted, with the stricter
  count of drafts that already held a wrong answer keyword (`conversation.draft_wrong_keyword`).
- **pause takeover** (`pauses=N`): the first part of a sentence, a 1.0-1.5 s pause, the rest; taken
  over when the service began an answer (`response.audio.started` or a non-backchannel audio frame)
  before the rest was sent. Each case waits for the answer to the whole sentence.
- **memory** (`memory=N`): "My name is Anna." (answered), then "What is my name?": right when the
  answer holds the fact, says "your"/"you", and does not claim the fact as its own.

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

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from duplex.bench.common import (
    FRAME_SECONDS,
    INTERRUPTIONS,
    LONG_PROMPTS,
    MEMORY_CASES,
    PAUSE_PAIRS,
    QUESTIONS,
    SR,
    TARGETS,
    BenchError,
    Fact,
    HibariSynth,
    Listener,
    MemoryCase,
    Mic,
    Progress,
    Synth,
    cancel_tasks,
    count_leaks,
    fetch_stats,
    load_facts,
    percentiles,
    real_time_factors,
    trim_speech,
)
from duplex.bench.conversation import Conversation, answer_vocabulary
from duplex.bench.report import write_outputs
from duplex.core.events import LATENCY_STAGES

log = logging.getLogger("duplex.bench.serve")

# -- the run -----------------------------------------------------------------------------


def _summary(turns: list[dict[str, Any]], barge_ins: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [t for t in turns if t.get("ok")]
    server = {
        stage: percentiles(
            [
                t["server_latency_ms"][stage]
                for t in ok
                if isinstance((t.get("server_latency_ms") or {}).get(stage), (int, float))
            ]
        )
        for stage in LATENCY_STAGES
    }
    onset = percentiles([t["onset_s"] for t in ok])
    reaction = percentiles(
        [b["reaction_s"] for b in barge_ins if b.get("ok") and b.get("reaction_s") is not None]
    )
    summary = {
        "onset_s": onset,
        "onset_by_kind_s": {
            k: percentiles([t["onset_s"] for t in ok if t["kind"] == k])
            for k in ("question", "long", "interruption", "fact", "pause", "memory")
        },
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
        "onset_p50_s": {
            "target": TARGETS["onset_p50_s"],
            "value": onset["p50"],
            "met": onset["p50"] is not None and onset["p50"] <= TARGETS["onset_p50_s"],
        },
        "onset_p90_s": {
            "target": TARGETS["onset_p90_s"],
            "value": onset["p90"],
            "met": onset["p90"] is not None and onset["p90"] <= TARGETS["onset_p90_s"],
        },
        "barge_in_p50_s": {
            "target": TARGETS["barge_in_p50_s"],
            "value": reaction["p50"],
            "met": reaction["p50"] is not None and reaction["p50"] <= TARGETS["barge_in_p50_s"],
        },
    }
    return summary


def _rate(k: int, n: int) -> float | None:
    return round(k / n, 4) if n else None


def case_summary(
    facts: list[dict[str, Any]], pauses: list[dict[str, Any]], memory: list[dict[str, Any]]
) -> dict[str, Any]:
    """The summary's `facts`, `pause_takeover` and `memory` (n = cases asked; each with a rate)."""
    right = sum(1 for f in facts if f["correct"])
    wrong = [f for f in facts if not f["correct"]]
    taken = sum(1 for p in pauses if p.get("taken_over"))
    measured = [p for p in pauses if p.get("taken_over") is not None]
    remembered = sum(1 for m in memory if m["correct"])
    return {
        "facts": {
            "n": len(facts),
            "correct": right,
            "rate": _rate(right, len(facts)),
            "failed": sum(1 for f in facts if not f["ok"]),  # no answer at all (counted wrong)
            "draft_committed": sum(1 for f in facts if f["draft_committed"]),
            # wrong answers that began with a committed draft: the relay may be to blame ...
            "wrong_with_committed_draft": sum(1 for f in wrong if f["draft_committed"]),
            # ... and those whose draft already held a wrong answer keyword: it is
            "wrong_from_draft": sum(1 for f in wrong if f.get("draft_wrong_keyword")),
            "wrong": [
                {
                    "q": f["q"],
                    "heard": f["transcript"],
                    "answer": f["answer"],
                    **({"draft": f["draft"]} if f["draft_committed"] else {}),
                    **({"error": f["error"]} if f.get("error") else {}),
                }
                for f in wrong
            ],
        },
        "pause_takeover": {
            "n": len(measured),
            "taken": taken,
            "rate": _rate(taken, len(measured)),
            "recovered": sum(1 for p in pauses if p.get("recovered")),
        },
        "memory": {
            "n": len(memory),
            "correct": remembered,
            "rate": _rate(remembered, len(memory)),
            "wrong": [
                {
                    "statement": m["statement"],
                    "question": m["question"],
                    "answer": m["answer"],
                    "why": m["why"],
                }
                for m in memory
                if not m["correct"]
            ],
        },
    }


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
    facts: int = 0,
    pauses: int = 0,
    memory: int = 0,
    fact_set: Sequence[Fact] | None = None,
    pause_pairs: Sequence[tuple[str, str]] = PAUSE_PAIRS,
    pause_s: tuple[float, float] = (1.0, 1.5),
    memory_cases: Sequence[MemoryCase] = MEMORY_CASES,
    voice: str | None = None,
) -> dict[str, Any]:
    """Run `turns` question turns, `facts` factual questions, `pauses` mid-sentence pauses, `memory`
    two-turn memory cases, then `barge_ins` barge-in trials, over one session at `url`.

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
        (
            long_prompts[i % len(long_prompts)],
            interruptions[i % len(interruptions)],
            rng.uniform(*barge_wait_s),
        )
        for i in range(barge_ins)
    ]
    # drawn after the barge-in plan, so a run without the new cases draws what it always did
    all_facts = list(fact_set) if fact_set is not None else (load_facts() if facts > 0 else [])
    if facts > 0 and not all_facts:
        raise BenchError("the factual question set is empty")
    order = list(range(len(all_facts)))
    rng.shuffle(order)
    plan_f = [all_facts[order[i % len(order)]] for i in range(facts)]
    plan_p = [(*pause_pairs[i % len(pause_pairs)], rng.uniform(*pause_s)) for i in range(pauses)]
    plan_m = [memory_cases[i % len(memory_cases)] for i in range(memory)]
    vocabulary = answer_vocabulary(all_facts)
    # fail fast (and clearly) when nothing listens, before spending time on synthesis
    await asyncio.to_thread(fetch_stats, url)

    if synth is None:
        say("loading hibari for the prompts ...")
        synth = HibariSynth()
    texts = list(
        dict.fromkeys(
            [
                *plan_q,
                *(f.q for f in plan_f),
                *(part for a, b, _ in plan_p for part in (a, b)),
                *(line for m in plan_m for line in (m.statement, m.question)),
                *(p for p, _, _ in plan_b),
                *(x for _, x, _ in plan_b),
            ]
        )
    )
    say(f"synthesising {len(texts)} prompts ...")
    t_syn = time.perf_counter()
    speech: dict[str, np.ndarray] = {}
    for text in texts:
        audio = trim_speech(np.asarray(synth(text), dtype=np.float32))
        if len(audio) == 0:
            raise BenchError(f"the synthesiser returned silence for {text!r}")
        speech[text] = audio
    say(
        f"  done in {time.perf_counter() - t_syn:.1f} s; {sum(len(a) for a in speech.values()) / SR:.1f} s of speech"
    )

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
        await ws.send(
            json.dumps({"type": "session.start", "sample_rate": SR, "options": session_options or {}})
        )
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
            for k, fact in enumerate(plan_f):
                await conv.fact(k, facts, fact, speech[fact.q], vocabulary)
            for k, (first, rest, wait_s) in enumerate(plan_p):
                await conv.pause(k, pauses, first, speech[first], rest, speech[rest], wait_s)
            for k, case in enumerate(plan_m):
                await conv.remember(k, memory, case, speech[case.statement], speech[case.question])
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
    summary.update(case_summary(conv.facts, conv.pauses, conv.memory))
    summary["leaked_frames_total"] = count_leaks(rx.log)
    summary["rtf"] = real_time_factors(before, after, mic.seconds_sent, rx.audio_seconds, wall_s)
    summary["client"] = {
        "mic_max_lag_ms": round(mic.max_lag_s * 1000, 1),
        "server_errors": [r.event for r in rx.log if r.is_event("error")],
    }
    result: dict[str, Any] = {
        "settings": {
            "url": url,
            "turns": turns,
            "barge_ins": barge_ins,
            "facts": facts,
            "pauses": pauses,
            "memory": memory,
            "pause_s": list(pause_s),
            "voice": voice,
            "voices": dict(getattr(synth, "voice_of", {})),
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
        "samples": {
            "turns": conv.turns,
            "barge_ins": conv.barge_ins,
            "facts": conv.facts,
            "pauses": conv.pauses,
            "memory": conv.memory,
        },
        "server_stats": {"before": before, "after": after},
    }
    if out_dir is not None:
        await asyncio.to_thread(write_outputs, result, out_dir, plot)
    return result
