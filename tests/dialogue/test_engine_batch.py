"""`DialogueStage.step_batch` == `step` one session at a time, with tiny seeded float32 models.

Every check builds two identical sets of sessions (twins) at different points of their
conversations, steps one set session by session with `step` (the reference) and the other with
`step_batch`, and compares the outputs (text deltas, done flags, token counts, prefill counts, turn
probabilities) and the sessions' caches afterwards. In float32 the batched forward differs from the
one-by-one forward by float rounding only, so the greedy tokens are the same.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dialogue.engine import DialogueStage, DialogueState, DrafterOptions, SlowOptions
from duplex.base.messages import ListenOutput, ListenStep, OverlapStep, RespondOutput, RespondStep
from tests.dialogue.test_engine import SYSTEM, _Verifier, tiny
from tests.dialogue.test_engine import tokenizer as tokenizer  # noqa: F401  (the module-scoped fixture)

ATOL = 1e-5

FRANCE = [{"role": "user", "content": "what is the capital of france"}]
STORY = [{"role": "user", "content": "tell me a story please"}]
HOW = [
    {"role": "user", "content": "how are you today"},
    {"role": "assistant", "content": "i am fine thanks"},
    {"role": "user", "content": "stop what is two plus two"},
]


@pytest.fixture(autouse=True)
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


class _HiddenHeads(torch.nn.Module):
    """Turn probabilities that depend on the drafter's hidden state, so a mixed-up session shows."""

    def turn(self, h):
        return torch.softmax(h[:3], 0)

    def overlap(self, h):
        return torch.sigmoid(h[0])


@pytest.fixture(scope="module")
def models(tokenizer):  # noqa: F811
    return tiny("qwen2", len(tokenizer), 4), tiny("llama", len(tokenizer), 5)


def make_stage(tokenizer, models, max_new_tokens: int = 14, window: int = 1536) -> DialogueStage:  # noqa: F811
    slow, drafter = models
    return DialogueStage(
        slow,
        tokenizer,
        SlowOptions(system_prompt=SYSTEM, max_new_tokens=max_new_tokens, window_tokens=window, evict_chunk=8),
        drafter,
        tokenizer,
        DrafterOptions(draft_words=3, window_tokens=min(window, 1024), evict_chunk=8),
        _HiddenHeads(),
        None,
        _Verifier(0.9),
        0.5,
    )


Script = Callable[[DialogueStage, DialogueState], None]


def answering(msgs, relay: bool, steps: int, listen_midway: str | None = None) -> Script:
    """A session that started an answer to `msgs` and decoded `steps` continuation steps; with
    `listen_midway` the user then talked over it (a listen step moves the slow cache away)."""

    def run(stage: DialogueStage, state: DialogueState) -> None:
        stage.step(state, ListenStep(msgs[:-1], msgs[-1]["content"]))
        stage.step(state, RespondStep(msgs, 4, relay))
        for _ in range(steps):
            stage.step(state, RespondStep(None, 3))
        if listen_midway is not None:
            history = msgs + [{"role": "assistant", "content": "the"}]
            stage.step(state, ListenStep(history, listen_midway, preclose=False))

    return run


def twins(stage: DialogueStage, scripts: list[Script]) -> tuple[list[DialogueState], list[DialogueState]]:
    ref, bat = [], []
    for script in scripts:
        for side in (ref, bat):
            state = stage.init_state()
            script(stage, state)
            side.append(state)
    return ref, bat


def assert_same_out(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, RespondOutput):
        assert (b.text, b.done, b.n_tokens, b.prefill_tokens) == (
            a.text,
            a.done,
            a.n_tokens,
            a.prefill_tokens,
        )
        assert (a.relay is None) == (b.relay is None)
        if a.relay is not None:
            assert (b.relay.draft, b.relay.prefix, b.relay.committed) == (
                a.relay.draft,
                a.relay.prefix,
                a.relay.committed,
            )
        assert set(b.timings) == set(a.timings)
    elif isinstance(a, ListenOutput):
        assert b.prefill_tokens == a.prefill_tokens
        assert b.probs == pytest.approx(a.probs, abs=1e-5)
        assert set(b.timings) == set(a.timings)
    else:
        assert b.interrupt == a.interrupt and b.p_interrupt == pytest.approx(a.p_interrupt, abs=1e-5)


def assert_same_track(a, b) -> None:
    if a is None:
        assert b is None
        return
    ca, cb = a.cache, b.cache
    assert cb.ids == ca.ids and cb.evicted == ca.evicted
    assert cb.cache.get_seq_length() == len(cb.ids)
    assert [p.key for p in b.pieces] == [p.key for p in a.pieces]
    assert [p.ids for p in b.pieces] == [p.ids for p in a.pieces]
    assert [cp[0] for cp in b.checkpoints] == [cp[0] for cp in a.checkpoints]
    for x, y in ((ca.logits, cb.logits), (ca.hidden, cb.hidden)):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(y, x, atol=ATOL, rtol=0)


def assert_same_state(a: DialogueState, b: DialogueState) -> None:
    assert (b.response_ids, b.pending, b.emitted_chars, b.done) == (
        a.response_ids,
        a.pending,
        a.emitted_chars,
        a.done,
    )
    assert (b.prefix, b.seam_space, b.answer_live) == (a.prefix, a.seam_space, a.answer_live)
    assert_same_track(a.drafter, b.drafter)
    assert_same_track(a.slow, b.slow)


def one_by_one(stage, states, chunks):
    return [stage.step(s, c)[0] for s, c in zip(states, chunks, strict=True)]


def batched(stage, states, chunks):
    results = stage.step_batch(list(zip(states, chunks, strict=True)))
    assert [s for _, s in results] == states  # each session's own state comes back
    return [o for o, _ in results]


def compare(stage, ref, bat, chunks):
    outs_ref = one_by_one(stage, ref, chunks)
    outs_bat = batched(stage, bat, chunks)
    for a, b in zip(outs_ref, outs_bat, strict=True):
        assert_same_out(a, b)
    for a, b in zip(ref, bat, strict=True):
        assert_same_state(a, b)
    return outs_ref


def test_continuations_of_sessions_at_different_points_decode_as_one_by_one(tokenizer, models):  # noqa: F811
    stage = make_stage(tokenizer, models)
    scripts = [
        answering(FRANCE, relay=False, steps=0),
        answering(STORY, relay=True, steps=0),  # the first continuation prefills the committed draft
        answering(HOW, relay=False, steps=2),
        answering(FRANCE, relay=False, steps=1, listen_midway="wait"),  # back from a listen: resync
        answering(STORY, relay=False, steps=3),  # near max_new_tokens: finishes first
    ]
    ref, bat = twins(stage, scripts)
    texts_ref = [""] * len(ref)
    sizes = [4, 3, 5, 2, 4]  # each session's own step size
    rounds = 0
    finished_at = {}
    while not all(s.done for s in ref):
        outs = compare(stage, ref, bat, [RespondStep(None, k) for k in sizes])
        for i, o in enumerate(outs):
            texts_ref[i] += o.text
            if o.done:
                finished_at.setdefault(i, rounds)
        rounds += 1
        assert rounds < 20
    assert len(set(finished_at.values())) > 1  # the sessions ended at different steps
    compare(stage, ref, bat, [RespondStep(None, 4)] * len(ref))  # all done: empty, done
    assert all(texts_ref)


def test_a_session_that_stops_at_its_stop_token_leaves_the_batch(tokenizer, models):  # noqa: F811
    stage = make_stage(tokenizer, models, max_new_tokens=30)
    scripts = [answering(FRANCE, False, 0), answering(STORY, False, 0), answering(HOW, False, 0)]
    # find a token session 0 decodes soon that the others never do, and make it a stop token
    probe = [stage.init_state() for _ in scripts]
    for script, state in zip(scripts, probe, strict=True):
        script(stage, state)
        stage.step(state, RespondStep(None, 30))
    others = set(probe[1].response_ids) | set(probe[2].response_ids)
    first = probe[0].response_ids
    stop = next((t for t in first[len(first) // 3 :] if t not in others and t not in first[:3]), None)
    if stop is None:
        pytest.skip("no token of the first answer is unique to it")
    stage.slow_stop = stage.slow_stop | {stop}
    ref, bat = twins(stage, scripts)
    while not all(s.done for s in ref):
        compare(stage, ref, bat, [RespondStep(None, 4)] * len(ref))
    assert stop not in ref[0].response_ids and len(ref[0].response_ids) < 30
    assert len(ref[1].response_ids) != len(ref[0].response_ids)


def test_listen_steps_of_several_sessions_prefill_together_as_one_by_one(tokenizer, models):  # noqa: F811
    stage = make_stage(tokenizer, models)

    def partial(msgs, text, preclose=None):
        def run(stage, state):
            stage.step(state, ListenStep(msgs, text, preclose=preclose))

        return run

    scripts = [
        lambda stage, state: None,  # a fresh session
        partial([], "what is the"),
        partial([], "what is the capital of fran"),  # the ASR will revise its last word
        partial(HOW[:2], "stop what", preclose=False),
        answering(STORY, relay=False, steps=1),  # listening while answering
        partial([], "tell me"),
    ]
    ref, bat = twins(stage, scripts)
    chunks = [
        ListenStep([], "what is"),
        ListenStep([], "what is the capital"),
        ListenStep([], "what is the capital of france"),
        ListenStep(HOW[:2], "stop what is two", preclose=False),
        ListenStep(STORY + [{"role": "assistant", "content": "once"}], "wait", prefill_slow=True),
        # nothing new for the drafter: it rolls back its pre-closed turn end to a checkpoint
        ListenStep([], "tell me", prefill_slow=False, preclose=False),
    ]
    outs = compare(stage, ref, bat, chunks)
    assert outs[5].prefill_tokens == 0 and outs[0].prefill_tokens > 0
    # and again: the next slices (one empty, normalised away) and a repeat of the same words
    compare(
        stage,
        ref,
        bat,
        [
            ListenStep([], "what is two"),
            ListenStep([], "?"),
            ListenStep([], "what is the capital of france"),
            ListenStep(HOW[:2], "stop what is two plus two", preclose=True),
            ListenStep(STORY + [{"role": "assistant", "content": "once"}], "wait stop"),
            ListenStep([], "tell me a story"),
        ],
    )


def test_a_mixed_batch_runs_each_kind_as_one_by_one(tokenizer, models):  # noqa: F811
    stage = make_stage(tokenizer, models)
    scripts = [
        lambda stage, state: stage.step(state, ListenStep([], "what is the capital")),
        answering(STORY, relay=False, steps=0),
        lambda stage, state: stage.step(state, ListenStep([], "what is the capital of france")),
        answering(HOW, relay=True, steps=1),
        lambda stage, state: None,
        answering(FRANCE, relay=False, steps=2),
    ]
    ref, bat = twins(stage, scripts)
    chunks = [
        ListenStep([], "what is the capital of"),
        RespondStep(None, 4),
        RespondStep(FRANCE, 4, True),  # a first step with the relay: one by one
        RespondStep(None, 3),
        OverlapStep("stop"),
        RespondStep(None, 5),
    ]
    outs = compare(stage, ref, bat, chunks)
    assert outs[2].relay is not None and outs[2].relay.committed
    # then the answer that was just started continues in a batch with the others
    compare(
        stage,
        ref,
        bat,
        [ListenStep([], "what"), *[RespondStep(None, 4)] * 3, OverlapStep("yeah"), RespondStep(None, 4)],
    )


def test_a_broken_session_fails_the_batch_and_the_others_succeed_one_by_one(tokenizer, models):  # noqa: F811
    stage = make_stage(tokenizer, models)
    scripts = [answering(FRANCE, False, 1), answering(STORY, False, 1), answering(HOW, False, 1)]
    ref, bat = twins(stage, scripts)
    # the middle session's cache no longer matches its ids: its forward raises part way through
    # the batch, after the first session's cache was extended
    bat[1].slow.cache.ids.append(bat[1].slow.cache.ids[-1])
    chunks = [RespondStep(None, 4)] * 3
    with pytest.raises(RuntimeError, match="cache holds"):
        stage.step_batch(list(zip(bat, chunks, strict=True)))
    # what the executor does next: each job alone; the healthy sessions decode what they would have
    for i in (0, 2):
        out_ref, _ = stage.step(ref[i], chunks[i])
        out_bat, _ = stage.step(bat[i], chunks[i])
        assert_same_out(out_ref, out_bat)
        assert_same_state(ref[i], bat[i])
    with pytest.raises(RuntimeError, match="cache holds"):
        stage.step(bat[1], chunks[1])


def test_a_session_without_a_slow_cache_fails_the_batch_before_any_session_moves(tokenizer, models):  # noqa: F811
    stage = make_stage(tokenizer, models)
    ref, bat = twins(stage, [answering(FRANCE, False, 1), answering(STORY, False, 1)])
    bat[1].slow = None
    with pytest.raises(ValueError, match="slow-model cache"):
        stage.step_batch([(bat[0], RespondStep(None, 4)), (bat[1], RespondStep(None, 4))])
    assert_same_state(ref[0], bat[0])


def test_a_batch_runs_one_forward_per_token_not_one_per_session(tokenizer, models, monkeypatch):  # noqa: F811
    stage = make_stage(tokenizer, models, max_new_tokens=40)
    _, bat = twins(stage, [answering(FRANCE, False, 1), answering(STORY, False, 1), answering(HOW, False, 1)])
    calls: dict[str, list[int]] = {"slow": [], "drafter": []}
    for name in calls:
        lm = getattr(stage, name).lm
        single, batch = lm.feed, lm.feed_batch
        monkeypatch.setattr(lm, "feed", lambda c, ids, _f=single, _n=name: calls[_n].append(1) or _f(c, ids))
        monkeypatch.setattr(
            lm,
            "feed_batch",
            lambda cs, ids, _f=batch, _n=name, **kw: calls[_n].append(len(cs)) or _f(cs, ids, **kw),
        )
    outs = batched(stage, bat, [RespondStep(None, 4)] * 3)
    assert all(o.n_tokens == 4 for o in outs)
    assert calls["slow"] == [3] * 4  # each session's pending token fed, four rounds
    calls["slow"].clear()
    batched(stage, bat, [ListenStep([], "what is"), ListenStep([], "tell me"), ListenStep(HOW[:2], "stop")])
    assert calls == {"drafter": [3, 3], "slow": [3]}  # the turn, the pre-closed turn end; the slow prefill


def test_int8_sessions_batched_with_per_session_quant_decode_as_one_by_one(tokenizer):  # noqa: F811
    from dialogue.llm_weights import quantize_int8_dynamic

    slow = quantize_int8_dynamic(tiny("qwen2", len(tokenizer), 4))
    opts = SlowOptions(system_prompt=SYSTEM, max_new_tokens=16, per_session_quant=True)
    stage = DialogueStage(slow, tokenizer, opts)
    scripts = [answering(FRANCE, False, 0), answering(STORY, False, 1), answering(HOW, False, 0)]
    ref, bat = twins(stage, scripts)
    while not all(s.done for s in ref):
        compare(stage, ref, bat, [RespondStep(None, 4)] * len(ref))


def test_sessions_whose_window_scrolls_mid_batch_decode_as_one_by_one(tokenizer, models):  # noqa: F811
    stage = make_stage(tokenizer, models, max_new_tokens=40, window=40)
    scripts = [answering(FRANCE, False, 0), answering(HOW, False, 1), answering(STORY, False, 2)]
    ref, bat = twins(stage, scripts)
    evicted = [s.slow.cache.evicted for s in bat]
    while not all(s.done for s in ref):
        compare(stage, ref, bat, [RespondStep(None, 5)] * len(ref))
    assert all(s.slow.cache.evicted > e for s, e in zip(bat, evicted, strict=True))
    # and the next turn's listen step, over the scrolled caches, too
    compare(
        stage,
        ref,
        bat,
        [ListenStep(FRANCE + [{"role": "assistant", "content": "paris"}], "and") for _ in ref],
    )
