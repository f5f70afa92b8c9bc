"""Relay verifier: per-token statistics, stop/cut rules, the model's masking, focal loss, a tiny
training run, and the shipped weights + metadata."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from dialogue import verifier as V
from dialogue.training import relay_metrics as RM
from dialogue.training import relay_prompts as RP
from dialogue.training import train_verifier as T
from dialogue.verifier import (
    DEFAULT_WEIGHTS,
    MAX_DRAFT_TOKENS,
    MAX_DRAFT_WORDS,
    Verifier,
    complete_words,
    draft,
    draft_stop,
    ends_sentence,
    load_verifier,
    prefix_text,
    token_stats,
)
from duplex.base.errors import ModelError
from tests.dialogue.test_llm_options import tiny_model, tiny_tokenizer

# -- token_stats ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_stats_match_a_manual_softmax(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(50, generator=g, dtype=torch.float64) * 3
    chosen = int(torch.randint(0, 50, (1,), generator=g))
    z = [math.exp(x) for x in logits.tolist()]
    total = sum(z)
    probs = [x / total for x in z]
    entropy = -sum(p * math.log(p) for p in probs)
    top = sorted(logits.tolist(), reverse=True)
    ent, lp, margin = token_stats(logits.to(torch.bfloat16).float(), chosen)  # any dtype in, float32 math
    ent32, lp32, margin32 = token_stats(logits, chosen)
    assert ent32 == pytest.approx(entropy, abs=1e-4)
    assert lp32 == pytest.approx(math.log(probs[chosen]), abs=1e-4)
    assert margin32 == pytest.approx(top[0] - top[1], abs=1e-4)
    assert ent == pytest.approx(entropy, abs=0.1) and margin >= 0


def test_token_stats_extremes() -> None:
    peaked = torch.tensor([20.0, 0.0, 0.0, 0.0])
    ent, lp, margin = token_stats(peaked, 0)
    assert ent < 1e-6 and lp > -1e-6 and margin == pytest.approx(20.0)
    flat = torch.zeros(8)
    ent, lp, margin = token_stats(flat, 3)
    assert ent == pytest.approx(math.log(8)) and lp == pytest.approx(-math.log(8)) and margin == 0.0


# -- stop and cut rules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ended", "prefix"),
    [
        ("Sure, I", False, "Sure,"),
        ("Hello! How", False, "Hello!"),
        ("I'm sorry, but I can't", False, "I'm sorry, but I"),  # "can't" may still continue
        ("I'm sorry, but I can't help", False, "I'm sorry, but I can't"),
        ("I", False, ""),
        ("I", True, "I"),  # EOS completes the last word
        ("well-", False, ""),
        ("well-known fact", False, "well-known"),
        ("It is 3.", False, "It is"),  # could be 3.5
        ("It is 3.5 miles", False, "It is 3.5"),
        ("", False, ""),
        ("   ", True, ""),
        ("Yes \u2014 I", False, "Yes"),
        ("one two three four five six seven", False, "one two three four five"),
    ],
)
def test_prefix_cut(text: str, ended: bool, prefix: str) -> None:
    assert prefix_text(text, ended=ended, max_words=5) == prefix
    # the shipped rule keeps MAX_DRAFT_WORDS (3) of them
    assert prefix_text(text, ended=ended) == prefix_text(text, ended=ended, max_words=MAX_DRAFT_WORDS)


def test_prefix_never_cuts_a_half_word() -> None:
    rng = random.Random(0)
    pieces = [
        " the",
        " cat",
        "'s",
        " well",
        "-",
        "known",
        ",",
        ".",
        "!",
        " 3",
        ".",
        "5",
        " I",
        "'m",
        " sorry",
        "?",
        " un",
        "believ",
        "able",
        " \u2014",
        " caf\u00e9",
        " ",
    ]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 9))).lstrip()
        full = text + rng.choice([" next", "ing", "'s", "-ly", "5", ""])  # what a later token might add
        prefix = prefix_text(text)
        assert text.startswith(prefix)
        if prefix:
            # every word of the prefix is also a whole word of any continuation of the draft
            spans = {full[a:b] for a, b in complete_words(full, ended=True)}
            for a, b in complete_words(prefix, ended=True):
                assert prefix[a:b] in spans, (text, full, prefix)
            assert len(complete_words(prefix, ended=True)) <= MAX_DRAFT_WORDS


def test_draft_stop_rules() -> None:
    assert not draft_stop("I'm sorry, but I can't", 7, max_words=5)  # 4 complete words
    assert draft_stop("I'm sorry, but I can't help", 8, max_words=5)  # 5 complete words
    assert MAX_DRAFT_WORDS == 3 and draft_stop("I'm sorry, but I", 5) and not draft_stop("I'm sorry, but", 4)
    assert draft_stop("Hello!", 2) and draft_stop("Is it?", 3) and draft_stop("Yes.", 2)
    assert not draft_stop("It costs 3.", 4)  # a decimal point, not a sentence end
    assert draft_stop("abc", MAX_DRAFT_TOKENS) and not draft_stop("abc", MAX_DRAFT_TOKENS - 1)
    assert ends_sentence("I am 25 years old.") and not ends_sentence("Well,")


def test_draft_records_what_chose_each_token() -> None:
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    ids = tok.encode(
        "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    d = draft(model, tok, ids)
    n = len(d.tokens)
    assert 0 < n <= MAX_DRAFT_TOKENS
    assert d.hidden.shape == (n, model.config.hidden_size) and d.stats.shape == (n, 3)
    with torch.no_grad():
        logits = model.lm_head(d.hidden)
    assert logits.argmax(-1).tolist() == d.tokens
    for i in range(n):
        assert d.stats[i].tolist() == pytest.approx(token_stats(logits[i], d.tokens[i]), abs=1e-4)
    assert d.prefix == prefix_text(d.text, ended=d.ended)
    # the stop rule held only at the end
    for k in range(1, n):
        assert not draft_stop(tok.decode(d.tokens[:k]), k)


# -- the verifier model ----------------------------------------------------------------------------------


def test_verifier_shapes_and_size() -> None:
    torch.manual_seed(0)
    v = Verifier(576).eval()
    p = v(torch.randn(4, 12, 576), torch.randn(4, 12, 3), torch.ones(4, 12))
    assert p.shape == (4,) and ((p > 0) & (p < 1)).all()
    assert sum(x.numel() for x in v.parameters()) <= 170_000
    with pytest.raises(ValueError, match="hidden size"):
        v(torch.randn(1, 3, 64), torch.randn(1, 3, 3), torch.ones(1, 3))


def test_padding_does_not_change_p() -> None:
    torch.manual_seed(0)
    v = Verifier(32).eval()
    h, s = torch.randn(3, 5, 32), torch.randn(3, 5, 3)
    lengths = [5, 2, 1]
    mask = torch.zeros(3, 5)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    p = v(h, s, mask)
    h2, s2 = h.clone(), s.clone()
    h2[mask == 0] = float("nan")  # garbage in padded slots must not leak through
    s2[mask == 0] = 1e6
    wide_h = torch.cat([h2, torch.randn(3, 4, 32)], 1)
    wide_s = torch.cat([s2, torch.randn(3, 4, 3)], 1)
    wide_m = torch.cat([mask, torch.zeros(3, 4)], 1)
    assert torch.allclose(p, v(wide_h, wide_s, wide_m), atol=1e-6)
    for i, n in enumerate(lengths):  # and each row alone, unpadded
        alone = v(h[i : i + 1, :n], s[i : i + 1, :n], torch.ones(1, n))
        assert torch.allclose(p[i : i + 1], alone, atol=1e-6)
    empty = v(h[:1], s[:1], torch.zeros(1, 5))
    assert torch.isfinite(empty).all()


def test_focal_loss_sanity() -> None:
    logits = torch.tensor([3.0, -3.0, 0.5, -0.2])
    y = torch.tensor([1, 0, 0, 1])
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, y.float())
    # gamma 0 and alpha 0.5: half the cross-entropy
    assert RM.focal_loss(logits, y, alpha=0.5, gamma=0.0) == pytest.approx(0.5 * float(bce), rel=1e-5)
    # focusing shrinks the loss, and most for the easy (confident, correct) examples
    easy = RM.focal_loss(torch.tensor([4.0]), torch.tensor([1]), 0.5, 2.0) / RM.focal_loss(
        torch.tensor([4.0]), torch.tensor([1]), 0.5, 0.0
    )
    hard = RM.focal_loss(torch.tensor([-1.0]), torch.tensor([1]), 0.5, 2.0) / RM.focal_loss(
        torch.tensor([-1.0]), torch.tensor([1]), 0.5, 0.0
    )
    assert easy < 0.001 < 0.5 < hard
    # gradient pushes logits toward the label
    x = logits.clone().requires_grad_()
    RM.focal_loss(x, y).backward()
    assert (x.grad[y == 1] < 0).all() and (x.grad[y == 0] > 0).all()


def test_auroc_and_threshold() -> None:
    rng = random.Random(0)
    s = [rng.random() for _ in range(60)]
    y = [int(rng.random() < 0.4) for _ in range(60)]
    pairs = [(a, b) for a, ya in zip(s, y, strict=True) if ya for b, yb in zip(s, y, strict=True) if not yb]
    brute = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / len(pairs)
    assert RM.auroc(s, y) == pytest.approx(brute)
    assert RM.auroc([0.1, 0.1, 0.1], [0, 1, 0]) == pytest.approx(0.5)
    assert math.isnan(RM.auroc([0.2, 0.3], [1, 1]))
    thr = RM.tune_threshold([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1])
    assert 0.2 < thr < 0.8 and RM.classify_metrics([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1], thr)["macro_f1"] == 1.0


def test_commit_threshold_commits_the_asked_share() -> None:
    p = [i / 100 for i in range(100)]
    for fraction in (0.5, 0.9, 0.95, 1.0):
        t = V.commit_threshold(p, fraction)
        assert sum(x >= t for x in p) == round(100 * fraction)
    assert V.commit_threshold([0.7, 0.7, 0.7], 0.5) <= 0.7  # ties all commit


def test_the_engine_never_commits_what_no_score_can_excuse() -> None:
    from dialogue.verifier import draft_veto

    assert draft_veto("The dragon is a", "The dragon is a fierce and") == "repeat"
    assert draft_veto("\u4f60\u597d") == "foreign" and draft_veto("**Sure**", None) == "markup"
    # a new answer may share one opening word with the last one; echoing the question is allowed
    assert draft_veto("Sure, I can", "Sure! What time?") is None
    assert draft_veto("Good evening!", None) is None and draft_veto("Two plus two", "The dragon is a") is None
    assert draft_veto("The capital of", "The capital of France is Paris.") == "repeat"


def test_after_a_barge_in_cue_a_draft_about_the_cut_off_answer_is_vetoed():
    from dialogue.verifier import draft_veto
    from duplex.base.cues import opens_with_cue as opens_with_interrupt_cue

    cut = "A car engine is a machine that turns fuel into motion. First, air"
    # the live bench's wrong answer: the drafter went on about the engine, the slow model continued it
    assert draft_veto("The car engine works", cut, "Stop. how many days are in a year?") == "topic"
    # the caller's new words are in the draft: an answer to them
    assert draft_veto("Two plus two equals", cut, "Stop, what is two plus two?") is None
    # a follow-up on the same topic names it ("engines" meets "engine")
    assert draft_veto("An engine needs oil", cut, "Wait, why do engines need oil?") is None
    # no barge-in cue: talking about the previous answer is what follow-ups do ("Why?")
    assert draft_veto("The car engine needs", cut, "Why is that?") is None
    # without the user's turn (the verifier's training labels) nothing changes
    assert draft_veto("The car engine works", cut) is None
    # the live bench's other one: the topic was in the request, not in the words of the answer
    mouse = "Tell me a long story about a brave little mouse."
    assert (
        draft_veto(
            "The story about a",
            "Once upon a time, in a cozy hole, lived Pip.",
            "Stop. What is two plus two?",
            previous_request=mouse,
        )
        == "topic"
    )
    assert (
        draft_veto(
            "Two plus two is", "Once upon a time", "Stop. What is two plus two?", previous_request=mouse
        )
        is None
    )
    assert opens_with_interrupt_cue("Hold on, what color is grass?") and opens_with_interrupt_cue("wait")
    assert not opens_with_interrupt_cue("Waiters are busy") and not opens_with_interrupt_cue("What is it?")


def test_named_operating_points() -> None:
    from dialogue.engine import verifier_operating_point
    from duplex.base.config import ConfigError

    meta = {"threshold": 0.8, "thresholds": {"latency": 0.2, "strict": 0.95}}
    assert verifier_operating_point(meta, None) == verifier_operating_point(meta, "balanced") == (0.8, None)
    assert verifier_operating_point(meta, "strict") == (0.95, None)
    assert verifier_operating_point(meta, 0.5) == verifier_operating_point(meta, "0.5") == (0.5, None)
    # a rolling point keeps the share committed: scores drifting down move its threshold with them
    meta["rolling"] = {"latency": {"commit": 0.9, "window": 20, "prior": [i / 20 for i in range(20)]}}
    thr, rolling = verifier_operating_point(meta, "latency")
    assert isinstance(rolling, V.RollingThreshold) and thr == pytest.approx(0.075)
    for i in range(20):
        rolling.observe(0.5 * i / 20)
    assert rolling.threshold() == pytest.approx(0.0375)
    assert sum(0.5 * i / 20 >= rolling.threshold() for i in range(20)) == 18
    with pytest.raises(ConfigError, match="balanced, latency"):
        verifier_operating_point(meta, "fast")
    with pytest.raises(ConfigError, match="not in"):
        verifier_operating_point(meta, 1.5)


def _synthetic(n: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Separable by a direction in hidden space and by the log-prob statistic, variable lengths."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) < 0.4).long()
    h = torch.randn(n, 8, 24, generator=g)
    h[:, :, 0] += torch.where(y == 1, 1.5, -1.5)[:, None]
    s = torch.randn(n, 8, 3, generator=g)
    s[:, :, 1] += torch.where(y == 1, 1.0, -1.0)[:, None]
    lengths = torch.randint(1, 9, (n,), generator=g)
    mask = (torch.arange(8)[None] < lengths[:, None]).float()
    return (h, s, mask), y


def test_tiny_training_separates_a_separable_set() -> None:
    torch.set_num_threads(1)
    tr, ytr = _synthetic(400, 0)
    va, yva = _synthetic(150, 1)
    te, yte = _synthetic(150, 2)
    cfg = T.TrainConfig(dim=16, head_dim=16, epochs=40, patience=15, batch=64, seed=0)
    model, info = T.train_verifier(tr, ytr, va, yva, cfg)
    assert info["best_val_auroc"] > 0.95
    assert RM.auroc(T.predict(model, te), yte) > 0.95


# -- labels -----------------------------------------------------------------------------------------------


def test_forced_negatives() -> None:
    assert T.forced_negative({"prefix": "", "text": "hi"}) == "empty"
    assert T.forced_negative({"prefix": "\u4f60\u597d", "text": "hi"}) == "foreign"
    assert (
        T.forced_negative({"prefix": "What is the capital", "text": "what is the capital of France"})
        == "echo"
    )
    assert T.forced_negative({"prefix": "Hey how's it going?", "text": "Hey how's it going"}) == "echo"
    assert T.forced_negative({"prefix": "```python\ndef", "text": "write a sort"}) == "markup"
    assert T.forced_negative({"prefix": "**Sure**", "text": "hi"}) == "markup"
    assert (
        T.forced_negative({"prefix": "The capital of France is", "text": "what is the capital of France"})
        is None
    )
    army = "What is the lowest army rank of a US soldier"
    assert T.forced_negative({"prefix": "The lowest army rank of", "text": army}) is None
    assert (
        T.forced_negative({"prefix": "Remind me to take my", "text": "Remind me to take my pills"}) == "echo"
    )
    assert T.forced_negative({"prefix": "Caf\u00e9 au lait is", "text": "what is cafe au lait"}) is None
    assert RP.normalise_asr_text(' Hello, "world"!  I\'m  here.') == "Hello world I'm here"


def test_labels_accept_the_slow_models_own_opening_or_typical_tokens() -> None:
    import math

    acc = T.Acceptance()  # Medusa: p >= min(0.09, 0.3 * exp(-H))
    # the slow model is unsure (H = 3 nats: bar 0.3 * e^-3 = 0.015): a 5 % token passes; a 1 % one fails
    assert acc.accepts([math.log(0.05)], [3.0]) and not acc.accepts([math.log(0.01)], [3.0])
    # it is sure (H = 0.2: bar min(0.09, 0.25) = 0.09): only a likely token passes
    assert acc.accepts([math.log(0.5)], [0.2]) and not acc.accepts([math.log(0.05)], [0.2])
    assert not acc.accepts([], []) and not acc.accepts([math.log(0.5)], [])
    base = {
        "text": "what is the capital of France",
        "score_logprobs": [math.log(0.5), math.log(0.001)],
        "score_entropies": [1.0, 1.0],
    }
    # unlikely by the scores, but word for word how the slow model itself begins: acceptable
    own = base | {"prefix": "The capital of", "slow_text": "The capital of France is"}
    assert T.judge_prefix(own, acc) == "own"
    assert T.judge_prefix(own | {"slow_text": "The capital, of France"}, acc) == "own"  # punctuation aside
    assert T.judge_prefix(own | {"slow_text": "Paris is the capital"}, acc) == "atypical"
    typical = own | {"slow_text": "Paris", "score_logprobs": [math.log(0.5), math.log(0.2)]}
    assert T.judge_prefix(typical, acc) == "ok"
    # forced negatives win even over the slow model's own words (it may echo the question too)
    echo = base | {"prefix": "What is the capital", "slow_text": "What is the capital of"}
    assert T.judge_prefix(echo, acc) == "echo"
    exs = [dict(own), dict(echo)]
    assert T.label_examples(exs, acc) == [1, 0] and exs[0]["reason"] == "own"
    assert "typical acceptance" in acc.rule


def test_split_keeps_groups_together() -> None:
    ex = [{"group": f"g{i // 3}"} for i in range(300)]
    splits = RP.split_groups(ex, seed=0)
    seen: dict[str, str] = {}
    for name, idx in splits.items():
        for i in idx:
            assert seen.setdefault(ex[i]["group"], name) == name
    assert sorted(i for v in splits.values() for i in v) == list(range(300))
    assert 160 <= len(splits["train"]) <= 200


# -- shipped weights ----------------------------------------------------------------------------------


def test_shipped_weights_and_metadata() -> None:
    model, thr, meta = load_verifier()
    assert 0.0 < thr < 1.0
    assert meta["hidden_size"] == model.hidden_size == 576
    assert meta["drafter"]["name"] == "smollm2-135m-instruct" and meta["slow_model"]["name"]
    assert "label 1 iff" in meta["label_rule"] and 0 < meta["acceptance"]["epsilon"] < 1
    ho = meta["heldout"]
    assert ho["n"] > 0 and 0.5 < ho["auroc"] <= 1.0 and 0.0 <= ho["commit_fraction"] <= 1.0
    # the latency point commits more drafts than the balanced one
    assert 0.0 < meta["thresholds"]["latency"] < thr
    assert ho["latency"]["commit_fraction"] > ho["commit_fraction"]
    assert meta["data"]["prompts"] >= 1000 and meta["params"] <= 170_000
    assert sum(x.numel() for x in model.parameters()) == meta["params"]
    p = model(torch.randn(2, 4, 576), torch.randn(2, 4, 3), torch.ones(2, 4))
    assert p.shape == (2,)
    with pytest.raises(ModelError, match="hidden size"):
        load_verifier(hidden_size=896)


def test_missing_or_broken_weights_say_how_to_fix(tmp_path) -> None:
    with pytest.raises(ModelError, match="train_verifier"):
        load_verifier(tmp_path / "nope.safetensors")
    (tmp_path / "v.safetensors").write_bytes(DEFAULT_WEIGHTS.read_bytes())
    meta = json.loads(DEFAULT_WEIGHTS.with_suffix(".json").read_text())
    (tmp_path / "v.json").write_text(json.dumps(meta | {"dim": 64}))
    with pytest.raises(ModelError, match="cannot load"):
        load_verifier(tmp_path / "v.safetensors")


@pytest.mark.parametrize(
    ("draft", "prefix", "ended", "whole"),
    [
        ("The capital of France", "The capital of", False, True),
        (" Sure, I can", "Sure,", False, True),
        ("Hello!", "Hello!", True, True),
        ("Hello!", "Hello!", False, True),  # a sentence mark ends the word: a space follows it in English
        ("In a day,", "In a day,", False, True),
        ("It is 3.", "It is 3.", False, False),  # a decimal point, perhaps
        ("The capital of", "The capital of", False, False),  # stopped on its budget: "of" may go on ("often")
        ("well-known", "well", False, False),
        ("", "", False, False),
    ],
)
def test_prefix_ends_word(draft: str, prefix: str, ended: bool, whole: bool) -> None:
    from dialogue.verifier import prefix_ends_word

    assert prefix_ends_word(draft, prefix, ended) is whole


@pytest.mark.parametrize(
    ("draft", "question", "head"),
    [
        # the caller's words, up to plural / verb endings and British spelling, plus words with no fact
        ("The capital of Italy", "What is the capital of Italy?", "The capital of Italy"),
        ("A cow makes a", "What sound does a cow make?", "A cow makes a"),
        ("Grass is a color", "What colour is grass?", "Grass is a color"),
        ("An insect has approximately", "How many legs does an insect have?", "An insect has"),
        ("Two plus two equals", "What is two plus two?", "Two plus two equals"),
        # the drafter's slips (live, under the 1.5B slow model) stop at the first word the caller did not say
        ("Bees are made of", "What do bees make?", "Bees are"),
        ("The sky is black", "Could you tell me what color the sky is", "The sky is"),
        ("Monday is Friday.", "What day comes after Monday?", "Monday is"),
        ("The barber is a", "Which animal barks?", ""),
        ("Coimber is a color", "What colour is coal?", ""),
        ("91.", "What is nine plus one?", ""),
        # numbers, yes / no and apologies are facts (or refusals) the caller did not say
        ("No, the sun", "Is the sun a planet?", ""),
        ("I'm sorry, but I", "How are you today?", ""),
        # the first person only when the caller speaks to the service
        ("I live on the", "Which planet do we live on?", ""),
        ("I'm a color.", "What colour do you get when you mix red and white?", ""),
        ("I'm doing well!", "How are you today?", "I'm doing well!"),
        ("My name is", "What is your name?", "My name is"),
    ],
)
def test_a_grounded_draft_says_nothing_the_caller_did_not(draft: str, question: str, head: str) -> None:
    assert V.grounded_prefix(draft, question) == head


def test_a_grounded_head_shorter_than_asked_is_no_head() -> None:
    assert V.grounded_prefix("Bees are made of", "What do bees make?", min_words=3) == ""
    assert V.grounded_prefix("A cow makes a", "What sound does a cow make?", min_words=3) == "A cow makes a"
    assert V.grounded_prefix("The force pulling down", "What force pulls things down?", min_words=1) == (
        "The force"
    )


def test_who_the_caller_speaks_to() -> None:
    def to_service(text: str) -> bool:
        return V.addresses_service(V.words(text))

    assert to_service("How are you today?") and to_service("Can you recommend a good book?")
    assert to_service("What's your name?") and to_service("Do you like music?")
    assert not to_service("What colour do you get when you mix red and white?")
    assert not to_service("Which planet do we live on?") and not to_service("")
