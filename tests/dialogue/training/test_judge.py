"""The answer-quality judges of `duplex eval dialogue` (`dialogue/training/judge.py`) with a tiny seeded model:
the likelihood judge's cache-sharing arithmetic equals a plain forward per answer, its grade is 0 for
what tells nothing about the caller's words, and the evaluation summarises every judge and its
validity. (What the judges measure with the real slow model is `python -m dialogue.training.judge --check`.)"""

from __future__ import annotations

import math

import pytest
import torch

from dialogue.engine import DialogueStage, SlowOptions
from dialogue.llm import stop_token_ids
from dialogue.training.judge import LikelihoodJudge, LikelihoodScore, RatingJudge, validity
from dialogue.verifier import chat_ids
from duplex.eval.dialogue import judge_rows, summarise_relay
from tests.dialogue.test_engine import SYSTEM, tiny
from tests.dialogue.test_engine import tokenizer as tokenizer  # noqa: F401 (the fixture)

HISTORY = [
    {"role": "user", "content": "how are you today"},
    {"role": "assistant", "content": "i am fine thanks"},
]


def _plain(model, tok, ctx, answer):
    """Sum of log P(answer tokens | ctx) and log P(stop | ctx, answer), by one plain forward."""
    ids = list(tok.encode(answer, add_special_tokens=False))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ctx + ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(ctx) - 1 :], dim=-1)
    tokens = float(logp[torch.arange(len(ids)), torch.tensor(ids)].sum())
    return tokens, float(torch.logsumexp(logp[-1, sorted(stop_token_ids(tok))], dim=0))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_likelihood_judge_equals_a_plain_forward_per_answer(tokenizer, arch):  # noqa: F811
    model = tiny(arch, len(tokenizer), 3)
    judge = LikelihoodJudge(model, tokenizer, SYSTEM)
    answers = ["the capital of france is paris", "once upon a time", "two plus two is four"]
    scores = judge.score(HISTORY, "what is the capital of france", answers)
    for a, s in zip(answers, scores, strict=True):
        logp, end = _plain(
            model, tokenizer, chat_ids(tokenizer, SYSTEM, HISTORY, "what is the capital of france"), a
        )
        neutral, _ = _plain(model, tokenizer, chat_ids(tokenizer, SYSTEM, HISTORY, "Hello."), a)
        assert s.n_tokens == len(tokenizer.encode(a, add_special_tokens=False))
        assert s.logp == pytest.approx(logp, abs=1e-3) and s.logp_neutral == pytest.approx(neutral, abs=1e-3)
        assert s.logp_end == pytest.approx(end, abs=1e-4)
        assert s.quality == pytest.approx(
            max(0.0, (logp - neutral) / s.n_tokens) * math.exp(end), rel=1e-3, abs=1e-6
        )
    # scoring one answer alone gives the same as among others (the shared cache is cropped back exactly)
    again = judge.score(HISTORY, "what is the capital of france", answers[1:2])[0]
    assert again.logp == pytest.approx(scores[1].logp, abs=1e-4)


def test_what_tells_nothing_about_the_callers_words_scores_zero(tokenizer):  # noqa: F811
    model = tiny("llama", len(tokenizer), 4)
    judge = LikelihoodJudge(model, tokenizer, SYSTEM)
    # the caller said the neutral turn itself: every answer is as likely as after it
    same = judge.score([], "Hello.", ["i am fine thanks"])[0]
    assert same.pmi == pytest.approx(0.0, abs=1e-5) and same.quality == pytest.approx(0.0, abs=1e-5)
    assert LikelihoodScore(0, 0.0, 0.0, 0.0).quality == 0.0  # silence
    # less likely after the caller's words than after "Hello.": floored at 0, not negative
    assert LikelihoodScore(4, -12.0, -8.0, -0.1).quality == 0.0
    assert LikelihoodScore(4, -8.0, -12.0, math.log(0.5)).quality == pytest.approx(0.5)


def test_rating_judge_grades_between_one_and_nine(tokenizer):  # noqa: F811
    grade = RatingJudge(tiny("qwen2", len(tokenizer), 5), tokenizer)(HISTORY, "what is two plus two", "four")
    assert 1.0 <= grade <= 9.0


def test_validity_pairs_each_prompt_with_its_bad_answer():
    v = validity([3.0, 2.0, 1.0], [0.0, 2.0, 2.0])
    assert v["n"] == 3 and v["auroc"] == pytest.approx((3 + 2 + 1) / 9)
    assert v["paired_wins"] == pytest.approx(1.5 / 3) and v["bad_ratio"] == pytest.approx(4 / 6)


def test_eval_rows_are_graded_by_every_judge_and_summarised(tokenizer):  # noqa: F811
    model = tiny("qwen2", len(tokenizer), 6)
    stage = DialogueStage(model, tokenizer, SlowOptions(system_prompt=SYSTEM, max_new_tokens=12))

    def run(answer, onset, committed=False):
        return {"answer": answer, "onset_s": onset, "committed": committed} | (
            {"prefix": " ".join(answer.split()[:2])} if committed else {}
        )

    rows = [
        {
            "text": t,
            "history": [],
            "source": "",
            "p": 0.9,
            "label": 1,
            "slow": run(a, 0.3),
            "commit": run(c, 0.05, True),
            "discard": run(a, 0.35),
        }
        for t, a, c in [
            ("what is the capital of france", "the capital of france is paris", "paris"),
            ("tell me a story please", "once upon a time there was a cat", "once upon a time"),
            ("what is two plus two", "two plus two is four", "two plus two is four"),
        ]
    ]
    judge_rows(stage, rows, rating=True)
    for r in rows:
        for v in ("slow", "commit", "discard"):
            assert 1.0 <= r[v]["quality"] <= 9.0 and r[v]["quality_likelihood"] >= 0.0
            assert r[v]["likelihood"]["quality"] == r[v]["quality_likelihood"]
        assert r["discard"]["quality_likelihood"] == r["slow"]["quality_likelihood"]  # the same answer
        assert r["mismatched_quality"] is not None and r["mismatched_quality_likelihood"] is not None
    s = summarise_relay(rows, threshold=0.5)
    lik = s["judges"]["likelihood"]
    relay = [r["commit"]["quality_likelihood"] for r in rows]  # every draft commits at 0.5
    assert lik["relay"] == pytest.approx(sum(relay) / 3)
    assert lik["slow_only"] == pytest.approx(sum(r["slow"]["quality_likelihood"] for r in rows) / 3)
    assert s["judges"]["rating"]["ratio"] == s["quality_ratio"]
    assert (
        set(s["judge_validity"]) == {"rating", "likelihood", "likelihood-total"}
        and s["judge_validity"]["likelihood"]["n"] == 3
    )
    # the bound with the slow model as the verifier: its own score of each committed prefix, as many committed
    assert all(isinstance(r["commit"]["prefix_logp"], float) for r in rows)
    bound = s["slow_scored"]
    assert bound["committed_fraction"] == s["committed_fraction"] == 1.0 and bound["judges"] == s["judges"]
    rows[0]["p"] = 0.1  # the verifier drops one draft: the bound drops the one the slow model likes least
    s = summarise_relay(rows, threshold=0.5)
    worst = min(range(3), key=lambda i: rows[i]["commit"]["prefix_logp"])
    kept = [rows[i]["commit" if i != worst else "discard"]["quality_likelihood"] for i in range(3)]
    assert s["slow_scored"]["committed_fraction"] == pytest.approx(2 / 3)
    assert s["slow_scored"]["judges"]["likelihood"]["relay"] == pytest.approx(sum(kept) / 3)
