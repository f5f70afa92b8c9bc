"""One benchmark conversation over the native protocol: turns and barge-ins sent like a microphone,
the answers' onsets, reactions and leaked frames measured; and what a caller cares about beyond
speed: factual questions scored by keywords, mid-sentence pauses (taken over or waited through), and
multi-turn memory (a fact the caller told, asked back)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplex.bench.common import (
    SR,
    STALL_S,
    Fact,
    Listener,
    MemoryCase,
    Mic,
    Progress,
    Rx,
    Utterance,
    count_leaks,
)
from duplex.core.events import LATENCY_STAGES
from duplex.eval.answers import (  # re-exported: the bench's scoring lives with the evaluations
    answer_tokens,
    answer_vocabulary,
    draft_wrong_keyword,
    keywords_match,
    memory_verdict,
)

__all__ = [
    "Conversation",
    "answer_started",
    "answer_tokens",
    "answer_vocabulary",
    "draft_wrong_keyword",
    "keywords_match",
    "memory_verdict",
]


def answer_started(log_: Sequence[Rx], start: int, before: float) -> int | None:
    """Index of the first sign of an answer at or after `start` received before `before`: a
    `response.audio.started`, or an audio frame that is not the service's own backchannel."""
    backchannel = False
    for i in range(start, len(log_)):
        r = log_[i]
        if r.t >= before:
            break
        if r.is_event("response.audio.started"):
            return i
        if r.is_event("backchannel") and (r.event or {}).get("source") == "service":
            backchannel = True
        elif r.is_audio and not backchannel:
            return i
    return None


# -- one conversation --------------------------------------------------------------------


@dataclass
class Conversation:
    mic: Mic
    rx: Listener
    timeout: float
    progress: Progress
    turns: list[dict[str, Any]] = field(default_factory=list)
    barge_ins: list[dict[str, Any]] = field(default_factory=list)
    facts: list[dict[str, Any]] = field(default_factory=list)
    pauses: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)

    async def _answer(self, utt: Utterance, kind: str, trial: int, start: int) -> dict[str, Any]:
        """Wait for the answer to `utt` (said when the log had `start` entries) and its first audio
        frame: one onset sample."""
        rec: dict[str, Any] = {"kind": kind, "trial": trial, "text": utt.text, "ok": False}
        t_end = await asyncio.wait_for(asyncio.shield(utt.last_sent), self.timeout + utt.samples / SR)
        t_first = utt.first_sent.result()
        rec["t_speech_start"] = t_first
        rec["t_speech_end"] = t_end
        rx = self.rx
        # the turn this speech ends is the first final after the end of speech; finals in between
        # mean the VAD split the utterance into two turns (a pause longer than the hangover)
        i = await rx.wait(
            lambda r: r.is_event("transcript.final") and r.t >= t_end, start=start, within_s=self.timeout
        )
        rec["split_finals"] = sum(
            1 for r in rx.log[start:i] if r.is_event("transcript.final") and r.t > t_first
        )
        final = rx.log[i].event
        assert final is not None
        rec["transcript"] = final["text"]
        turn = int(final["turn_id"])
        rec["turn_id"] = turn
        if not final["text"].strip():
            rec["error"] = "empty transcript (no answer follows)"
            return rec
        i = await rx.wait(
            lambda r: r.is_event("response.audio.started", turn) or r.is_event("response.done", turn),
            start=i,
            within_s=self.timeout,
        )
        if rx.log[i].is_event("response.done"):
            rec["error"] = f"response {rx.log[i].event['status']} without audio"  # type: ignore[index]
            return rec
        rec["audio_started_index"] = i
        j = await rx.wait(
            lambda r: r.is_audio or r.is_event("response.done", turn), start=i, within_s=self.timeout
        )
        if not rx.log[j].is_audio:
            rec["error"] = "response.done before any audio frame"
            return rec
        rec["t_first_audio"] = rx.log[j].t
        rec["onset_s"] = rx.log[j].t - t_end
        rec["first_audio_index"] = j
        with contextlib.suppress(TimeoutError):
            k = await rx.wait(lambda r: r.is_event("turn.latency", turn), start=i, within_s=5.0)
            rec["server_latency_ms"] = dict(rx.log[k].event["stages"])  # type: ignore[index]
            rec["relay"] = dict(rx.log[k].event.get("relay") or {})  # type: ignore[union-attr]
            rec["early"] = bool(rx.log[k].event.get("early"))  # type: ignore[union-attr]
        rec["ok"] = True
        return rec

    async def _finish(self, rec: dict[str, Any]) -> None:
        """Wait for response.done of the turn, the audio to finish playing, and a pause."""
        turn = rec.get("turn_id")
        rx = self.rx
        if turn is not None:
            with contextlib.suppress(TimeoutError):
                k = await rx.wait(
                    lambda r: r.is_event("response.done", turn),
                    start=rec.get("audio_started_index", 0),
                    within_s=self.timeout * 4,
                )
                done = rx.log[k].event
                assert done is not None
                rec["status"] = done.get("status")
                rec["answer"] = done.get("text", "")
        await rx.wait_quiet()
        if "first_audio_index" in rec:
            rec["answer_audio_s"] = sum(r.audio_s for r in rx.log[rec["first_audio_index"] :] if r.is_audio)
        await asyncio.sleep(0.5)

    def _line(self, rec: dict[str, Any], label: str) -> str:
        if not rec.get("ok"):
            return f"{label} {rec['text']!r}: FAILED ({rec.get('error', '?')})"
        lat = rec.get("server_latency_ms") or {}
        parts = " ".join(f"{k}={lat[k]:.0f}" for k in LATENCY_STAGES if isinstance(lat.get(k), (int, float)))
        return f"{label} {rec['text']!r} -> {rec.get('transcript', '')!r}: onset {rec['onset_s'] * 1000:.0f} ms  [server ms: {parts}]"

    async def _ask(self, kind: str, trial: int, text: str, speech: np.ndarray) -> dict[str, Any]:
        """Speak `text` into the mic and record the answer it gets as one onset sample."""
        start = len(self.rx.log)
        utt = self.mic.say(text, speech)
        try:
            rec = await self._answer(utt, kind, trial, start)
        except TimeoutError:
            rec = {"kind": kind, "trial": trial, "text": text, "ok": False, "error": "timed out"}
        self.turns.append(rec)
        return rec

    async def turn(self, trial: int, n: int, text: str, speech: np.ndarray) -> None:
        rec = await self._ask("question", trial, text, speech)
        await self._finish(rec)
        self.progress(self._line(rec, f"[turn {trial + 1}/{n}]"))

    async def fact(
        self, trial: int, n: int, fact: Fact, speech: np.ndarray, vocabulary: set[str]
    ) -> dict[str, Any]:
        """Ask a factual question; score the final answer (response.done's text) by its keywords and
        note whether the relay committed a draft, and whether that draft already held a wrong keyword."""
        rec = await self._ask("fact", trial, fact.q, speech)
        await self._finish(rec)
        answer = str(rec.get("answer") or "")
        relay = rec.get("relay") or {}
        committed = bool(relay.get("committed"))
        draft = str(relay.get("draft") or "") if committed else ""
        correct = bool(rec.get("ok")) and keywords_match(answer, fact.any)
        frec: dict[str, Any] = {
            "trial": trial,
            "q": fact.q,
            "any": [list(g) for g in fact.any],
            "transcript": rec.get("transcript"),
            "answer": answer,
            "status": rec.get("status"),
            "ok": bool(rec.get("ok")),
            "error": rec.get("error"),
            "correct": correct,
            "draft_committed": committed,
            "draft": draft or None,
            "draft_wrong_keyword": draft_wrong_keyword(draft, fact, vocabulary)
            if draft and not correct
            else None,
        }
        self.facts.append(frec)
        mark = "right" if correct else "WRONG"
        self.progress(
            f"[fact {trial + 1}/{n}] {mark}: {fact.q!r} heard {rec.get('transcript', '')!r} -> {answer!r}"
            + (f" (committed draft {draft!r})" if committed else "")
        )
        return frec

    async def pause(
        self,
        trial: int,
        n: int,
        first: str,
        first_speech: np.ndarray,
        rest: str,
        rest_speech: np.ndarray,
        pause_s: float,
    ) -> dict[str, Any]:
        """Say `first`, pause `pause_s`, say `rest` (queued at once, so the pause is exact). Taken over:
        the service began an answer before the rest's first sample was sent. Then wait for the answer
        to the whole sentence (its turn ends after the rest), so the next case starts clean."""
        rx = self.rx
        start = len(rx.log)
        case: dict[str, Any] = {
            "trial": trial,
            "first": first,
            "rest": rest,
            "pause_s": round(pause_s, 3),
            "taken_over": None,
            "recovered": False,
        }
        self.pauses.append(case)
        u1 = self.mic.say(first, first_speech)
        self.mic.silence(pause_s)
        u2 = self.mic.say(rest, rest_speech)
        label = f"[pause {trial + 1}/{n}]"
        try:
            lead = (u1.samples + u2.samples) / SR + pause_s
            t_rest = await asyncio.wait_for(asyncio.shield(u2.first_sent), self.timeout + lead)
        except TimeoutError:
            case["error"] = "the microphone stalled"
            self.progress(f"{label} FAILED ({case['error']})")
            return case
        t_first_end = u1.last_sent.result()
        case["t_first_end"] = t_first_end
        case["t_rest_start"] = t_rest
        hit = answer_started(rx.log, start, t_rest)
        case["taken_over"] = hit is not None
        if hit is not None:
            case["taken_after_s"] = round(rx.log[hit].t - t_first_end, 3)
        case["decisions"] = [
            {"decision": r.event.get("decision"), "text": r.event.get("text")}  # type: ignore[union-attr]
            for r in rx.log[start:]
            if r.is_event("turn.decision") and r.t < t_rest
        ]
        case["backchannels"] = sum(
            1
            for r in rx.log[start:]
            if r.is_event("backchannel") and r.t < t_rest and (r.event or {}).get("source") == "service"
        )
        try:
            rec = await self._answer(u2, "pause", trial, start)
        except TimeoutError:
            rec = {"kind": "pause", "trial": trial, "text": rest, "ok": False, "error": "timed out"}
        rec["text"] = f"{first} ... {rest}"
        self.turns.append(rec)
        await self._finish(rec)
        case["transcript"] = rec.get("transcript")
        case["answer"] = rec.get("answer")
        case["recovered"] = bool(rec.get("ok")) and rec.get("status") is not None
        if not rec.get("ok"):
            case["error"] = rec.get("error")
        what = (
            f"TAKEN OVER {case['taken_after_s']:.2f} s into the pause"
            if case["taken_over"]
            else "waited through the pause"
        )
        self.progress(
            f"{label} {first!r} ... {pause_s:.2f} s ... {rest!r}: {what}; "
            + ("answer: " + repr(case["answer"]) if case["recovered"] else f"no answer ({case.get('error')})")
        )
        return case

    async def remember(
        self, trial: int, n: int, case: MemoryCase, statement_speech: np.ndarray, question_speech: np.ndarray
    ) -> dict[str, Any]:
        """Tell the service a fact about the caller, let it answer, then ask the fact back."""
        told = await self._ask("memory", trial, case.statement, statement_speech)
        await self._finish(told)
        asked = await self._ask("memory", trial, case.question, question_speech)
        await self._finish(asked)
        answer = str(asked.get("answer") or "")
        correct, why = memory_verdict(answer, case) if asked.get("ok") else (False, str(asked.get("error")))
        mrec: dict[str, Any] = {
            "trial": trial,
            "statement": case.statement,
            "statement_transcript": told.get("transcript"),
            "statement_answer": told.get("answer"),
            "question": case.question,
            "transcript": asked.get("transcript"),
            "answer": answer,
            "correct": correct,
            "why": why or None,
        }
        self.memory.append(mrec)
        self.progress(
            f"[memory {trial + 1}/{n}] {'right' if correct else 'WRONG'}: {case.statement!r} then "
            f"{case.question!r} -> {answer!r}" + (f" ({why})" if why else "")
        )
        return mrec

    async def barge_in(
        self,
        trial: int,
        n: int,
        prompt: str,
        speech: np.ndarray,
        interruption: str,
        interruption_speech: np.ndarray,
        wait_s: float,
    ) -> None:
        rx = self.rx
        trial_rec: dict[str, Any] = {
            "trial": trial,
            "prompt": prompt,
            "interruption": interruption,
            "wait_s": wait_s,
            "ok": False,
        }
        self.barge_ins.append(trial_rec)
        label = f"[barge-in {trial + 1}/{n}]"
        rec = await self._ask("long", trial, prompt, speech)
        if not rec.get("ok"):
            trial_rec["error"] = f"long answer: {rec.get('error')}"
            await self._finish(rec)
            self.progress(f"{label} FAILED ({trial_rec['error']})")
            return
        turn = rec["turn_id"]
        await asyncio.sleep(max(0.0, rec["t_first_audio"] + wait_s - rx.loop.time()))
        t_said = rx.loop.time()
        istart = len(rx.log)
        iutt = self.mic.say(interruption, interruption_speech)
        t_onset = await asyncio.wait_for(asyncio.shield(iutt.first_sent), 5.0)
        trial_rec["t_interrupt_onset"] = t_onset
        trial_rec["mic_delay_s"] = t_onset - t_said
        # the answer may have finished before the user interrupted: then there is nothing to measure
        done_i = rx.find(lambda r: r.is_event("response.done", turn), start=rec["audio_started_index"])
        generated = done_i is not None and rx.log[done_i].t < t_onset
        playing = rx.play_end > t_onset
        trial_rec["answer_done_before_onset"] = generated
        trial_rec["answer_playing_at_onset"] = playing
        i: int | None
        try:
            # an answer that had finished playing before the user spoke cannot be interrupted
            i = await rx.wait(
                lambda r: r.is_event("response.interrupted", turn),
                start=rec["audio_started_index"],
                within_s=self.timeout if (playing or not generated) else 2.0,
            )
        except TimeoutError:
            i = None
        if i is None:
            trial_rec["error"] = "no response.interrupted" + (
                ""
                if playing or not generated
                else " (the answer had finished playing before the interruption)"
            )
        else:
            ev = rx.log[i].event
            assert ev is not None
            trial_rec["t_interrupted_event"] = rx.log[i].t
            trial_rec["played_ms"] = ev.get("played_ms")
            trial_rec["played_text"] = ev.get("played_text")
            last = None
            for r in reversed(rx.log[rec["first_audio_index"] : i]):
                if r.is_audio:
                    last = r.t
                    break
            trial_rec["t_last_answer_audio"] = last
            trial_rec["frames_after_onset"] = sum(
                1 for r in rx.log[rec["first_audio_index"] : i] if r.is_audio and r.t > t_onset
            )
            raw = (last - t_onset) if last is not None else None
            trial_rec["reaction_raw_s"] = raw
            # the last frame came a little before the onset (frames are 40 ms apart): the server stopped
            # at once (0). Much earlier: the answer's audio had stalled (TTS/LLM slower than real time),
            # there was nothing to stop and the reaction is not measurable; counted apart.
            stalled = raw is None or raw < -STALL_S
            trial_rec["answer_stalled_at_onset"] = stalled
            trial_rec["reaction_s"] = None if stalled else max(0.0, raw)
            trial_rec["event_after_onset_s"] = rx.log[i].t - t_onset
            trial_rec["ok"] = True
        with contextlib.suppress(TimeoutError):
            await rx.wait(
                lambda r: r.is_event("response.done", turn),
                start=rec["audio_started_index"],
                within_s=self.timeout,
            )
        rec["status"] = next(
            (
                r.event.get("status")
                for r in rx.log[rec["audio_started_index"] :]  # type: ignore[union-attr]
                if r.is_event("response.done", turn)
            ),
            None,
        )
        # the answer to the interruption is one more onset sample
        start_idx = istart if i is None else i
        try:
            irec = await self._answer(iutt, "interruption", trial, istart)
        except TimeoutError:
            irec = {
                "kind": "interruption",
                "trial": trial,
                "text": interruption,
                "ok": False,
                "error": "timed out",
            }
        self.turns.append(irec)
        await self._finish(irec)
        stop = irec.get("audio_started_index")
        trial_rec["leaked_frames"] = count_leaks(rx.log, start_idx, stop)
        if trial_rec["ok"]:
            reaction = (
                "n/a (answer audio had stalled)"
                if trial_rec["reaction_s"] is None
                else f"{trial_rec['reaction_s'] * 1000:.0f} ms"
            )
            self.progress(
                f"{label} {prompt!r} interrupted after {wait_s:.2f} s: reaction {reaction}, "
                f"leaked frames {trial_rec['leaked_frames']}; " + self._line(irec, "answer")
            )
        else:
            self.progress(f"{label} {prompt!r}: FAILED ({trial_rec['error']}); " + self._line(irec, "answer"))
