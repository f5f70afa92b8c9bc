"""`duplex eval eot`: predictive end of turn. How long the service waits after the user stops is
chosen per turn from the turn head's confidence; this measures what each choice costs.

The session core waits, after the user's last word (`duplex.core.session._turn_wait_ms`):
- `fast_turn_silence_ms` (≈ 200 ms) when the turn head says SPEAK and P(take) = 1 - P(listen) is at
  least the policy's `fast_take_threshold` (a confident "complete");
- `end_of_turn_silence_ms` (500 ms) for a less confident SPEAK;
- `backchannel_turn_silence_ms` (1.5 s) at a backchannel point, `incomplete_turn_silence_ms` (2 s) when
  the head says LISTEN (a mid-sentence pause: it waits for more words).

On held-out turns (`data/dialogue/turn_eval.jsonl`: complete turns and the same sentences cut
mid-way), as text and spoken in voices the project never trained on (`heldout_natural_speakers`:
flite `slt` and a Kokoro blend) then transcribed by the profile's ASR, the turn head's probabilities
are collected once; the sweep over `fast_take_threshold` then costs nothing. For each threshold:
- **wait on complete turns** (P50/P90/mean, ms): the part of the answer's onset that is waiting;
- **takeover at hesitations** (a cut followed by a 0.3-0.5 s pause: taken over if the wait is
  shorter): the new risk a short wait brings;
- **takeover at pauses** of 1-1.5 s (the issue's mid-sentence pauses; uniform in that range).
`--cut-audio whole` speaks each cut as part of its whole sentence and cuts the audio where the cut's
words end (`whole_cut`), as a mid-sentence pause sounds; by default the cut text is spoken alone.
The operating point is the lowest threshold (most turns fast) whose takeover at hesitations stays
within `--max-hesitation-takeover` on text (n ≈ 490 cuts) and `--max-hesitation-takeover-speech`
on speech (n = 60 cuts by default: one cut is 1.7 points); `--write` stores it in the turn heads'
metadata (`thresholds.fast_take`), where `load_turn_heads` reads it.

With a recogniser that gives the acoustic end-of-turn cue (`asr.end_of_turn`; each spoken row keeps it
as `p_voice`), the speech rows are swept once more at the chosen thresholds: a turn judged over whose
voice's P(complete) is below `acoustic_hold` waits `Waits.acoustic_hold` (1.5 s). Chosen: the threshold
with the least takeover at 1-1.5 s pauses among those that hold at most `--max-held-complete` of the
complete spoken turns longer (`thresholds.acoustic_hold` with `--write`). The cue works the other way
too: a SPEAK the head is less sure of (below `fast_take`) whose voice's P(complete) is at least
`voice_fast` ends after the short wait (two cues agree). Swept at the chosen hold; chosen: the lowest
threshold that keeps takeover at hesitations within the speech limit, adds no takeover at 1-1.5 s pauses,
and at which the cue alone is right about ≥ `--min-voice-precision` of the spoken turns it calls
complete (a guard: few cut turns reach that band of the head, so the takeover curves alone are flat)
(`thresholds.voice_fast`).

Last, at those thresholds, the wait at a backchannel point (`backchannel_turn_silence_ms`, a session
option) is swept: the shortest with at most `--max-pause-takeover` (5 %) at 1-1.5 s pauses on speech is
reported (not written: it is the session's default in `duplex.base.config.SessionOptions`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from dialogue.training.turn_sets import heldout_turn_examples, speech_examples
from duplex.base.config import SessionOptions
from duplex.base.paths import DATA_ROOT
from duplex.base.turn_policy import BACKCHANNEL, LISTEN, SPEAK, TurnPolicy

DATA = DATA_ROOT / "dialogue"
HESITATION_S = (0.3, 0.5)
PAUSE_S = (1.0, 1.5)
GRID = tuple(round(x, 3) for x in np.arange(0.50, 1.0001, 0.01))


_SESSION = SessionOptions()


@dataclass(frozen=True)
class Waits:
    """The session's waits in ms (SessionOptions' defaults)."""

    fast: int = _SESSION.fast_turn_silence_ms
    speak: int = _SESSION.end_of_turn_silence_ms
    backchannel: int = _SESSION.backchannel_turn_silence_ms
    listen: int = _SESSION.incomplete_turn_silence_ms
    acoustic_hold: int = _SESSION.acoustic_hold_silence_ms


def wait_ms(
    policy: TurnPolicy,
    probs: Sequence[float],
    waits: Waits,
    fast_take: float | None,
    graded_take: float | None = None,
    p_voice: float | None = None,
    acoustic_hold: float | None = None,
    voice_fast: float | None = None,
) -> int:
    """The silence the session waits before taking the turn, for one turn-head output (as
    `SessionCore._turn_wait_ms` with `TurnPolicy.end_wait_share`); `p_voice` is the ASR's acoustic
    P(complete), and a turn judged over whose voice is below `acoustic_hold` waits `waits.acoustic_hold`;
    a SPEAK below `fast_take` whose voice is at least `voice_fast` waits `waits.fast`."""
    d = policy.decide_turn(probs)
    if d == LISTEN:
        return waits.listen
    held = acoustic_hold is not None and p_voice is not None and p_voice < acoustic_hold
    if d == BACKCHANNEL:
        return max(waits.backchannel, waits.acoustic_hold) if held else waits.backchannel
    if held:
        return max(waits.speak, waits.acoustic_hold)
    assert d == SPEAK
    p = policy.p_take(probs)
    if fast_take is not None and p >= fast_take:
        return waits.fast
    if fast_take is not None and voice_fast is not None and p_voice is not None and p_voice >= voice_fast:
        return waits.fast
    if fast_take is not None and graded_take is not None and graded_take < fast_take and p >= graded_take:
        return waits.fast + round((fast_take - p) / (fast_take - graded_take) * (waits.speak - waits.fast))
    return waits.speak


def _taken(waits_ms: np.ndarray, pause_s: tuple[float, float]) -> float:
    """Share of pauses (uniform in `pause_s`) that a wait shorter than the pause takes over."""
    lo, hi = (1000 * p for p in pause_s)
    frac = np.clip((hi - waits_ms) / (hi - lo), 0.0, 1.0)  # P(pause > wait)
    return float(frac.mean()) if len(waits_ms) else float("nan")


def _wait_stats(wc: np.ndarray, wx: np.ndarray, waits: Waits) -> dict[str, float]:
    """The waits on complete turns (`wc`, ms) and what the waits after cuts (`wx`) take over."""
    return {
        "wait_p50_ms": float(np.percentile(wc, 50)) if len(wc) else float("nan"),
        "wait_p90_ms": float(np.percentile(wc, 90)) if len(wc) else float("nan"),
        "wait_mean_ms": float(wc.mean()) if len(wc) else float("nan"),
        "fast_share": float((wc == waits.fast).mean()) if len(wc) else float("nan"),
        "hesitation_takeover": _taken(wx, HESITATION_S),
        "pause_takeover": _taken(wx, PAUSE_S),
    }


def sweep(
    rows: list[dict[str, Any]], policy: TurnPolicy, waits: Waits, grid: Sequence[float] = GRID
) -> list[dict[str, Any]]:
    """One point per `fast_take_threshold` (None first: today's fixed hangover)."""
    complete = [r["probs"] for r in rows if r["label"] == SPEAK]
    cut = [r["probs"] for r in rows if r["label"] == LISTEN]
    out = []
    for thr in (None, *grid):
        wc = np.array([wait_ms(policy, p, waits, thr) for p in complete], dtype=float)
        wx = np.array([wait_ms(policy, p, waits, thr) for p in cut], dtype=float)
        out.append(
            {
                "fast_take": thr,
                "n_complete": len(wc),
                "n_cut": len(wx),
                **_wait_stats(wc, wx, waits),
            }
        )
    return out


def graded_sweep(
    rows: list[dict[str, Any]],
    policy: TurnPolicy,
    waits: Waits,
    fast_take: float,
    grid: Sequence[float] = GRID,
) -> list[dict[str, Any]]:
    """With `fast_take` fixed, one point per `graded_take` below it (None first: two steps)."""
    complete = [r["probs"] for r in rows if r["label"] == SPEAK]
    cut = [r["probs"] for r in rows if r["label"] == LISTEN]
    out = []
    for lo in (None, *sorted((g for g in grid if g < fast_take), reverse=True)):
        wc = np.array([wait_ms(policy, p, waits, fast_take, lo) for p in complete], dtype=float)
        wx = np.array([wait_ms(policy, p, waits, fast_take, lo) for p in cut], dtype=float)
        out.append(
            {
                "graded_take": lo,
                "wait_p50_ms": float(np.percentile(wc, 50)) if len(wc) else float("nan"),
                "wait_p90_ms": float(np.percentile(wc, 90)) if len(wc) else float("nan"),
                "wait_mean_ms": float(wc.mean()) if len(wc) else float("nan"),
                "hesitation_takeover": _taken(wx, HESITATION_S),
                "pause_takeover": _taken(wx, PAUSE_S),
            }
        )
    return out


def choose_graded(curves: dict[str, list[dict[str, Any]]], limits: dict[str, float]) -> float | None:
    """The lowest `graded_take` (the widest graded band) whose takeover at hesitations stays within each
    set's limit; None if not even the narrowest does (two steps stay)."""
    first = next(iter(curves.values()))
    best = None
    for i, point in enumerate(first):
        if point["graded_take"] is None:
            continue
        if all(c[i]["hesitation_takeover"] <= limits.get(name, 1.0) for name, c in curves.items()):
            best = float(point["graded_take"])
        else:
            break  # takeover only grows as the band widens
    return best


def choose(curves: dict[str, list[dict[str, Any]]], limits: dict[str, float]) -> float | None:
    """The lowest threshold whose takeover at hesitations stays within each set's limit. (Takeover
    at 1-1.5 s pauses does not depend on the threshold: both waits are shorter than such a pause.)"""
    first = next(iter(curves.values()))
    for i, point in enumerate(first):
        thr = point["fast_take"]
        if thr is None:
            continue
        if all(c[i]["hesitation_takeover"] <= limits.get(name, 1.0) for name, c in curves.items()):
            return float(thr)
    return None


ACOUSTIC_GRID = tuple(round(x, 3) for x in np.arange(0.05, 0.6001, 0.05))
VOICE_GRID = tuple(round(x, 3) for x in np.arange(0.40, 0.9501, 0.05))


def acoustic_sweep(
    rows: list[dict[str, Any]],
    policy: TurnPolicy,
    waits: Waits,
    fast_take: float | None,
    graded_take: float | None = None,
    grid: Sequence[float] = ACOUSTIC_GRID,
) -> list[dict[str, Any]]:
    """With the turn head's thresholds fixed, one point per acoustic hold threshold on the ASR's P(complete)
    (None first: no hold). Rows without a voice cue are never held."""
    complete = [r for r in rows if r["label"] == SPEAK]
    cut = [r for r in rows if r["label"] == LISTEN]

    def waits_of(subset: list[dict[str, Any]], thr: float | None) -> np.ndarray:
        return np.array(
            [
                wait_ms(policy, r["probs"], waits, fast_take, graded_take, r.get("p_voice"), thr)
                for r in subset
            ],
            dtype=float,
        )

    base = waits_of(complete, None)
    out = []
    for thr in (None, *grid):
        wc, wx = waits_of(complete, thr), waits_of(cut, thr)
        out.append(
            {
                "acoustic_hold": thr,
                "wait_p50_ms": float(np.percentile(wc, 50)) if len(wc) else float("nan"),
                "wait_p90_ms": float(np.percentile(wc, 90)) if len(wc) else float("nan"),
                "wait_mean_ms": float(wc.mean()) if len(wc) else float("nan"),
                "complete_held": float((wc > base).mean()) if len(wc) else float("nan"),
                "hesitation_takeover": _taken(wx, HESITATION_S),
                "pause_takeover": _taken(wx, PAUSE_S),
            }
        )
    return out


def voice_fast_sweep(
    rows: list[dict[str, Any]],
    policy: TurnPolicy,
    waits: Waits,
    fast_take: float | None,
    graded_take: float | None,
    acoustic_hold: float | None,
    grid: Sequence[float] = VOICE_GRID,
) -> list[dict[str, Any]]:
    """With the head's thresholds and the acoustic hold fixed, one point per `voice_fast` threshold (None
    first: off): a SPEAK below `fast_take` whose voice's P(complete) is at least it waits the short
    hangover. `voice_precision`: of the spoken turns the cue alone calls complete, the share that are."""
    complete = [r for r in rows if r["label"] == SPEAK]
    cut = [r for r in rows if r["label"] == LISTEN]

    def waits_of(subset: list[dict[str, Any]], thr: float | None) -> np.ndarray:
        return np.array(
            [
                wait_ms(
                    policy, r["probs"], waits, fast_take, graded_take, r.get("p_voice"), acoustic_hold, thr
                )
                for r in subset
            ],
            dtype=float,
        )

    pc = np.array([r["p_voice"] for r in complete if r.get("p_voice") is not None], dtype=float)
    px = np.array([r["p_voice"] for r in cut if r.get("p_voice") is not None], dtype=float)
    out = []
    for thr in (None, *grid):
        wc, wx = waits_of(complete, thr), waits_of(cut, thr)
        called = (int((pc >= thr).sum()), int((px >= thr).sum())) if thr is not None else (0, 0)
        out.append(
            {
                "voice_fast": thr,
                **_wait_stats(wc, wx, waits),
                "voice_precision": called[0] / sum(called) if sum(called) else None,
            }
        )
    return out


def choose_voice_fast(
    curve: list[dict[str, Any]], max_hesitation: float, min_precision: float
) -> float | None:
    """The lowest `voice_fast` threshold (most turns fast) whose takeover at hesitations is within
    `max_hesitation`, whose takeover at 1-1.5 s pauses is no higher than with it off, and at which the cue
    alone is right about at least `min_precision` of the turns it calls complete; None if none is, or if
    none makes a turn faster."""
    off = curve[0]
    for p in curve[1:]:
        if (
            p["hesitation_takeover"] <= max_hesitation
            and p["pause_takeover"] <= off["pause_takeover"] + 1e-9
            and p["voice_precision"] is not None
            and p["voice_precision"] >= min_precision
            and p["fast_share"] > off["fast_share"]
        ):
            return float(p["voice_fast"])
    return None


def choose_acoustic(curve: list[dict[str, Any]], max_held: float) -> float | None:
    """The acoustic hold threshold with the least takeover at 1-1.5 s pauses among those that hold at most
    `max_held` of the complete turns longer than the turn head alone would (the lower threshold on a tie);
    None if no threshold lowers the takeover."""
    ok = [p for p in curve if p["acoustic_hold"] is not None and p["complete_held"] <= max_held]
    if not ok:
        return None
    best = min(ok, key=lambda p: (round(p["pause_takeover"], 6), p["acoustic_hold"]))
    return float(best["acoustic_hold"]) if best["pause_takeover"] < curve[0]["pause_takeover"] else None


BACKCHANNEL_GRID = tuple(range(800, 2001, 100))


def backchannel_sweep(
    rows: list[dict[str, Any]],
    policy: TurnPolicy,
    waits: Waits,
    fast_take: float | None,
    graded_take: float | None,
    acoustic_hold: float | None,
    voice_fast: float | None,
    grid: Sequence[int] = BACKCHANNEL_GRID,
) -> list[dict[str, Any]]:
    """With every threshold fixed, one point per `backchannel_turn_silence_ms`: the silence after which a
    turn the head calls a backchannel point (a finished sentence the user may follow with another) is
    taken. A mid-sentence pause the head mistakes for one is taken over when it outlasts this wait, so
    takeover at 1-1.5 s pauses falls as it grows; the complete turns at such points wait that long.
    `complete_at_backchannel`: the share of complete turns that wait it."""
    complete = [r for r in rows if r["label"] == SPEAK]
    cut = [r for r in rows if r["label"] == LISTEN]
    at_point = np.array([policy.decide_turn(r["probs"]) == BACKCHANNEL for r in complete], dtype=bool)
    out = []
    for ms in grid:
        w = replace(waits, backchannel=int(ms))

        def waits_of(subset: list[dict[str, Any]], w: Waits = w) -> np.ndarray:
            return np.array(
                [
                    wait_ms(
                        policy,
                        r["probs"],
                        w,
                        fast_take,
                        graded_take,
                        r.get("p_voice"),
                        acoustic_hold,
                        voice_fast,
                    )
                    for r in subset
                ],
                dtype=float,
            )

        wc, wx = waits_of(complete), waits_of(cut)
        out.append(
            {
                "backchannel_ms": int(ms),
                **_wait_stats(wc, wx, w),
                "complete_at_backchannel": float(at_point.mean()) if len(at_point) else float("nan"),
            }
        )
    return out


def choose_backchannel(curve: list[dict[str, Any]], max_pause_takeover: float) -> int | None:
    """The shortest backchannel wait whose takeover at 1-1.5 s pauses is within `max_pause_takeover`;
    None if none is."""
    for p in curve:
        if p["pause_takeover"] <= max_pause_takeover + 1e-9:
            return int(p["backchannel_ms"])
    return None


def shipped_point(rows: list[dict[str, Any]], policy: TurnPolicy, waits: Waits) -> dict[str, Any]:
    """The waits and takeovers at the thresholds the heads ship with and the session's default waits, as
    the service runs: the acoustic hold and the voice-confirmed short wait where a row has the voice cue.
    On turns no threshold was chosen on, this is the held-out check of the whole rule."""
    complete = [r for r in rows if r["label"] == SPEAK]
    cut = [r for r in rows if r["label"] == LISTEN]

    def waits_of(subset: list[dict[str, Any]]) -> np.ndarray:
        return np.array(
            [
                wait_ms(
                    policy,
                    r["probs"],
                    waits,
                    policy.fast_take_threshold,
                    policy.graded_take_threshold,
                    r.get("p_voice"),
                    policy.acoustic_hold_threshold,
                    policy.voice_fast_threshold,
                )
                for r in subset
            ],
            dtype=float,
        )

    wc, wx = waits_of(complete), waits_of(cut)
    return {
        "n_complete": len(wc),
        "n_cut": len(wx),
        **_wait_stats(wc, wx, waits),
        # each cut turn's wait, so that an interval can be drawn over turns
        "cut_pause_taken": [round(_taken(np.array([w]), PAUSE_S), 4) for w in wx],
    }


# -- collecting the turn head's outputs ----------------------------------------------------------


def text_rows(stage: Any, examples: list[dict[str, Any]], progress: bool) -> list[dict[str, Any]]:
    from tqdm.auto import tqdm

    from duplex.base.messages import ListenStep

    rows = []
    for ex in tqdm(examples, desc="turn head (text)", disable=not progress):
        out, _ = stage.step(
            stage.init_state(),
            ListenStep(list(ex.get("history") or []), ex["text"], prefill_slow=False, preclose=False),
        )
        rows.append(_row(ex, ex["text"], "text", out.probs))
    return rows


def speech_rows(
    stage: Any,
    asr: Any,
    examples: list[dict[str, Any]],
    n: int,
    seed: int,
    progress: bool,
    cut_audio: str = "alone",
    exclude: Collection[str] = (),
) -> list[dict[str, Any]]:
    """n turns (half complete, half cut) spoken by the held-out voices in turn, then transcribed; none
    whose text is in `exclude` (the turns an earlier run spoke, for a fresh held-out check).

    `cut_audio`: "alone" speaks a cut turn's text as it is (it ends with a finished sentence's fall);
    "whole" speaks the sentence it was cut from and keeps the audio up to the cut (`whole_cut`), as a
    person pausing mid-sentence sounds, plus 200 ms of silence. The complete turns are spoken the same
    way in both."""
    from tqdm.auto import tqdm

    from asr.training.speakers import Synth, heldout_natural_speakers
    from asr.training.whole_cut import render_turn
    from duplex.base.messages import AsrChunk, ListenStep

    if cut_audio not in ("alone", "whole"):
        raise ValueError(f"cut_audio must be 'alone' or 'whole', not {cut_audio!r}")
    chosen = speech_examples(examples, n, seed, exclude)
    speakers = heldout_natural_speakers()
    synth, nprng = Synth(), np.random.default_rng(seed)
    rows = []
    for i, ex in enumerate(tqdm(chosen, desc="turn head (speech)", disable=not progress)):
        speaker = speakers[i % len(speakers)]
        try:
            audio, whole = render_turn(synth, ex, examples, speaker, nprng, cut_audio)
        except Exception as exc:  # an engine that is not installed: say which, once
            raise SystemExit(
                f"eval eot: cannot speak with {speaker.name} ({exc}); try `make asr-voices`"
            ) from None
        res, _ = asr.step(asr.init_state(), AsrChunk(samples=audio, transcribe=True, final=True))
        heard = str(res.text or "").strip()
        out, _ = stage.step(
            stage.init_state(),
            ListenStep(list(ex.get("history") or []), heard, prefill_slow=False, preclose=False),
        )
        row = _row(ex, heard, speaker.name, out.probs)
        p_voice = getattr(res, "p_complete", None)  # the ASR's acoustic end-of-turn cue, if it has one
        if p_voice is not None:
            row["p_voice"] = round(float(p_voice), 5)
        if whole is not None:
            row["cut_from"] = whole
        rows.append(row)
    return rows


def rescored_speech_rows(
    stage: Any,
    examples: list[dict[str, Any]],
    old: list[dict[str, Any]],
    seed: int,
    progress: bool,
    exclude: Collection[str] = (),
) -> list[dict[str, Any]]:
    """An earlier run's speech rows with the current turn head's outputs on the same transcripts (no
    speech is made or transcribed again): a paired comparison of two heads."""
    from tqdm.auto import tqdm

    from duplex.base.messages import ListenStep

    chosen = speech_examples(examples, len(old), seed, exclude)
    if [e["text"] for e in chosen] != [r["text"] for r in old]:
        raise SystemExit("eval eot --rescore: those speech rows were made from other held-out turns or seed")
    rows = []
    for ex, r in zip(tqdm(chosen, desc="turn head (transcripts)", disable=not progress), old, strict=True):
        out, _ = stage.step(
            stage.init_state(),
            ListenStep(list(ex.get("history") or []), r["heard"], prefill_slow=False, preclose=False),
        )
        row = _row(ex, r["heard"], r["voice"], out.probs)
        row.update({k: r[k] for k in ("p_voice", "cut_from") if k in r})
        rows.append(row)
    return rows


def _row(ex: dict[str, Any], heard: str, voice: str, probs: Sequence[float]) -> dict[str, Any]:
    return {
        "text": ex["text"],
        "heard": heard,
        "voice": voice,
        "label": int(ex["label"]),
        "kind": ex["kind"],
        "source": ex.get("source", ""),
        "probs": [round(float(p), 5) for p in probs],
    }


# -- report and plot ----------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    lines = [f"predictive end of turn ({results['date']}, take threshold {results['take_threshold']})"]
    chosen = results.get("chosen")
    for name, curve in results["curves"].items():
        base = curve[0]
        lines.append(f"  {name}: n complete {base['n_complete']}, n cut {base['n_cut']}")
        for p in curve:
            thr = p["fast_take"]
            if thr is None or thr == chosen or round(thr * 100) % 10 == 0 or thr >= 0.9:
                label = "fixed" if p["fast_take"] is None else f"{p['fast_take']:.2f}"
                mark = "  <- chosen" if chosen is not None and p["fast_take"] == chosen else ""
                lines.append(
                    f"    {label:>6}: wait P50 {p['wait_p50_ms']:4.0f} ms P90 {p['wait_p90_ms']:5.0f} ms, "
                    f"fast {100 * p['fast_share']:5.1f} %, takeover at hesitations "
                    f"{100 * p['hesitation_takeover']:4.1f} %, at 1-1.5 s pauses {100 * p['pause_takeover']:4.1f} %"
                    f"{mark}"
                )
    limits = ", ".join(f"{k} <= {100 * v:.0f} %" for k, v in results["limits"].items())
    lines.append(f"  chosen fast_take threshold: {chosen} (lowest with takeover at hesitations {limits})")
    graded = results.get("graded") or {}
    for name, curve in graded.items():
        lines.append(f"  graded below fast_take {chosen}, {name}:")
        for p in curve:
            lo = p["graded_take"]
            if lo is None or lo == results.get("chosen_graded") or round(lo * 100) % 5 == 0:
                label = "steps" if lo is None else f"{lo:.2f}"
                mark = "  <- chosen" if lo is not None and lo == results.get("chosen_graded") else ""
                lines.append(
                    f"    {label:>6}: wait P50 {p['wait_p50_ms']:4.0f} ms P90 {p['wait_p90_ms']:5.0f} ms mean "
                    f"{p['wait_mean_ms']:4.0f} ms, takeover at hesitations {100 * p['hesitation_takeover']:4.1f} %"
                    f"{mark}"
                )
    if graded:
        lines.append(f"  chosen graded_take threshold: {results.get('chosen_graded')} (same limits)")
    acoustic = results.get("acoustic")
    if acoustic:
        hold = results.get("waits_ms", {}).get("acoustic_hold", Waits().acoustic_hold)
        lines.append(
            f"  acoustic hold (speech; a turn judged over whose voice sounds unfinished waits {hold} ms):"
        )
        lines += _sweep_lines(
            acoustic,
            "acoustic_hold",
            results.get("chosen_acoustic"),
            lambda p: (
                f"complete held {100 * p['complete_held']:4.1f} %, takeover at hesitations "
                f"{100 * p['hesitation_takeover']:4.1f} %, at 1-1.5 s pauses {100 * p['pause_takeover']:4.1f} %"
            ),
        )
        lines.append(
            f"  chosen acoustic_hold threshold: {results.get('chosen_acoustic')} (least pause takeover holding "
            f"<= {100 * results.get('max_held_complete', 0):.0f} % of complete turns)"
        )
    voice = results.get("voice_fast")
    if voice:
        lines.append(
            "  voice-confirmed short wait (speech; a SPEAK below fast_take whose voice sounds finished):"
        )
        lines += _sweep_lines(
            voice,
            "voice_fast",
            results.get("chosen_voice_fast"),
            lambda p: (
                f"fast {100 * p['fast_share']:5.1f} %, takeover at hesitations "
                f"{100 * p['hesitation_takeover']:4.1f} %, at 1-1.5 s pauses {100 * p['pause_takeover']:4.1f} %, "
                f"cue precision {_pct(p['voice_precision'])}"
            ),
        )
        lines.append(
            f"  chosen voice_fast threshold: {results.get('chosen_voice_fast')} (lowest within the speech "
            f"hesitation limit, no more pause takeover, cue precision >= "
            f"{100 * results.get('min_voice_precision', 0):.0f} %)"
        )
    for name, curve in (results.get("backchannel") or {}).items():
        share = curve[0]["complete_at_backchannel"] if curve else float("nan")
        lines.append(
            f"  backchannel wait ({name}; {100 * share:.1f} % of complete turns are called backchannel points):"
        )
        lines += _sweep_lines(
            curve,
            "backchannel_ms",
            results.get("chosen_backchannel_ms"),
            lambda p: (
                f"takeover at hesitations {100 * p['hesitation_takeover']:4.1f} %, "
                f"at 1-1.5 s pauses {100 * p['pause_takeover']:4.1f} %"
            ),
            fmt="{:.0f} ms",
        )
    if results.get("backchannel"):
        lines.append(
            f"  shortest backchannel wait with takeover at 1-1.5 s pauses <= "
            f"{100 * results.get('max_pause_takeover', 0):.0f} %: {results.get('chosen_backchannel_ms')} ms "
            f"(the session option backchannel_turn_silence_ms; today {Waits().backchannel} ms)"
        )
    for name, p in (results.get("shipped") or {}).items():
        fresh = name == "speech" and results.get("speech_exclude")
        note = (
            f"; none of the {len(results['speech_exclude'])} turns spoken in "
            f"{', '.join(results.get('speech_exclude_from') or [])}"
            if fresh
            else ""
        )
        lo, hi = _turn_interval(p.get("cut_pause_taken") or [])
        lines.append(
            f"  at the shipped thresholds and waits ({name}, n {p['n_complete']} complete + {p['n_cut']} cut{note}): "
            f"takeover at 1-1.5 s pauses {100 * p['pause_takeover']:.1f} % (95 % interval over turns "
            f"{100 * lo:.1f}-{100 * hi:.1f} %), at hesitations {100 * p['hesitation_takeover']:.1f} %; complete "
            f"turns: fast {100 * p['fast_share']:.1f} %, wait P50 {p['wait_p50_ms']:.0f} ms P90 "
            f"{p['wait_p90_ms']:.0f} ms mean {p['wait_mean_ms']:.0f} ms"
        )
    return "\n".join(lines)


def _turn_interval(values: Sequence[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap 95 % interval of the mean of per-turn values (nan, nan if none)."""
    x = np.asarray(values, dtype=float)
    if not len(x):
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(n_boot, len(x)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def _sweep_lines(
    curve: list[dict[str, Any]],
    key: str,
    chosen: float | None,
    rest: Callable[[dict[str, Any]], str],
    fmt: str = "{:.2f}",
) -> list[str]:
    """One report line per point of a sweep: its threshold (or off), the wait, then `rest`."""
    lines = []
    for p in curve:
        thr = p[key]
        label = "off" if thr is None else fmt.format(thr)
        mark = "  <- chosen" if thr is not None and thr == chosen else ""
        lines.append(
            f"    {label:>6}: wait P50 {p['wait_p50_ms']:4.0f} ms P90 {p['wait_p90_ms']:5.0f} ms mean "
            f"{p['wait_mean_ms']:4.0f} ms, {rest(p)}{mark}"
        )
    return lines


def _pct(x: float | None) -> str:
    return "    -  " if x is None else f"{100 * x:5.1f} %"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acoustic = results.get("acoustic")
    voice = results.get("voice_fast")
    backchannel = results.get("backchannel") or {}
    panels = 3 + bool(acoustic) + bool(voice) + bool(backchannel)
    fig, ax = plt.subplots(1, panels, figsize=(5.3 * panels, 4.2))
    for name, curve in results["curves"].items():
        pts = [p for p in curve if p["fast_take"] is not None]
        ax[0].plot(
            [p["wait_mean_ms"] for p in pts], [100 * p["hesitation_takeover"] for p in pts], ".-", label=name
        )
        ax[1].plot([p["fast_take"] for p in pts], [p["wait_p50_ms"] for p in pts], ".-", label=f"{name} P50")
        ax[1].plot([p["fast_take"] for p in pts], [p["wait_p90_ms"] for p in pts], ":", label=f"{name} P90")
        fixed = curve[0]
        ax[0].plot([fixed["wait_mean_ms"]], [100 * fixed["hesitation_takeover"]], "x", color="k")
    if results.get("chosen") is not None:
        ax[1].axvline(results["chosen"], color="k", lw=0.8, ls="--", label="chosen")
    ax[0].set_xlabel("mean wait on complete turns (ms)")
    ax[0].set_ylabel("takeover at 0.3-0.5 s hesitations (%)")
    ax[0].set_title("latency vs false takeover (x: fixed 500 ms)")
    ax[1].set_xlabel("fast_take threshold on P(take)")
    ax[1].set_ylabel("wait on complete turns (ms)")
    ax[1].set_title("wait by threshold")
    for name, curve in (results.get("graded") or {}).items():
        pts = [p for p in curve if p["graded_take"] is not None]
        ax[2].plot(
            [p["wait_mean_ms"] for p in pts], [100 * p["hesitation_takeover"] for p in pts], ".-", label=name
        )
        ax[2].plot([curve[0]["wait_mean_ms"]], [100 * curve[0]["hesitation_takeover"]], "x", color="k")
    ax[2].set_xlabel("mean wait on complete turns (ms)")
    ax[2].set_ylabel("takeover at 0.3-0.5 s hesitations (%)")
    ax[2].set_title("graded wait below the chosen threshold (x: two steps)")
    if acoustic:
        pts = [p for p in acoustic if p["acoustic_hold"] is not None]
        ax[3].plot([100 * p["complete_held"] for p in pts], [100 * p["pause_takeover"] for p in pts], ".-")
        for p in pts:
            ax[3].annotate(
                f"{p['acoustic_hold']:.2f}", (100 * p["complete_held"], 100 * p["pause_takeover"]), fontsize=7
            )
        ax[3].plot([0], [100 * acoustic[0]["pause_takeover"]], "x", color="k")
        ax[3].set_xlabel("complete spoken turns held longer (%)")
        ax[3].set_ylabel("takeover at 1-1.5 s pauses (%)")
        ax[3].set_title("acoustic hold by threshold (x: off)")
    if voice:
        a = ax[3 + bool(acoustic)]
        pts = [p for p in voice if p["voice_fast"] is not None]
        a.plot(
            [100 * p["fast_share"] for p in pts],
            [100 * p["hesitation_takeover"] for p in pts],
            ".-",
            label="hesitations",
        )
        a.plot(
            [100 * p["fast_share"] for p in pts],
            [100 * p["pause_takeover"] for p in pts],
            ".-",
            label="1-1.5 s pauses",
        )
        for p in pts[::2]:
            a.annotate(
                f"{p['voice_fast']:.2f}", (100 * p["fast_share"], 100 * p["hesitation_takeover"]), fontsize=7
            )
        a.plot([100 * voice[0]["fast_share"]], [100 * voice[0]["hesitation_takeover"]], "x", color="k")
        if results.get("chosen_voice_fast") is not None:
            c = next(p for p in pts if p["voice_fast"] == results["chosen_voice_fast"])
            a.plot(
                [100 * c["fast_share"]],
                [100 * c["hesitation_takeover"]],
                "o",
                mfc="none",
                color="k",
                label="chosen",
            )
        a.set_xlabel("complete spoken turns taken after the short wait (%)")
        a.set_ylabel("takeover (%)")
        a.set_title("voice-confirmed short wait by threshold (x: off)")
    if backchannel:
        a = ax[-1]
        for name, curve in backchannel.items():
            a.plot(
                [p["wait_mean_ms"] for p in curve],
                [100 * p["pause_takeover"] for p in curve],
                ".-",
                label=name,
            )
            for p in curve[::2]:
                a.annotate(
                    f"{p['backchannel_ms']}", (p["wait_mean_ms"], 100 * p["pause_takeover"]), fontsize=7
                )
        chosen_ms = results.get("chosen_backchannel_ms")
        if chosen_ms is not None:
            name = "speech" if "speech" in backchannel else "text"
            c = next(p for p in backchannel[name] if p["backchannel_ms"] == chosen_ms)
            a.plot(
                [c["wait_mean_ms"]], [100 * c["pause_takeover"]], "o", mfc="none", color="k", label="chosen"
            )
        a.axhline(100 * results.get("max_pause_takeover", 0.05), color="k", lw=0.8, ls="--")
        a.set_xlabel("mean wait on complete turns (ms)")
        a.set_ylabel("takeover at 1-1.5 s pauses (%)")
        a.set_title("backchannel wait (ms, labelled)")
    for a in ax:
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command -------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--profile", default=None, help="models.yaml profile (default: the file's default)")
    ap.add_argument("--speech", type=int, default=120, help="held-out turns spoken and transcribed (0 skips)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cut-audio",
        choices=("alone", "whole"),
        default="alone",
        help="speak a cut turn alone (ends like a finished sentence) or cut it from its whole sentence's audio",
    )
    ap.add_argument("--max-hesitation-takeover", type=float, default=0.01, help="on held-out text")
    ap.add_argument("--max-hesitation-takeover-speech", type=float, default=0.05, help="on held-out speech")
    ap.add_argument(
        "--max-held-complete",
        type=float,
        default=0.08,
        help="the acoustic hold may keep at most this share of complete spoken turns waiting longer",
    )
    ap.add_argument(
        "--min-voice-precision",
        type=float,
        default=0.9,
        help="the voice-confirmed short wait needs the cue alone right about this share of the turns it calls complete",
    )
    ap.add_argument(
        "--max-pause-takeover",
        type=float,
        default=0.05,
        help="the backchannel wait is chosen as the shortest with at most this takeover at 1-1.5 s pauses "
        "(on speech when there is speech)",
    )
    ap.add_argument(
        "--exclude-rows",
        nargs="+",
        default=[],
        metavar="JSON",
        help="never speak the turns these earlier eot.json files spoke: a fresh held-out check of "
        "thresholds chosen on them (see the report's 'at the shipped thresholds')",
    )
    ap.add_argument("--out", default="eval-out", help="folder for eot.json and eot.png")
    ap.add_argument(
        "--rows", default=None, metavar="JSON", help="reuse the turn-head outputs of an earlier eot.json"
    )
    ap.add_argument(
        "--rescore",
        default=None,
        metavar="JSON",
        help="reuse the speech transcripts of an earlier eot.json with the current turn head (no ASR run)",
    )
    ap.add_argument(
        "--write", action="store_true", help="store the chosen threshold in the turn heads' metadata"
    )
    ap.add_argument(
        "--write-acoustic",
        action="store_true",
        help="sweep the acoustic cue at the heads' shipped thresholds and store only its thresholds "
        "(acoustic_hold, voice_fast)",
    )
    ap.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from dialogue.turn_taking import heads_metadata_path

    progress = not args.no_progress
    source: dict[str, Any] = {}
    if args.rows:
        source = json.loads(Path(args.rows).read_text())
        rows = source["rows"]
        policy = _policy_of(None)
    # the turns the speech rows were kept apart from: read once, used to choose them and recorded
    excluded, excluded_from = _exclusion(args, source)
    if not args.rows:
        rows, policy = _collect(args, progress, excluded)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        # --rows: the turn-head outputs are that run's
        **({"rows_from": {"path": str(args.rows), "date": source.get("date")}} if source else {}),
        # rows cut from their whole sentence's audio say which sentence (`cut_from`)
        "cut_audio": (
            ("whole" if any("cut_from" in r for r in rows) else "alone")
            if source
            else getattr(args, "cut_audio", "alone")
        ),
        "take_threshold": policy.take_threshold,
        "limits": {"text": args.max_hesitation_takeover, "speech": args.max_hesitation_takeover_speech},
        "waits_ms": vars(Waits()),
        "curves": {},
    }
    for name in ("text", "speech"):
        subset = [r for r in rows if (r["voice"] == "text") == (name == "text")]
        if subset:
            results["curves"][name] = sweep(subset, policy, Waits())
    results["chosen"] = choose(results["curves"], results["limits"])
    results["graded"], results["chosen_graded"] = {}, None
    if results["chosen"] is not None:
        for name in results["curves"]:
            subset = [r for r in rows if (r["voice"] == "text") == (name == "text")]
            results["graded"][name] = graded_sweep(subset, policy, Waits(), results["chosen"])
        results["chosen_graded"] = choose_graded(results["graded"], results["limits"])
    speech = [r for r in rows if r["voice"] != "text"]
    results["acoustic"], results["chosen_acoustic"] = None, None
    results["voice_fast"], results["chosen_voice_fast"] = None, None
    if any(r.get("p_voice") is not None for r in speech):
        # at the thresholds the heads ship with (--write-acoustic) or at the ones chosen here
        shipped = bool(getattr(args, "write_acoustic", False))
        fast = policy.fast_take_threshold if shipped else results["chosen"]
        graded = policy.graded_take_threshold if shipped else results["chosen_graded"]
        results["acoustic_at"] = {"fast_take": fast, "graded_take": graded}
        results["acoustic"] = acoustic_sweep(speech, policy, Waits(), fast, graded)
        results["max_held_complete"] = args.max_held_complete
        results["chosen_acoustic"] = choose_acoustic(results["acoustic"], args.max_held_complete)
        results["voice_fast"] = voice_fast_sweep(
            speech, policy, Waits(), fast, graded, results["chosen_acoustic"]
        )
        results["min_voice_precision"] = args.min_voice_precision
        results["chosen_voice_fast"] = choose_voice_fast(
            results["voice_fast"], args.max_hesitation_takeover_speech, args.min_voice_precision
        )
    # the backchannel wait, at the thresholds above (speech: with the voice cue's hold and short wait)
    at = results.get("acoustic_at") or {
        "fast_take": results["chosen"],
        "graded_take": results["chosen_graded"],
    }
    results["backchannel"] = {}
    for name in results["curves"]:
        subset = [r for r in rows if (r["voice"] == "text") == (name == "text")]
        voiced = name == "speech"
        results["backchannel"][name] = backchannel_sweep(
            subset,
            policy,
            Waits(),
            at["fast_take"],
            at["graded_take"],
            results["chosen_acoustic"] if voiced else None,
            results["chosen_voice_fast"] if voiced else None,
        )
    results["max_pause_takeover"] = args.max_pause_takeover
    basis = results["backchannel"].get("speech") or results["backchannel"].get("text")
    results["chosen_backchannel_ms"] = choose_backchannel(basis, args.max_pause_takeover) if basis else None
    results["shipped"] = {
        name: shipped_point([r for r in rows if (r["voice"] == "text") == (name == "text")], policy, Waits())
        for name in results["curves"]
    }
    if excluded:
        results["speech_exclude"], results["speech_exclude_from"] = excluded, excluded_from
    results["rows"] = rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eot.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "eot.png")
    print(report(results))
    print(f"wrote {out / 'eot.json'} and {out / 'eot.png'}")
    if getattr(args, "write_acoustic", False):
        if results["acoustic"] is None:
            raise SystemExit(
                "eval eot --write-acoustic: no spoken row has the ASR's voice cue; nothing written"
            )
        path = heads_metadata_path()
        meta = json.loads(path.read_text())
        meta["thresholds"]["acoustic_hold"] = results["chosen_acoustic"]
        meta["thresholds"]["voice_fast"] = results["chosen_voice_fast"]
        meta.setdefault("calibration", {})["acoustic_hold"] = _acoustic_calibration(results)
        path.write_text(json.dumps(meta, indent=1) + "\n")
        print(
            f"wrote acoustic_hold {results['chosen_acoustic']}, voice_fast {results['chosen_voice_fast']} "
            f"into {path}"
        )
    if args.write:
        if results["chosen"] is None:
            raise SystemExit("eval eot: no threshold meets the limits; nothing written")
        path = heads_metadata_path()
        meta = json.loads(path.read_text())
        meta["thresholds"]["fast_take"] = results["chosen"]
        meta["thresholds"]["graded_take"] = results["chosen_graded"]
        if results["acoustic"] is not None:
            meta["thresholds"]["acoustic_hold"] = results["chosen_acoustic"]
            meta["thresholds"]["voice_fast"] = results["chosen_voice_fast"]
        meta.setdefault("calibration", {})["fast_take"] = {
            "command": "duplex eval eot --write",
            "date": results["date"],
            "limits": results["limits"],
            "at_chosen": {
                name: next(p for p in c if p["fast_take"] == results["chosen"])
                for name, c in results["curves"].items()
            },
            "graded_at_chosen": {
                name: next(p for p in c if p["graded_take"] == results["chosen_graded"])
                for name, c in results["graded"].items()
            },
        }
        if results["acoustic"] is not None:
            meta["calibration"]["acoustic_hold"] = _acoustic_calibration(results)
        path.write_text(json.dumps(meta, indent=1) + "\n")
        print(
            f"wrote fast_take {results['chosen']}, graded_take {results['chosen_graded']}, "
            f"acoustic_hold {results['chosen_acoustic']} into {path}"
        )
    return 0


def _acoustic_calibration(results: dict[str, Any]) -> dict[str, Any]:
    return {
        "command": "duplex eval eot --speech N --cut-audio whole --write[-acoustic]",
        "date": results["date"],
        "cut_audio": results["cut_audio"],
        "rows_from": results.get("rows_from"),
        "at_turn_thresholds": results.get("acoustic_at"),
        "max_held_complete": results["max_held_complete"],
        "hold_ms": Waits().acoustic_hold,
        "off": results["acoustic"][0],
        "at_chosen": next(p for p in results["acoustic"] if p["acoustic_hold"] == results["chosen_acoustic"]),
        "min_voice_precision": results.get("min_voice_precision"),
        "voice_fast_off": (results.get("voice_fast") or [None])[0],
        "voice_fast_at_chosen": next(
            (
                p
                for p in results.get("voice_fast") or []
                if p["voice_fast"] == results.get("chosen_voice_fast")
            ),
            None,
        ),
    }


def _policy_of(stage: Any) -> TurnPolicy:
    if stage is not None:
        return stage.policy  # type: ignore[no-any-return]
    from dialogue.turn_taking import heads_metadata_path

    th = json.loads(heads_metadata_path().read_text())["thresholds"]
    return TurnPolicy(
        float(th["speak"]),
        float(th["backchannel"]),
        float(th["interrupt"]),
        th.get("take"),
        fast_take_threshold=th.get("fast_take"),
        graded_take_threshold=th.get("graded_take"),
        acoustic_hold_threshold=th.get("acoustic_hold"),
        voice_fast_threshold=th.get("voice_fast"),
    )


def _collect(
    args: argparse.Namespace, progress: bool, excluded: Collection[str] = ()
) -> tuple[list[dict[str, Any]], TurnPolicy]:
    import torch

    from dialogue.engine import load_dialogue_stage
    from duplex.base.config import load_profile
    from duplex.runtime.service import load_asr

    torch.manual_seed(args.seed)
    profile = load_profile(args.profile)
    drafter = profile.components.get("drafter")
    if drafter is None:
        raise SystemExit(f"eval eot: profile {profile.name!r} has no drafter (no turn head to calibrate)")
    stage = load_dialogue_stage(profile.component("llm"), drafter, progress=progress)
    examples = heldout_turn_examples(DATA / "turn_eval.jsonl")
    rows = text_rows(stage, examples, progress)
    if args.rescore:
        old = [r for r in json.loads(Path(args.rescore).read_text())["rows"] if r["voice"] != "text"]
        rows += rescored_speech_rows(stage, examples, old, args.seed, progress, excluded)
    elif args.speech:
        asr = load_asr(profile.component("asr"))
        rows += speech_rows(stage, asr, examples, args.speech, args.seed, progress, args.cut_audio, excluded)
    return rows, _policy_of(stage)


def _exclusion(args: argparse.Namespace, source: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The spoken turns this run's speech rows were kept apart from, and the files that named them: an
    earlier run's when its rows are reused (`--rows`, `--rescore`), else `--exclude-rows`."""
    earlier = source
    if not earlier and getattr(args, "rescore", None):
        earlier = json.loads(Path(args.rescore).read_text())
    if earlier:
        return list(earlier.get("speech_exclude") or []), list(earlier.get("speech_exclude_from") or [])
    return excluded_turns(args), [str(p) for p in getattr(args, "exclude_rows", None) or []]


def excluded_turns(args: argparse.Namespace) -> list[str]:
    """The texts of the spoken turns in `--exclude-rows` files (sorted, each once)."""
    texts: set[str] = set()
    for path in getattr(args, "exclude_rows", None) or []:
        try:
            rows = json.loads(Path(path).read_text())["rows"]
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"eval eot --exclude-rows: cannot read spoken rows from {path}: {exc}") from None
        texts |= {r["text"] for r in rows if r.get("voice") != "text"}
    return sorted(texts)
