"""`duplex eval dialogue`: its decision rule, takeover metrics and summaries (the model runs are in
the command itself; its real numbers are in the README)."""

from __future__ import annotations

import math

import pytest

from duplex.base.phrases import first_phrase_ready
from duplex.eval.dialogue import auroc, decide, report, summarise_relay, turn_metrics


def test_decision_rule_matches_the_session_core():
    assert decide((0.1, 0.1, 0.8), speak_thr=0.5, bc_thr=0.5) == 2
    assert decide((0.2, 0.7, 0.1), speak_thr=0.5, bc_thr=0.5) == 1
    assert decide((0.6, 0.55, 0.1), speak_thr=0.5, bc_thr=0.5) == 0  # backchannel needs P(bc) >= P(listen)
    assert decide((0.9, 0.05, 0.05), speak_thr=0.5, bc_thr=0.5) == 0


def test_takeover_counts_speak_and_backchannel_decisions():
    # labels: 0 listen, 2 speak; decisions: speak or backchannel both take the turn within ~1 s
    pairs = [(0, 0)] * 8 + [(0, 2), (0, 1)] + [(2, 2)] * 9 + [(2, 0)]
    m = turn_metrics(pairs)
    assert m["n_listen"] == 10 and m["pause_takeover"] == pytest.approx(0.2)
    assert m["n_speak"] == 10 and m["complete_takeover"] == pytest.approx(0.9)
    assert m["fast_takeover"] == pytest.approx(0.9)
    assert m["confusion"]["listen"] == {"listen": 8, "backchannel": 1, "speak": 1}
    assert math.isnan(turn_metrics([])["pause_takeover"])


def test_auroc_and_first_phrase():
    assert auroc([0.9, 0.8, 0.1], [1, 1, 0]) == 1.0
    assert auroc([0.1, 0.9], [1, 0]) == 0.0
    assert auroc([0.5, 0.5], [1, 0]) == 0.5
    assert math.isnan(auroc([0.3], [1]))
    assert not first_phrase_ready("The capital", done=False)
    assert first_phrase_ready("The capital of ", done=False)
    # what the TTS's phrase segmenter would cut now: a clause mark ends a phrase once a space follows
    assert not first_phrase_ready("Sure,", done=False) and first_phrase_ready("Sure, ", done=False)
    assert first_phrase_ready("Hi", done=True) and first_phrase_ready("It is 3. ", done=False)
    assert not first_phrase_ready("Dr. ", done=False)  # an abbreviation does not end a phrase


def _run(onset: float, quality: float, committed: bool = False, answer: str = "a") -> dict:
    return {"onset_s": onset, "quality": quality, "committed": committed, "answer": answer}


def test_relay_at_any_threshold_is_the_committed_or_the_discarded_run():
    rows = []
    for i in range(10):
        rows.append(
            {
                "p": i / 10,
                "label": int(i >= 5),
                "slow": _run(0.3 + 0.01 * i, 6.0),
                "commit": _run(0.05, 5.0, committed=True, answer="b"),
                "discard": _run(0.35 + 0.01 * i, 6.0),
                "mismatched_quality": 4.0,
            }
        )
    r = summarise_relay(rows, threshold=0.45, points={"latency": 0.0})
    assert r["n"] == 10 and r["committed_fraction"] == 0.5 and r["verifier_auroc"] == 1.0
    # the five drafts scored >= 0.45 commit: their onset and grade are the committed run's
    assert r["onset_ms"]["relay"]["p50"] == pytest.approx(0.5 * (50 + 350))
    assert r["quality_ratio"] == pytest.approx(5.5 / 6.0)
    # half the prompts lose a whole grade of the 2 between the mismatched floor (4) and slow-only (6)
    assert r["quality_kept"] == pytest.approx(0.75) and r["answers_changed"] == 5
    assert r["p90_ratio"] == pytest.approx(r["onset_ms"]["relay"]["p90"] / r["onset_ms"]["slow_only"]["p90"])
    lat = r["operating_points"]["latency"]
    assert lat["committed_fraction"] == 1.0 and lat["p90_ratio"] == pytest.approx(50 / 381)
    # the sweep holds every threshold that changes a decision, from none committed to all
    fractions = sorted(m["committed_fraction"] for m in r["sweep"])
    assert fractions[0] == 0.0 and fractions[-1] == 1.0 and len(r["sweep"]) == 11  # p = 0.0 is one of them
    # a draft the drafter could not make (nothing committed even when forced) stays slow
    rows[9]["commit"]["committed"] = False
    assert summarise_relay(rows, threshold=0.0)["committed_fraction"] == 0.9
    text = report({"relay": r, "turn_text": turn_metrics([(0, 0), (2, 2)]) | {"n_overlap": 0}})
    assert "P90 ratio" in text and "pause takeover" in text and "latency" in text


def test_resummarise_rejudges_stored_runs(tmp_path, monkeypatch):
    import json

    import duplex.eval.dialogue as E
    from duplex.eval.dialogue import resummarise

    rows = []
    for i in range(10):
        commit = _run(0.05, 6.0, committed=True, answer="b") | {"prefix": "The dragon is"}
        # the first prompt follows an answer that opened with the same words: the veto discards it
        history = (
            [{"role": "user", "content": "a story"}, {"role": "assistant", "content": "The dragon is a"}]
            if i == 0
            else []
        )
        rows.append(
            {
                "p": 0.99,
                "label": 1,
                "text": "what is two plus two",
                "history": history,
                "slow": _run(0.3, 6.0),
                "commit": commit,
                "discard": _run(0.35, 6.0),
                "mismatched_quality": 4.0,
            }
        )
    # a stored prompt that is no longer held out (removed from relay_eval.jsonl since) leaves the summaries
    gone = rows[-1] | {"text": "h"}
    held = {json.dumps({"history": r["history"], "text": r["text"]}) for r in rows}
    (tmp_path / "relay_eval.jsonl").write_text("\n".join(held) + "\n")
    monkeypatch.setattr(E, "DATA", tmp_path)
    path = tmp_path / "dialogue.json"
    path.write_text(json.dumps({"relay": {"rows": rows + [gone]}}))
    res = resummarise(path, None)
    r = res["relay"]
    assert res["dropped_prompts"] == 1 and r["n"] == 10
    assert [row["commit"]["veto"] for row in r["rows"]] == ["repeat"] + [None] * 9
    assert r["committed_fraction"] == 0.9 and set(r["operating_points"]) >= {"balanced", "latency"}


class _Recording:
    """An ASR that hears nothing but keeps the audio it was given; a turn head that always listens."""

    def __init__(self) -> None:
        self.audio: list[object] = []

    def init_state(self) -> None:
        return None

    def step(self, state: object, chunk: object) -> tuple[object, None]:
        from types import SimpleNamespace

        if hasattr(chunk, "samples"):
            self.audio.append(chunk.samples)
            return SimpleNamespace(text=""), None
        return SimpleNamespace(probs=(0.9, 0.05, 0.05)), None


@pytest.mark.integration
def test_speech_cuts_from_whole_sentences_are_shorter_than_the_sentence():
    """`--cut-audio whole`: a cut is hibari's whole sentence up to where the cut's words end, plus 0.2 s of
    silence; a complete turn is spoken as it is."""
    import numpy as np

    from duplex.eval.dialogue import eval_turns_speech

    examples = [
        {"text": "What is the capital of", "label": 0, "group": "g"},
        {"text": "What is the capital of France?", "label": 2, "group": "g"},
    ]
    lengths = {}
    for mode in ("alone", "whole"):
        rec = _Recording()
        eval_turns_speech(rec, rec, examples, 2, 0.5, 0.5, 0, False, None, mode)
        lengths[mode] = [len(a) for a in rec.audio]  # type: ignore[arg-type]
        if mode == "whole":
            cut = rec.audio[0]  # the cuts come first (label 0), then the complete turns
            assert float(np.abs(cut[-3200:]).max()) == 0.0  # the pause after the cut
    # the complete turn is the same both ways; the cut is a piece of the whole sentence
    assert lengths["alone"][1] == lengths["whole"][1]
    assert lengths["whole"][0] < lengths["whole"][1] + 3200
    assert lengths["whole"][0] != lengths["alone"][0]  # not the cut's words spoken on their own
    with pytest.raises(ValueError, match="cut_audio"):
        eval_turns_speech(_Recording(), _Recording(), examples, 2, 0.5, 0.5, 0, False, None, "half")
