"""The drafter's distillation data (dialogue/training/drafter_data.py): no held-out prompt is trained on,
and the slow model's answers are its greedy decoding.
"""

from __future__ import annotations

import json

import torch

from dialogue.training import drafter_data as DD
from dialogue.training import relay_features as RF
from dialogue.training import relay_prompts as RP
from dialogue.training import train_verifier as TV
from tests.dialogue.test_engine import tiny
from tests.dialogue.test_engine import tokenizer as tokenizer  # noqa: F401  (the module-scoped fixture)


def test_relay_eval_prompts_are_held_out_and_never_trained_on() -> None:
    prompts = DD.drafter_prompts()
    by_split: dict[str, set[str]] = {}
    for dp in prompts:
        by_split.setdefault(dp.split, set()).add(dp.prompt.text.lower())
    assert set(by_split) == {"train", "val", "heldout"}
    assert not by_split["train"] & (by_split["val"] | by_split["heldout"])
    keys = {dp.key: dp.split for dp in prompts}
    for line in (DD.DATA_DIR / "relay_eval.jsonl").read_text().splitlines():
        row = json.loads(line)
        p = RP.Prompt(
            row["group"], row["source"], tuple((m["role"], m["content"]) for m in row["history"]), row["text"]
        )
        assert keys.get(DD.prompt_key(p)) == "heldout", row["text"]
    # the extra caller-request families only ever add training prompts
    assert all(dp.split == "train" for dp in prompts if dp.prompt.source in ("extra", "generated", "tpl"))


def test_shipped_targets_keep_their_splits() -> None:
    rows = DD.read_targets()
    assert len(rows) > 1000
    splits = {dp.key: dp.split for dp in DD.drafter_prompts()}
    wrong = [r["text"] for r in rows.values() if splits.get(r["key"]) != r["split"]]
    assert not wrong, wrong[:5]
    assert {r["split"] for r in rows.values()} == {"train", "val", "heldout"}
    assert all(r["answer"].strip() or r["ended"] for r in rows.values())


def test_slow_answer_is_greedy_decoding(tokenizer) -> None:  # noqa: F811
    model = tiny("qwen2", len(tokenizer), 2)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    warm = RF.WarmModel(model, tokenizer, "You are a friendly voice assistant on a phone call.", "tiny")
    ids = TV.V.chat_ids(
        tokenizer, "You are a friendly voice assistant on a phone call.", [], "how are you today"
    )
    toks, ended = DD.slow_answer(warm, ids, max_tokens=8)
    ref: list[int] = []
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(8):
            tok = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            if tok in warm.stop_ids:
                break
            ref.append(tok)
            seq.append(tok)
    assert toks == ref and ended == (len(ref) < 8)
    assert warm.cache.get_seq_length() == len(warm.sys_ids)  # the warm cache is back to the system prompt


def test_the_relay_benchmark_holds_no_corpus_debris(tmp_path) -> None:
    # trivia.yml's 14th entry is one string: read as a list it gave one caller turn per character
    assert RP.is_corpus_debris([], "h") and RP.is_corpus_debris(
        (("user", "-"), ("assistant", "Sorry.")), "Who won"
    )
    assert not RP.is_corpus_debris(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "7"}], "Why"
    )
    rows = [json.loads(line) for line in (DD.DATA_DIR / "relay_eval.jsonl").read_text().splitlines()]
    assert len(rows) == 480 and not [r["text"] for r in rows if RP.is_corpus_debris(r["history"], r["text"])]
    # the writer leaves it out (the splits still count it, so the shipped ones stay reproducible)
    ex = [
        {"history": [], "text": t, "group": "g", "source": "s", "label": 1} for t in ("h", "Who painted it")
    ]
    TV.write_eval(ex, [0, 1], tmp_path / "eval.jsonl")
    assert [json.loads(line)["text"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()] == [
        "Who painted it"
    ]
