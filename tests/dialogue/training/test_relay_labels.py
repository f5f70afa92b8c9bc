"""The verifier's judge labels (`dialogue/training/relay_labels.py`) with a tiny seeded model, and the relay
evaluation's rescoring of stored drafts: the relay answer is the committed words plus the slow
model's greedy continuation, a prefix the slow model's own answer starts with costs nothing, the
label follows the loss and the engine's hard rules, and cached results are read without a model."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from dialogue.training import relay_features as RF
from dialogue.training import relay_labels as RL
from dialogue.training import train_verifier as TV
from tests.dialogue.test_engine import SYSTEM, tiny
from tests.dialogue.test_engine import tokenizer as tokenizer  # noqa: F401 (the fixture)


def test_a_prefix_the_answer_starts_with_is_matched_word_by_word():
    assert RL.starts_with_prefix("Sure, I can help with that.", "Sure, I can")
    assert RL.starts_with_prefix("Sure,  I can help", "Sure, I")  # spacing aside
    assert RL.starts_with_prefix("Paris.", "Paris.")
    assert not RL.starts_with_prefix("Surely not.", "Sure")  # a word cut in two is another word
    assert not RL.starts_with_prefix("I can help.", "Sure, I")
    assert not RL.starts_with_prefix("Anything", "")


def test_the_relay_answer_is_the_prefix_then_the_slow_models_greedy_continuation(tokenizer):  # noqa: F811
    model = tiny("qwen2", len(tokenizer), 5)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # decisive logits: greedy is stable under int rounding
    warm = RF.WarmModel(model, tokenizer, SYSTEM, "tiny")
    ids = TV.V.chat_ids(tokenizer, SYSTEM, [], "what is the capital of france")
    prefix = "the capital"
    answer = RL.relay_answer(warm, ids, prefix, max_tokens=10)
    pids = list(tokenizer.encode(prefix, add_special_tokens=False))
    seq, ref = list(ids) + pids, []
    with torch.inference_mode():
        for _ in range(10 - len(pids)):
            tok = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            if tok in warm.stop_ids:
                break
            ref.append(tok)
            seq.append(tok)
    assert answer == (prefix + tokenizer.decode(ref, skip_special_tokens=True)).strip()
    assert answer.startswith(prefix)


def _ex(prefix: str, text: str = "what is the capital of france") -> dict:
    return {"prefix": prefix, "text": text, "history": [], "group": "g", "source": "s"}


def test_labels_follow_the_loss_and_the_engines_hard_rules():
    examples = [
        _ex("Paris is the"),
        _ex("I'm sorry, but"),
        _ex("The capital of"),
        _ex(""),
        _ex("Париж это"),
        _ex("What is the"),
        _ex("The capital"),
    ]
    results = [
        {"same": True, "loss": 0.0},
        {"same": False, "loss": 1.7},  # a refusal where the slow model would have answered
        {"same": False, "loss": 0.05},
        {"same": False, "loss": float("inf")},
        {"same": False, "loss": -0.3},  # another script: unacceptable whatever the judge says
        {"same": False, "loss": 0.0},  # an echo of the question is judged like any opening
        {"same": False, "loss": 0.1},
    ]
    labels = RL.label_examples(examples, results, margin=0.1)
    assert labels == [1, 0, 1, 0, 0, 1, 1]
    assert [e["reason"] for e in examples] == ["own", "loses", "kept", "empty", "foreign", "kept", "kept"]
    assert RL.label_examples(examples[2:3], results[2:3], margin=0.0) == [0]
    assert "0.1" in RL.rule(0.1) and str(RL.LABEL_TOKENS) in RL.rule()


def test_cached_judge_results_are_read_without_loading_a_model(tmp_path, monkeypatch):
    files = [tmp_path / f"k{i}.pt" for i in range(2)]
    for i, f in enumerate(files):
        RL.label_path(f).write_text(json.dumps({"slow": "a", "relay": "b", "same": False, "loss": 0.5 * i}))
    from dialogue import llm_weights

    monkeypatch.setattr(
        llm_weights, "load", lambda *a, **k: pytest.fail("a cached label loaded the slow model")
    )
    out = RL.judge_dataset([_ex("x"), _ex("y")], files, progress=False)
    assert [r["loss"] for r in out] == [0.0, 0.5]


def test_shipped_judge_results_come_first_and_only_for_the_same_draft(tmp_path, monkeypatch):
    files = [tmp_path / f"k{i}.pt" for i in range(3)]
    examples = [_ex("Paris is"), _ex("I'm sorry,"), _ex("")]
    results = [
        {"slow": "Paris is the capital.", "relay": "Paris is the capital.", "same": True, "loss": 0.0},
        {
            "slow": "Paris.",
            "relay": "I'm sorry, I can't.",
            "same": False,
            "loss": 2.5,
            "judge_slow": 3.0,
            "judge_relay": 0.5,
        },
        {"slow": "Paris.", "relay": "", "same": False, "loss": float("inf")},
    ]
    shipped = tmp_path / "labels.jsonl"
    RL.write_shipped(
        [e | {"feature_file": str(f)} for e, f in zip(examples, files, strict=True)], results, shipped
    )
    rows = [json.loads(line) for line in shipped.read_text().splitlines()]  # strict JSON: no Infinity
    assert [r["key"] for r in rows] == ["k0", "k1", "k2"] and rows[2]["loss"] is None
    assert rows[1]["prefix"] == "I'm sorry," and rows[1]["text"] == "what is the capital of france"

    from dialogue import llm_weights

    monkeypatch.setattr(
        llm_weights, "load", lambda *a, **k: pytest.fail("a shipped label loaded the slow model")
    )
    assert RL.judge_dataset(examples, files, progress=False, shipped=shipped) == results
    assert not any(RL.label_path(f).exists() for f in files)  # nothing made, nothing cached
    # a draft that changed since (another prefix for the same key) is not labelled by the shipped row
    RL.label_path(files[0]).write_text(json.dumps({"slow": "a", "relay": "b", "same": False, "loss": 1.0}))
    out = RL.judge_dataset([_ex("Paris was")] + examples[1:], files, progress=False, shipped=shipped)
    assert out[0]["loss"] == 1.0 and out[1:] == results[1:]
    # nor does a row made by another label procedure
    shipped.write_text(shipped.read_text().replace('"version": 1', '"version": 0'))
    assert RL.read_shipped(shipped) == {}


def test_the_shipped_labels_are_the_shipped_verifiers():
    """data/dialogue/relay_labels.jsonl holds a judge result for every draft the shipped verifier was
    trained, tuned and tested on, and labelled by today's rule they give its metadata's label counts."""
    from dialogue.verifier import DEFAULT_WEIGHTS

    meta = json.loads(DEFAULT_WEIGHTS.with_suffix(".json").read_text())
    rows = list(RL.read_shipped().values())
    assert meta["labels"] == "judge" and meta["judge_labels"]["version"] == RL.LABEL_VERSION
    assert len(rows) == meta["data"]["prompts"]
    labels = RL.label_examples(rows, rows, meta["judge_labels"]["margin"])
    assert Counter(r["reason"] for r in rows) == meta["data"]["reasons"]
    assert sum(labels) / len(labels) == pytest.approx(meta["data"]["positive_rate"])


@dataclass
class _Info:
    draft: str
    prefix: str
    p_accept: float


class _Stage:
    """Drafts what was stored, scored by a new verifier (the first prompt's draft changed since)."""

    def __init__(self, scores: dict[str, float]) -> None:
        self.scores = scores

    def relay_draft(self, history, text):
        return _Info("new draft" if text == "q0" else "The dragon is a", "The dragon is", self.scores[text])


def test_rescoring_replaces_each_stored_drafts_score_and_counts_changed_drafts():
    from duplex.eval.dialogue import judge_labelled, rescore_rows

    def run(q: float, committed: bool = False) -> dict:
        return {
            "answer": "a",
            "onset_s": 0.1,
            "committed": committed,
            "quality_likelihood": q,
            "p": 0.5,
            "draft": "The dragon is a",
            "prefix": "The dragon is" if committed else "",
        }

    rows = [
        {
            "text": f"q{i}",
            "history": [],
            "p": 0.5,
            "slow": run(2.0),
            "commit": run(2.0 - i, True),
            "discard": run(2.0),
        }
        for i in range(4)
    ]
    changed = rescore_rows(_Stage({"q0": 0.9, "q1": 0.8, "q2": 0.3, "q3": 0.1}), rows, progress=False)
    assert changed == 1
    assert [r["p"] for r in rows] == [0.9, 0.8, 0.3, 0.1] and rows[2]["commit"]["p"] == 0.3
    # judged: the committed answer lost 0, 1, 2, 3 of the grade; kept iff it lost at most the margin
    assert judge_labelled(rows) == [(0.9, 1), (0.8, 0), (0.3, 0), (0.1, 0)]
    assert judge_labelled(rows, margin=1.0) == [(0.9, 1), (0.8, 1), (0.3, 0), (0.1, 0)]


def test_the_relay_loss_counts_what_the_committed_share_of_drafts_loses():
    losses = [0.0, 2.0, -0.5, float("inf"), 9.0]
    # commit the top 60 % by score: the drafts scored 0.9, 0.8, 0.7
    assert RL.relay_loss([0.9, 0.1, 0.8, 0.7, 0.2], losses, 0.6) == pytest.approx((0.0 - 0.5 + 3.0) / 5)
    # a verifier that ranks the costly drafts last loses less than one that ranks them first
    good = RL.relay_loss([0.9, 0.2, 0.8, 0.1, 0.0], losses, 0.6)
    bad = RL.relay_loss([0.0, 0.9, 0.1, 0.8, 0.7], losses, 0.6)
    assert good < bad and bad == pytest.approx((2.0 + 3.0 + 3.0) / 5)  # 9.0 capped at 3
