"""The predictive end-of-turn calibration: waits, the takeover model and the choice of threshold."""

from __future__ import annotations

import math

import pytest

from duplex.base.turn_policy import LISTEN, SPEAK, TurnPolicy
from duplex.eval import eot as E
from duplex.eval.eot import Waits, choose, sweep, wait_ms

POLICY = TurnPolicy(0.5, 0.7, 0.5, take_threshold=0.6)


def test_wait_follows_the_session_rule():
    w = Waits()
    assert wait_ms(POLICY, (0.02, 0.03, 0.95), w, 0.9) == w.fast
    assert wait_ms(POLICY, (0.2, 0.05, 0.75), w, 0.9) == w.speak  # speak, less sure
    assert wait_ms(POLICY, (0.02, 0.03, 0.95), w, None) == w.speak  # uncalibrated: the fixed hangover
    assert wait_ms(POLICY, (0.05, 0.6, 0.35), w, 0.9) == w.backchannel
    assert wait_ms(POLICY, (0.8, 0.1, 0.1), w, 0.9) == w.listen


def _rows():
    complete = [{"label": 2, "probs": (0.01, 0.01, 0.98)}] * 6 + [{"label": 2, "probs": (0.3, 0.0, 0.7)}] * 4
    # cuts: 8 the head knows go on, one it is sure is over, one it half thinks is over
    cut = (
        [{"label": 0, "probs": (0.9, 0.05, 0.05)}] * 8
        + [{"label": 0, "probs": (0.02, 0.0, 0.98)}]
        + [{"label": 0, "probs": (0.3, 0.0, 0.7)}]
    )
    return complete + cut


def test_sweep_counts_the_waits_and_the_takeovers():
    curve = sweep(_rows(), POLICY, Waits(), grid=(0.9, 0.995))
    fixed, at90, at995 = curve
    assert fixed["fast_take"] is None and fixed["fast_share"] == 0 and fixed["wait_p50_ms"] == 500
    # every wait is shorter than a 1-1.5 s pause: the two cuts the head takes are taken over anyway
    assert all(math.isclose(p["pause_takeover"], 0.2) for p in curve)
    # a 500 ms wait never takes a 0.3-0.5 s hesitation; a 200 ms one does (the sure cut)
    assert fixed["hesitation_takeover"] == 0
    assert math.isclose(at90["hesitation_takeover"], 0.1) and math.isclose(at90["fast_share"], 0.6)
    assert at90["wait_p50_ms"] == 200 and at995["hesitation_takeover"] == 0 and at995["fast_share"] == 0


def test_choose_takes_the_lowest_threshold_within_every_limit():
    curves = {"text": sweep(_rows(), POLICY, Waits(), grid=(0.9, 0.995))}
    assert choose(curves, {"text": 0.15}) == 0.9
    assert choose(curves, {"text": 0.05}) == 0.995
    curves["speech"] = curves["text"]
    assert choose(curves, {"text": 0.15, "speech": 0.05}) == 0.995


def test_graded_wait_follows_the_session_rule():
    w = Waits()
    # P(take) 0.8 is half-way into a 0.7-0.9 band: half-way between the short and the full hangover
    assert wait_ms(POLICY, (0.2, 0.05, 0.75), w, 0.9, 0.7) == 350
    assert wait_ms(POLICY, (0.02, 0.03, 0.95), w, 0.9, 0.7) == w.fast
    assert wait_ms(POLICY, (0.35, 0.0, 0.65), w, 0.9, 0.7) == w.speak  # below the band
    assert wait_ms(POLICY, (0.05, 0.6, 0.35), w, 0.9, 0.7) == w.backchannel  # not graded


def test_graded_sweep_trades_the_p90_wait_for_takeover():
    from duplex.eval.eot import choose_graded, graded_sweep

    curve = graded_sweep(_rows(), POLICY, Waits(), 0.9, grid=(0.6, 0.65, 0.9, 0.95))
    steps, at65, at60 = curve  # thresholds at or above fast_take are not graded bands
    assert steps["graded_take"] is None and steps["wait_p90_ms"] == 500
    # the four P(take) 0.7 complete turns wait (0.9-0.7)/(0.9-0.65) of the way: 200 + 0.8 * 300 = 440 ms
    assert at65["wait_p90_ms"] == 440 and at60["wait_p90_ms"] < at65["wait_p90_ms"]
    # ... and so does the P(take) 0.7 cut: a 0.3-0.5 s hesitation longer than its wait is taken over
    assert math.isclose(at65["hesitation_takeover"], 0.1 + 0.1 * (500 - 440) / 200)
    assert choose_graded({"text": curve}, {"text": 0.135}) == 0.65  # at 0.6: 0.15
    assert choose_graded({"text": curve}, {"text": 0.125}) is None


def test_acoustic_hold_follows_the_session_rule():
    w = Waits()
    sure = (0.02, 0.03, 0.95)
    assert wait_ms(POLICY, sure, w, 0.9, None, 0.2, 0.3) == w.acoustic_hold  # the voice did not finish
    assert wait_ms(POLICY, sure, w, 0.9, None, 0.5, 0.3) == w.fast  # it did
    assert wait_ms(POLICY, sure, w, 0.9, None, None, 0.3) == w.fast  # no cue
    assert wait_ms(POLICY, (0.05, 0.6, 0.35), w, 0.9, None, 0.2, 0.3) == w.acoustic_hold  # backchannel point
    assert wait_ms(POLICY, (0.8, 0.1, 0.1), w, 0.9, None, 0.2, 0.3) == w.listen  # listen waits longer


def test_acoustic_sweep_trades_held_complete_turns_for_pause_takeover():
    from duplex.eval.eot import acoustic_sweep, choose_acoustic

    sure, listen = (0.02, 0.0, 0.98), (0.9, 0.05, 0.05)
    # 10 complete turns, the head sure of each; the voice cue low on one of them
    complete = [{"label": SPEAK, "probs": sure, "p_voice": 0.8}] * 9 + [
        {"label": SPEAK, "probs": sure, "p_voice": 0.2}
    ]
    # 10 cuts: 6 the head knows go on, 4 it reads as over (the voice: two clearly unfinished, two not)
    cut = (
        [{"label": LISTEN, "probs": listen, "p_voice": 0.1}] * 6
        + [{"label": LISTEN, "probs": sure, "p_voice": 0.1}] * 2
        + [{"label": LISTEN, "probs": sure, "p_voice": 0.6}] * 2
    )
    curve = acoustic_sweep(complete + cut, POLICY, Waits(), 0.9, grid=(0.15, 0.3, 0.7))
    off, at15, at30, at70 = curve
    assert off["acoustic_hold"] is None and math.isclose(off["pause_takeover"], 0.4)
    assert at15["complete_held"] == 0 and math.isclose(at15["pause_takeover"], 0.2)  # the two clear cuts held
    assert math.isclose(at30["complete_held"], 0.1) and math.isclose(at30["pause_takeover"], 0.2)
    assert at70["pause_takeover"] == 0 and math.isclose(at70["complete_held"], 0.1)
    # 1.5 s outlasts every 1-1.5 s pause: a held cut is never taken over
    assert choose_acoustic(curve, max_held=0.05) == 0.15
    assert choose_acoustic(curve, max_held=0.1) == 0.7  # no takeover left, one complete turn in ten held
    assert choose_acoustic(curve[:1], max_held=0.05) is None  # no threshold to choose


def test_voice_fast_follows_the_session_rule():
    w = Waits()
    unsure = (0.25, 0.05, 0.70)  # SPEAK below fast_take 0.9
    assert wait_ms(POLICY, unsure, w, 0.9, None, 0.8, 0.3, 0.7) == w.fast  # the voice sounded finished
    assert wait_ms(POLICY, unsure, w, 0.9, None, 0.6, 0.3, 0.7) == w.speak  # not sure enough
    assert wait_ms(POLICY, unsure, w, 0.9, None, 0.2, 0.3, 0.7) == w.acoustic_hold  # unfinished: held
    assert wait_ms(POLICY, unsure, w, None, None, 0.9, 0.3, 0.7) == w.speak  # the short wait off


def test_voice_fast_sweep_chooses_the_lowest_safe_threshold():
    from duplex.eval.eot import choose_voice_fast, voice_fast_sweep

    unsure, listen = (0.25, 0.05, 0.70), (0.9, 0.05, 0.05)
    # 10 complete turns the head is unsure of, the voice cue 0.55..1.0; 10 cuts: 8 the head knows go on,
    # 2 it calls complete, unsure, with the voice at 0.6
    complete = [{"label": SPEAK, "probs": unsure, "p_voice": 0.55 + 0.05 * i} for i in range(10)]
    cut = [{"label": LISTEN, "probs": listen, "p_voice": 0.3}] * 8 + [
        {"label": LISTEN, "probs": unsure, "p_voice": 0.6}
    ] * 2
    curve = voice_fast_sweep(complete + cut, POLICY, Waits(), 0.9, None, None, grid=(0.5, 0.65, 0.9))
    off, at50, at65, at90 = curve
    assert off["fast_share"] == 0 and off["hesitation_takeover"] == 0
    assert at50["fast_share"] == 1.0 and math.isclose(at50["hesitation_takeover"], 0.2)  # the two cuts
    assert math.isclose(at65["fast_share"], 0.8) and at65["hesitation_takeover"] == 0
    assert at65["voice_precision"] == 1.0 and math.isclose(at50["voice_precision"], 10 / 12)
    assert choose_voice_fast(curve, max_hesitation=0.05, min_precision=0.9) == 0.65
    assert choose_voice_fast(curve, max_hesitation=0.25, min_precision=0.8) == 0.5
    assert choose_voice_fast(curve[:1], max_hesitation=0.05, min_precision=0.9) is None


class _LengthHead:
    """A turn head that calls a transcript complete by its length: P(listen) = 1 / words."""

    def init_state(self) -> None:
        return None

    def step(self, state: None, step: object) -> tuple[object, None]:
        from types import SimpleNamespace

        words = max(1, len(str(step.text).split()))  # type: ignore[attr-defined]
        return SimpleNamespace(probs=[1 / words, 0.0, 1 - 1 / words]), None


def test_rescoring_reuses_the_transcripts_and_refuses_other_turns() -> None:
    examples = [
        {"text": f"turn {i} " + "word " * i, "label": LISTEN if i % 2 else SPEAK, "kind": "k", "history": []}
        for i in range(1, 11)
    ]
    old = [
        E._row(ex, f"heard {ex['text']}", "flite:slt", [0.5, 0.0, 0.5])
        for ex in E.speech_examples(examples, 6, 0)
    ]
    rows = E.rescored_speech_rows(_LengthHead(), examples, old, seed=0, progress=False)
    assert [(r["text"], r["heard"], r["voice"], r["label"]) for r in rows] == [
        (o["text"], o["heard"], o["voice"], o["label"]) for o in old
    ]
    assert [r["probs"][0] for r in rows] == [round(1 / len(o["heard"].split()), 5) for o in old]
    with pytest.raises(SystemExit, match="other held-out turns"):
        E.rescored_speech_rows(_LengthHead(), examples, old, seed=1, progress=False)


def test_backchannel_wait_sweep_trades_pause_takeover_for_waits_at_backchannel_points():
    """A cut the head calls a backchannel point is taken over by every 1-1.5 s pause the wait is shorter
    than; complete turns at such points wait it out. The choice is the shortest wait within the limit."""
    bc = (0.05, 0.6, 0.35)  # decided BACKCHANNEL by POLICY
    rows = (
        [{"label": 2, "probs": (0.01, 0.01, 0.98)}] * 8
        + [{"label": 2, "probs": bc}] * 2
        + [{"label": 0, "probs": (0.9, 0.05, 0.05)}] * 9
        + [{"label": 0, "probs": bc}]
    )
    curve = E.backchannel_sweep(rows, POLICY, Waits(), 0.9, None, None, None, grid=(1000, 1250, 1500))
    at1000, at1250, at1500 = curve
    assert [p["backchannel_ms"] for p in curve] == [1000, 1250, 1500]
    assert all(math.isclose(p["complete_at_backchannel"], 0.2) for p in curve)
    # the one cut at a backchannel point: taken by every pause at 1 s, by half of them at 1.25 s, none at 1.5 s
    assert math.isclose(at1000["pause_takeover"], 0.1)
    assert math.isclose(at1250["pause_takeover"], 0.05)
    assert at1500["pause_takeover"] == 0
    # the two complete turns at such points wait it: the mean wait grows by 2/10 of the step
    assert math.isclose(at1500["wait_mean_ms"] - at1000["wait_mean_ms"], 0.2 * 500)
    assert at1000["wait_p50_ms"] == 200
    assert E.choose_backchannel(curve, 0.05) == 1250
    assert E.choose_backchannel(curve, 0.0) == 1500
    assert E.choose_backchannel(curve[:1], 0.05) is None


def test_the_evaluations_waits_are_the_sessions_defaults():
    from duplex.base.config import SessionOptions

    o, w = SessionOptions(), Waits()
    assert (w.fast, w.speak, w.backchannel, w.listen, w.acoustic_hold) == (
        o.fast_turn_silence_ms,
        o.end_of_turn_silence_ms,
        o.backchannel_turn_silence_ms,
        o.incomplete_turn_silence_ms,
        o.acoustic_hold_silence_ms,
    )


def test_a_fresh_check_never_speaks_the_turns_an_earlier_run_spoke(tmp_path) -> None:
    import argparse
    import json

    examples = [
        {"text": f"turn {i}", "label": LISTEN if i % 2 else SPEAK, "kind": "k", "history": []}
        for i in range(40)
    ]
    first = E.speech_examples(examples, 20, 0)
    earlier = tmp_path / "eot.json"
    rows = [E._row(ex, ex["text"], "flite:slt", [0.5, 0.0, 0.5]) for ex in first]
    rows.append(
        E._row(examples[0], examples[0]["text"], "text", [0.5, 0.0, 0.5])
    )  # text rows are not excluded
    earlier.write_text(json.dumps({"rows": rows}))
    args = argparse.Namespace(exclude_rows=[str(earlier)], rescore=None)
    excluded = E.excluded_turns(args)
    assert sorted(excluded) == sorted(ex["text"] for ex in first)
    fresh = E.speech_examples(examples, 20, 0, excluded)
    assert not {ex["text"] for ex in fresh} & set(excluded)
    assert sum(int(ex["label"]) == LISTEN for ex in fresh) == 10
    # every turn of each label is used by now: one more cannot be drawn, and it says so
    with pytest.raises(ValueError, match="are left to speak"):
        E.speech_examples(examples, 22, 0, excluded)
    # a run that reuses rows keeps the exclusion it was made with
    assert E._exclusion(args, {"speech_exclude": ["a"], "speech_exclude_from": ["x.json"]}) == (
        ["a"],
        ["x.json"],
    )
    assert E._exclusion(args, {}) == (excluded, [str(earlier)])
    with pytest.raises(SystemExit, match="cannot read spoken rows"):
        E.excluded_turns(argparse.Namespace(exclude_rows=[str(tmp_path / "missing.json")]))


def test_the_shipped_point_is_the_sweeps_at_the_shipped_thresholds() -> None:
    """The report's held-out line: every threshold as the heads ship it and the session's default waits,
    the same numbers each sweep gives at that point."""
    policy = TurnPolicy(
        0.5, 0.7, 0.5, take_threshold=0.6, fast_take_threshold=0.9, acoustic_hold_threshold=0.45
    )
    bc = (0.05, 0.6, 0.35)
    rows = (
        [{"label": 2, "probs": (0.01, 0.01, 0.98), "p_voice": 0.9}] * 6
        + [{"label": 2, "probs": (0.01, 0.01, 0.98), "p_voice": 0.2}] * 2  # held: wait 1.5 s
        + [{"label": 2, "probs": bc, "p_voice": 0.9}] * 2
        + [{"label": 0, "probs": (0.9, 0.05, 0.05), "p_voice": 0.3}] * 8
        + [{"label": 0, "probs": (0.02, 0.0, 0.98), "p_voice": 0.9}]  # sure it is over: taken at once
        + [{"label": 0, "probs": bc, "p_voice": 0.9}]
    )
    w = Waits()
    p = E.shipped_point(rows, policy, w)
    at = next(
        q for q in E.acoustic_sweep(rows, policy, w, 0.9, None, grid=(0.45,)) if q["acoustic_hold"] == 0.45
    )
    assert math.isclose(p["pause_takeover"], at["pause_takeover"])
    assert math.isclose(p["wait_mean_ms"], at["wait_mean_ms"])
    bcurve = E.backchannel_sweep(rows, policy, w, 0.9, None, 0.45, None, grid=(w.backchannel,))
    assert math.isclose(p["pause_takeover"], bcurve[0]["pause_takeover"])
    # the sure cut is taken by every pause, the backchannel-point cut by none at a 1.5 s wait
    assert p["cut_pause_taken"].count(1.0) == 1 and math.isclose(p["pause_takeover"], 0.1)
    assert math.isclose(p["fast_share"], 0.6)
    lo, hi = E._turn_interval(p["cut_pause_taken"])
    assert 0.0 <= lo <= p["pause_takeover"] <= hi <= 1.0
