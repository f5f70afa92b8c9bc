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


def test_unknown_way_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--modes", "off,magic"])
    assert "unknown way(s) magic" in capsys.readouterr().err
