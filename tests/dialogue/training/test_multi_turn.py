"""Conversations for the drafter, verifier and relay eval (dialogue/training/multi_turn.py): earlier answers in
the history, never mixing splits, and the measures of the long-session failure (copied openings).
"""

from __future__ import annotations

import random

from dialogue.training import drafter_data as DD
from dialogue.training import multi_turn as MT
from dialogue.training.train_drafter import copies_history
from duplex.base.cues import TRAINING_CUES
from duplex.eval.dialogue import copied_openings, starts_like_earlier_answer


def _rows() -> list[dict]:
    rows = []
    for split, n in (("train", 30), ("val", 12), ("heldout", 12)):
        for i in range(n):
            src = "trivia" if i % 2 else "template"
            rows.append(
                {
                    "key": f"{split}{i}",
                    "split": split,
                    "group": f"g:{split}:{i % 5}",
                    "source": src,
                    "history": [],
                    "text": f"{split} question {i}",
                    "answer": f"The {split} answer number {i} is here." + (" And more" if i % 3 else ""),
                    "ended": i % 3 == 0,
                }
            )
    return rows


def test_conversations_stay_in_their_split_and_hold_earlier_answers() -> None:
    rows = _rows()
    convs = MT.conversations(rows, {"train": 40, "val": 8, "heldout": 8}, seed=3)
    assert convs == MT.conversations(rows, {"train": 40, "val": 8, "heldout": 8}, seed=3)  # deterministic
    assert sorted({s for _, s in convs}) == ["heldout", "train", "val"]
    assert sum(s == "train" for _, s in convs) == 40
    base_split = {r["group"]: r["split"] for r in rows}
    texts = {r["text"]: r["split"] for r in rows}
    cut = 0
    for p, split in convs:
        assert MT.is_multi(p) and p.source == MT.SOURCE
        assert MT.split_of(p.group, base_split) == split
        assert 2 <= len(p.history) <= 2 * MT.MAX_EXCHANGES and len(p.history) % 2 == 0
        roles = [r for r, _ in p.history]
        assert roles == ["user", "assistant"] * (len(p.history) // 2)
        for r, c in p.history:
            if r == "user":
                assert texts[c] == split  # a held-out question never sits in a training history
            else:
                assert c.split()[:2] == ["The", split]
        last = p.history[-1][1]
        if not last.endswith("."):  # the last answer was cut off by a barge-in: the user's turn says so
            cut += 1
            assert any(p.text.startswith(cue + " ") for cue in TRAINING_CUES), p.text
    assert cut > 0


def test_spoken_answer_ends_at_a_sentence_and_heard_words_are_a_prefix() -> None:
    assert MT.spoken_answer("It opens at nine. Bring your ID and the", ended=False) == "It opens at nine."
    assert MT.spoken_answer("It opens at nine", ended=True) == "It opens at nine"
    assert MT.spoken_answer("Sure, you can take the bus number", ended=False) == "Sure, you can take the bus"
    heard = MT.heard_words("Once upon a time, there was a brave knight.", random.Random(0))
    assert "Once upon a time, there was a brave knight".startswith(heard) and not heard.endswith((".", ","))


def test_shipped_conversations_are_held_out_like_their_last_prompt() -> None:
    prompts = DD.multi_turn_prompts()
    assert len(prompts) >= 1000
    singles = {dp.prompt.group: dp.split for dp in DD.drafter_prompts(multi=False)}
    for dp in prompts:
        assert MT.split_of(dp.prompt.group, singles) == dp.split
    have = DD.read_targets()
    made = [dp for dp in prompts if dp.key in have]
    assert len(made) == len(prompts)  # the shipped targets cover every conversation


def test_copied_openings_measure_answers_that_restart_an_earlier_one() -> None:
    history = [
        {"role": "user", "content": "What day comes after Monday"},
        {"role": "assistant", "content": "The day after Monday is Tuesday."},
    ]
    assert starts_like_earlier_answer("The day after Friday is Saturday.", history)
    assert not starts_like_earlier_answer("A spider has eight legs.", history)
    assert not starts_like_earlier_answer("The day", history)  # fewer than 3 words
    assert copies_history("The day after Sunday", [["assistant", "The day after Monday is Tuesday."]])
    rows = [
        {"history": history, "slow": {"answer": "A spider has eight legs."}},
        {"history": history, "slow": {"answer": "The day after Monday is Tuesday."}},
        {"history": [], "slow": {"answer": "The day after"}},
    ]
    runs = [
        {"answer": "The day after Monday the spider has 8 legs."},
        {"answer": "The day after Monday is Tuesday."},
        {"answer": "x"},
    ]
    assert copied_openings(rows, runs) == {"n": 2, "relay": 1.0, "slow_only": 0.5}
