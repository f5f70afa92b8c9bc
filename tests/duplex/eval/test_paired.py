"""The paired bootstrap that tells a WER gain from noise, and `duplex eval tts --baseline`."""

from __future__ import annotations

import pytest

from duplex.eval.paired import describe, paired_wer_difference
from duplex.eval.tts import compare_to_baseline, report

REFS = [f"the cat number {i} sat on the mat" for i in range(40)]


def test_the_same_transcripts_differ_by_nothing() -> None:
    d = paired_wer_difference(REFS, REFS, REFS)
    assert d["delta_pt"] == 0 and d["ci95_pt"] == [0.0, 0.0]
    assert d["sentences_worse"] == d["sentences_better"] == 0
    assert d["words"] == 7 * 40


def test_a_fix_in_every_other_sentence_is_a_gain_beyond_noise() -> None:
    base = [r.replace("mat", "hat") if i % 2 == 0 else r for i, r in enumerate(REFS)]  # 20 errors
    d = paired_wer_difference(REFS, base, REFS)
    assert d["delta_pt"] == pytest.approx(-100 * 20 / 280)
    assert d["ci95_pt"][1] < 0  # the whole interval below zero
    assert d["sentences_better"] == 20 and d["sentences_worse"] == 0
    assert describe(d).endswith(": better")


def test_one_garbled_sentence_against_a_few_fixes_is_not_a_difference() -> None:
    base = list(REFS)
    base[3] = "dog"  # the baseline gets one sentence badly wrong (7 errors) ...
    cand = list(REFS)
    cand[10] = "the bat number 10 sat on a hat"  # ... the candidate another (3) and one more (1)
    cand[20] = REFS[20].replace("cat", "hat")
    d = paired_wer_difference(REFS, base, cand)
    assert d["delta_pt"] == pytest.approx(100 * (4 - 7) / 280)
    lo, hi = d["ci95_pt"]
    assert lo < 0 < hi
    assert describe(d).endswith("not different at 95 %")
    assert paired_wer_difference(REFS, base, cand) == d  # seeded: the same interval every time


def test_it_refuses_what_cannot_be_paired() -> None:
    with pytest.raises(ValueError, match="one transcript per reference"):
        paired_wer_difference(REFS, REFS[:-1], REFS)
    with pytest.raises(ValueError, match="no sentences"):
        paired_wer_difference([], [], [])


def _run(hyps: dict[str, list[str]], step: int) -> dict:
    wer = {k: 0.0 for k in hyps}
    rows = [{"text": t, **{k: v[i] for k, v in hyps.items()}} for i, t in enumerate(REFS)]
    return {
        "date": "2026-11-28 12:00",
        "profile": "cpu-flow",
        "n": len(REFS),
        "flow_step": step,
        "wer": wer,
        "gap_to_hibari": {},
        "timing_one_thread": {},
        "bitrate_bps": 990.7,
        "codes_used_per_group": [0.95],
        "targets": {
            "wer_flow": 0.05,
            "gap_flow": 0.02,
            "gap_codec": 0.01,
            "bitrate_bps": 1000.0,
            "codes_used": 0.9,
        },
        "transcripts": rows,
    }


def test_eval_tts_compares_the_parts_both_runs_have_sentence_by_sentence() -> None:
    old = _run({"codec": REFS, "flow_2": [r.replace("mat", "hat") for r in REFS]}, 100)
    new = _run({"flow_2": REFS}, 200)
    new["vs_baseline"] = compare_to_baseline(new, old, "old.json")
    assert set(new["vs_baseline"]["parts"]) == {"flow_2"}  # the codec part was not run this time
    assert new["vs_baseline"]["parts"]["flow_2"]["sentences_better"] == len(REFS)
    text = report(new)
    assert "vs baseline old.json (flow step 100)" in text and "flow_2" in text and ": better" in text


def test_eval_tts_refuses_a_baseline_on_other_sentences_or_without_transcripts() -> None:
    new = _run({"flow_2": REFS}, 200)
    other = _run({"flow_2": REFS}, 100)
    other["transcripts"][5]["text"] = "something else"
    with pytest.raises(ValueError, match="other sentences"):
        compare_to_baseline(new, other, "other.json")
    old = _run({"flow_2": REFS}, 100)
    del old["transcripts"]
    with pytest.raises(ValueError, match="no transcripts"):
        compare_to_baseline(new, old)
    with pytest.raises(ValueError, match="none of this run's parts"):
        compare_to_baseline(new, _run({"codec": REFS}, 100))
