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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duplex.bench.common import (
    FRAME_SECONDS,
    INTERRUPTIONS,
    LONG_PROMPTS,
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
    answer_gaps,
    cancel_tasks,
    count_leaks,
    fetch_stats,
    load_facts,
    pause_speech,
    percentiles,
    real_time_factors,
    trim_speech,
)
from duplex.bench.conversation import Conversation, answer_vocabulary
from duplex.bench.report import write_outputs
from duplex.core.events import LATENCY_STAGES
from duplex.eval.answers import ALL_MEMORY_CASES

log = logging.getLogger("duplex.bench.serve")

# -- the run -----------------------------------------------------------------------------


_SPELLING = {"colour": "color", "favourite": "favorite", "grey": "gray", "centre": "center", "metre": "meter"}
#: a transcript with more than this share of the asked words wrong answers another question than the one asked
MISHEARD = 1 / 3


def share_misheard(text: str, said: str) -> float:
    """Word errors of the transcript `said` per word of `text` (normalised words; British and American spellings
    are the same words)."""
    from asr.training.wer import normalize_text, word_errors

    def spelled(t: str) -> str:
        return " ".join(_SPELLING.get(w, w) for w in normalize_text(t).split())

    return word_errors(spelled(text), spelled(said)) / max(len(normalize_text(text).split()), 1)


def heard(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """How well the server heard what was asked: each answered turn's final transcript against the text spoken
    (normalised words): how many word for word, and those with more than a third of their words wrong (an answer
    to another question than the one asked)."""
    scored = []
    for t in turns:
        text, said = t.get("text"), t.get("transcript")
        if not t.get("ok") or not text or said is None:
            continue
        scored.append((t, share_misheard(text, said)))
    return {
        "n": len(scored),
        "word_for_word": sum(1 for _, e in scored if e == 0),
        "misheard": [
            {"text": t["text"], "transcript": t["transcript"], "wer": round(e, 3)}
            for t, e in scored
            if e > MISHEARD
        ],
    }


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
        "heard": heard(turns),
        "split_turns": int(sum(t.get("split_finals", 0) for t in turns)),
        # answers the relay's drafter started (committed prefix) out of those it drafted for
        "relay_committed": sum(1 for t in ok if (t.get("relay") or {}).get("committed")),
        "relay_drafted": sum(1 for t in ok if t.get("relay")),
        # answers prepared from a partial transcript while the user talked (session option early_answer)
        "early_answers": sum(1 for t in ok if t.get("early")),
        "onset_early_s": percentiles([t["onset_s"] for t in ok if t.get("early")]),
        "onset_not_early_s": percentiles([t["onset_s"] for t in ok if not t.get("early")]),
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


@dataclass(frozen=True)
class SessionPlan:
    """What one benchmark session says, in order: question turns, facts, pauses, memory cases, then
    barge-in trials (each a long prompt, its interruption and the wait before it)."""

    questions: list[str]
    facts: list[Fact]
    pauses: list[tuple[str, str, float]]
    memory: list[MemoryCase]
    barge_ins: list[tuple[str, str, float]]
    vocabulary: set[str]

    def texts(self) -> list[str]:
        """Every prompt to synthesise, once each, in order of first use."""
        return list(
            dict.fromkeys(
                [
                    *self.questions,
                    *(f.q for f in self.facts),
                    *(part for a, b, _ in self.pauses for part in (a, b)),
                    *(line for m in self.memory for line in (m.statement, m.question)),
                    *(p for p, _, _ in self.barge_ins),
                    *(x for _, x, _ in self.barge_ins),
                ]
            )
        )


def plan_session(
    turns: int,
    barge_ins: int,
    *,
    questions: Sequence[str] = QUESTIONS,
    long_prompts: Sequence[str] = LONG_PROMPTS,
    interruptions: Sequence[str] = INTERRUPTIONS,
    barge_wait_s: tuple[float, float] = (1.0, 1.5),
    seed: int = 0,
    facts: int = 0,
    pauses: int = 0,
    memory: int = 0,
    fact_set: Sequence[Fact] | None = None,
    pause_pairs: Sequence[tuple[str, str]] = PAUSE_PAIRS,
    pause_s: tuple[float, float] = (1.0, 1.5),
    memory_cases: Sequence[MemoryCase] = ALL_MEMORY_CASES,
    offset: int = 0,
) -> SessionPlan:
    """The seeded plan of one session; `offset` rotates the prompt lists (another caller of a load
    run asks other questions first)."""
    rng = random.Random(seed)
    plan_q = [questions[(offset + i) % len(questions)] for i in range(turns)]
    plan_b = [
        (
            long_prompts[(offset + i) % len(long_prompts)],
            interruptions[(offset + i) % len(interruptions)],
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
    plan_f = [all_facts[order[(offset + i) % len(order)]] for i in range(facts)]
    plan_p = [(*pause_pairs[(offset + i) % len(pause_pairs)], rng.uniform(*pause_s)) for i in range(pauses)]
    plan_m = [memory_cases[(offset + i) % len(memory_cases)] for i in range(memory)]
    return SessionPlan(plan_q, plan_f, plan_p, plan_m, plan_b, answer_vocabulary(all_facts))


def synthesise(texts: Sequence[str], synth: Synth, say: Progress) -> dict[str, np.ndarray]:
    """Speak every text with `synth`, trimmed of leading/trailing silence."""
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
    return speech


class SessionRefused(BenchError):
    """The server would not open a session: an HTTP status before the upgrade (503 at capacity, 429
    too many connections from this address) or an `error` answering session.start."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class SessionRun:
    """One benchmark session as it ran: the conversation's records, the client's mic and log."""

    conv: Conversation
    mic: Mic
    rx: Listener
    session: dict[str, Any]
    t0: float  # loop time at connect
    wall_s: float
    interrupted: bool = False  # cancelled (Ctrl-C, or the end of a soak): partial results
    lost: str | None = None  # the connection dropped during the run: partial results


def _refusal(url: str, exc: Exception) -> SessionRefused:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    code = None
    body = getattr(response, "body", None)
    if body:
        with contextlib.suppress(ValueError, TypeError, UnicodeDecodeError):
            doc = json.loads(body)
            code = (doc.get("error") or {}).get("code") or doc.get("code")  # {"error": {"code": ...}}
    return SessionRefused(f"the server refused the WebSocket at {url}: {exc}", status, code)


async def run_session(
    url: str,
    plan: SessionPlan,
    speech: dict[str, np.ndarray],
    *,
    turn_timeout_s: float = 30.0,
    lead_silence_s: float = 1.0,
    session_options: dict[str, Any] | None = None,
    progress: Progress | None = print,
    pause_audio: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] | None = None,
) -> SessionRun:
    """Connect, start a session and say `plan` like a microphone; a coroutine that several callers
    can run at once against one server (`duplex.bench.load`). Cancelling it ends the session and
    returns what was measured (`interrupted`). Raises SessionRefused when no session opens and
    BenchError when nothing listens at `url`."""
    from websockets.asyncio.client import connect

    say = progress or (lambda _msg: None)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    interrupted = False
    lost: str | None = None
    try:
        ws_cm = connect(url, max_size=2**20, compression=None, open_timeout=10)
        ws = await ws_cm.__aenter__()
    except (OSError, TimeoutError) as exc:
        raise BenchError(f"cannot open {url}: {exc}. Is `duplex serve` running?") from None
    except Exception as exc:  # an HTTP status instead of the upgrade (e.g. 503 at capacity)
        raise _refusal(url, exc) from None
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
        try:
            i = await rx.wait(lambda r: r.is_event("session.started") or r.is_event("error"), within_s=10)
        except (ConnectionError, TimeoutError) as exc:  # closed with 1013 at capacity, or no answer
            raise SessionRefused(f"no session at {url}: {exc}") from None
        first = rx.log[i].event
        assert first is not None
        if first["type"] == "error":
            raise SessionRefused(
                f"session.start refused: {first.get('code')}: {first.get('message')}", code=first.get("code")
            )
        session = first
        tasks.append(asyncio.create_task(mic.run(), name="bench-mic"))
        await asyncio.sleep(lead_silence_s)
        try:
            for k, text in enumerate(plan.questions):
                await conv.turn(k, len(plan.questions), text, speech[text])
            for k, fact in enumerate(plan.facts):
                await conv.fact(k, len(plan.facts), fact, speech[fact.q], plan.vocabulary)
            for k, (head, rest, wait_s) in enumerate(plan.pauses):
                first, second = (pause_audio or {}).get((head, rest), (speech[head], speech[rest]))
                await conv.pause(k, len(plan.pauses), head, first, rest, second, wait_s)
            for k, case in enumerate(plan.memory):
                await conv.remember(k, len(plan.memory), case, speech[case.statement], speech[case.question])
            for k, (prompt, intr, wait_s) in enumerate(plan.barge_ins):
                await conv.barge_in(
                    k, len(plan.barge_ins), prompt, speech[prompt], intr, speech[intr], wait_s
                )
        except asyncio.CancelledError:  # Ctrl-C: keep what was measured
            interrupted = True
            say("interrupted: writing the partial results")
        except ConnectionError as exc:
            lost = str(exc)
    finally:
        await cancel_tasks(tasks)
        with contextlib.suppress(Exception):
            await ws_cm.__aexit__(None, None, None)
    return SessionRun(conv, mic, rx, session, t0, loop.time() - t0, interrupted, lost)


def session_summary(run: SessionRun) -> dict[str, Any]:
    """The summary of one session's records (without the server's real-time factors)."""
    conv = run.conv
    summary = _summary(conv.turns, conv.barge_ins)
    summary.update(case_summary(conv.facts, conv.pauses, conv.memory))
    summary["leaked_frames_total"] = count_leaks(run.rx.log)
    # where a client playing each answer would have run dry (a relay's seam with a slow model behind it)
    summary["answer_gaps"] = {k: v for k, v in answer_gaps(run.rx.log).items() if k != "times"}
    summary["client"] = {
        "mic_max_lag_ms": round(run.mic.max_lag_s * 1000, 1),
        "server_errors": [r.event for r in run.rx.log if r.is_event("error")],
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
    facts: int = 0,
    pauses: int = 0,
    memory: int = 0,
    fact_set: Sequence[Fact] | None = None,
    pause_pairs: Sequence[tuple[str, str]] = PAUSE_PAIRS,
    pause_s: tuple[float, float] = (1.0, 1.5),
    memory_cases: Sequence[MemoryCase] = ALL_MEMORY_CASES,
    voice: str | None = None,
    cut_audio: str = "whole",
) -> dict[str, Any]:
    """Run `turns` question turns, `facts` factual questions, `pauses` mid-sentence pauses, `memory`
    two-turn memory cases, then `barge_ins` barge-in trials, over one session at `url`.

    `synth(text)` returns float32 speech at 16 kHz (default: hibari); its output is trimmed of
    leading/trailing silence and cached in memory before the connection opens. A pause case's two parts
    are cut from its whole sentence's audio (`cut_audio="whole"`, `common.pause_speech`) or spoken
    alone (`"alone"`: the first part then ends like a finished sentence). Returns the result
    dict that is also written to `out_dir/bench.json` (with `bench.png`) unless `out_dir` is None.
    Raises BenchError when the server cannot be reached.
    """
    say = progress or (lambda _msg: None)
    plan = plan_session(
        turns,
        barge_ins,
        questions=questions,
        long_prompts=long_prompts,
        interruptions=interruptions,
        barge_wait_s=barge_wait_s,
        seed=seed,
        facts=facts,
        pauses=pauses,
        memory=memory,
        fact_set=fact_set,
        pause_pairs=pause_pairs,
        pause_s=pause_s,
        memory_cases=memory_cases,
    )
    # fail fast (and clearly) when nothing listens, before spending time on synthesis
    await asyncio.to_thread(fetch_stats, url)

    if synth is None:
        say("loading hibari for the prompts ...")
        synth = HibariSynth()
    speech = synthesise(plan.texts(), synth, say)
    if cut_audio not in ("whole", "alone"):
        raise BenchError(f"cut_audio must be 'whole' or 'alone', not {cut_audio!r}")
    pause_audio = (
        {(h, r): pause_speech(synth, h, r) for h, r, _ in plan.pauses} if cut_audio == "whole" else None
    )

    before = await asyncio.to_thread(fetch_stats, url)
    started_at = time.time()
    run = await run_session(
        url,
        plan,
        speech,
        turn_timeout_s=turn_timeout_s,
        lead_silence_s=lead_silence_s,
        session_options=session_options,
        progress=progress,
        pause_audio=pause_audio,
    )
    if run.lost is not None:
        raise BenchError(f"lost the connection to {url} during the run: {run.lost}")
    await asyncio.sleep(0.2)  # let the server account the session's last jobs
    after = await asyncio.to_thread(fetch_stats, url)

    conv = run.conv
    summary = session_summary(run)
    summary["rtf"] = real_time_factors(before, after, run.mic.seconds_sent, run.rx.audio_seconds, run.wall_s)
    client = summary.pop("client")
    summary["client"] = client  # after rtf, as before the refactor
    result: dict[str, Any] = {
        "settings": {
            "url": url,
            "turns": turns,
            "barge_ins": barge_ins,
            "facts": facts,
            "pauses": pauses,
            "memory": memory,
            "pause_s": list(pause_s),
            "cut_audio": cut_audio,
            "voice": voice,
            "voices": dict(getattr(synth, "voice_of", {})),
            "sample_rate": SR,
            "frame_ms": FRAME_SECONDS * 1000,
            "barge_wait_s": list(barge_wait_s),
            "turn_timeout_s": turn_timeout_s,
            "seed": seed,
            "session_options": session_options or {},
            "session": run.session,
            "synth": getattr(synth, "__qualname__", type(synth).__name__),
            "started_at": started_at,
            "wall_s": round(run.wall_s, 3),
            "interrupted": run.interrupted,
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
