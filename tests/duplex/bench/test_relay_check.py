"""`python -m duplex.bench.relay_check`: its summary (the engine runs are measured in docs/results)."""

from __future__ import annotations

import pytest

from duplex.bench.relay_check import main, summarise, table


def _rows(oks: list[bool], ms: float) -> list[dict[str, object]]:
    return [{"q": f"q{i}", "ok": ok, "first_ms": ms + i, "answer": "a"} for i, ok in enumerate(oks)]


def test_summary_counts_wrong_facts_the_draft_made() -> None:
    rows = {
        "off": _rows([True, True, False, True], 200.0),
        "verifier": _rows([True, False, True, True], 50.0),  # q1 wrong from the draft, q2 right from it
        "exact": _rows([True, True, False, True], 150.0),
    }
    s = summarise(rows)
    assert s["off"]["correct"] == 3 and s["off"]["wrong_where_off_right"] == []
    assert s["verifier"]["wrong_where_off_right"] == ["q1"] and s["verifier"]["correct"] == 3
    assert s["exact"]["wrong_where_off_right"] == []
    assert s["verifier"]["first_p50_ms"] == 51.5 and s["off"]["first_p90_ms"] == 203.0
    text = table(s)
    assert "verifier" in text and "q1" in text


def test_summary_times_the_seam_of_committed_drafts() -> None:
    """After a committed draft, the slow model's next phrase must come before the draft's phrase has been
    spoken: the summary counts the answers where it did not (a pause at the seam)."""
    rows = _rows([True, True, True], 80.0)
    for r, kept, seam, gap in zip(
        rows, (True, True, False), (300.0, 900.0, 50.0), (0.0, 250.0, None), strict=True
    ):
        r.update(draft_kept=kept, seam_ms=seam, seam_gap_ms=gap)
    s = summarise({"grounded": rows})["grounded"]
    assert s["committed"] == 2 and s["seam_gaps"] == 1 and s["seam_gap_max_ms"] == 250.0
    assert s["seam_p50_ms"] == 600.0  # over the committed answers only
    assert "grounded" in table({"grounded": s})


def test_unknown_way_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--modes", "off,magic"])
    assert "unknown way(s) magic" in capsys.readouterr().err


def test_a_seam_gap_is_the_second_phrase_coming_after_the_first_was_spoken(monkeypatch) -> None:
    """`answer`: the second phrase ready 0.9 s after the first, whose audio lasts 0.6 s: a 300 ms pause at
    the seam; a draft that was not committed has no seam to time."""
    from types import SimpleNamespace

    import numpy as np

    import duplex.bench.llm_quality as LQ
    import duplex.eval.tts as ET
    from duplex.bench.relay_check import answer

    relay = SimpleNamespace(draft="The sky is ", prefix="The sky is")
    result = {"answer": "The sky is blue.", "first_phrase_s": 0.1, "phrase_ready_s": [0.1, 1.0]}
    result["first_phrase"] = "The sky is"
    monkeypatch.setattr(LQ, "answer_with_relay", lambda *a, **k: (result, relay))
    voice = SimpleNamespace(sample_rate=1000)
    monkeypatch.setattr(ET, "speak", lambda stage, text: np.zeros(600, np.float32))
    r = answer(None, "What colour is the sky?", {}, voice)
    assert r["draft_kept"] and r["first_phrase_ms"] == 600.0 and r["seam_gap_ms"] == 300.0
    assert r["first_ms"] == 100.0 and r["seam_ms"] == 900.0
    relay.prefix = ""
    r = answer(None, "What colour is the sky?", {}, voice)
    assert not r["draft_kept"] and r["seam_gap_ms"] is None
