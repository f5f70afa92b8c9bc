"""Batched decode across sessions (CachedLM.feed_batch, FastDecoder.forward_batch) == one by one.

Every check runs the same sessions twice, one set fed one session at a time with `feed` (the
reference, itself checked against a fresh prefill in test_kv_cache.py) and a twin set fed together
with `feed_batch`, and compares logits, hidden states, greedy tokens and the cache contents. The
sessions sit at different positions with caches of different lengths (ragged) and feed different
numbers of tokens (the padded, masked attention path), so a padding or mask error shows up as a
difference. The models are test_kv_cache.py's tiny seeded Llama and Qwen2
(sharp, position-dependent attention), in float32, where batching must not change any number beyond
float rounding; dynamically int8-quantised models quantise a whole product input with one scale, so
there batched rows agree only with `per_session_quant` (checked separately).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import PreTrainedModel

from dialogue.kv_cache import CachedLM, LmCache
from dialogue.llm_weights import quantize_int8_dynamic
from tests.dialogue.test_kv_cache import rand_ids, tiny_model

ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return tiny_model(request.param, seed=21)


def twins(lm: CachedLM, prompts: list[list[int]]) -> tuple[list[LmCache], list[LmCache]]:
    """Two identical sets of sessions, each prefilled with its own prompt (one by one)."""
    ref, bat = [], []
    for p in prompts:
        a, b = lm.new(), lm.new()
        lm.feed(a, p)
        lm.feed(b, p)
        ref.append(a)
        bat.append(b)
    return ref, bat


def assert_same(lm: CachedLM, ref: list[LmCache], bat: list[LmCache], atol: float = ATOL) -> None:
    for a, b in zip(ref, bat, strict=True):
        assert a.ids == b.ids and a.evicted == b.evicted
        assert b.cache.get_seq_length() == len(b.ids)
        assert a.logits is not None and b.logits is not None and a.hidden is not None and b.hidden is not None
        assert b.logits.dtype == b.hidden.dtype == torch.float32
        torch.testing.assert_close(b.logits, a.logits, atol=atol, rtol=0)
        torch.testing.assert_close(b.hidden, a.hidden, atol=atol, rtol=0)
        for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
            torch.testing.assert_close(lb.keys, la.keys, atol=atol, rtol=0)
            torch.testing.assert_close(lb.values, la.values, atol=atol, rtol=0)


def step_both(
    lm: CachedLM, ref: list[LmCache], bat: list[LmCache], feeds: list[list[int]], **kw: bool
) -> tuple[list[int], list[int]]:
    """Feed `feeds` one by one into `ref` and batched into `bat`; the evicted counts of both."""
    ra = [lm.feed(c, f) for c, f in zip(ref, feeds, strict=True)]
    rb = lm.feed_batch(bat, feeds, **kw)
    for y, c in zip(rb, bat, strict=True):
        assert y.logits is c.logits and y.hidden is c.hidden
    return [r.evicted for r in ra], [r.evicted for r in rb]


def greedy_both(lm: CachedLM, ref: list[LmCache], bat: list[LmCache], steps: int, **kw: bool) -> None:
    """Greedy decode both sets in lock-step: each session picks its token from its own logits."""
    for _ in range(steps):
        ta = [[int(torch.argmax(c.logits))] for c in ref]
        tb = [[int(torch.argmax(c.logits))] for c in bat]
        assert ta == tb
        ea, eb = step_both(lm, ref, bat, ta, **kw)
        assert ea == eb
        assert_same(lm, ref, bat)


# -- decode ------------------------------------------------------------------------------------


def test_greedy_decode_at_different_positions(model: PreTrainedModel) -> None:
    lm = CachedLM(model)
    rng = random.Random(1)
    ref, bat = twins(lm, [rand_ids(rng, n) for n in (3, 17, 40, 9)])
    greedy_both(lm, ref, bat, 12)
    assert len({len(c.ids) for c in bat}) == 4  # stayed ragged throughout


@pytest.mark.parametrize("how", ["per_session", "padded"])
def test_both_decode_attentions_equal_one_by_one(model: PreTrainedModel, how: str) -> None:
    """The GPU's padded decode attention (one masked launch a layer) and the CPU's per-session one agree
    with feeding one by one, on ragged caches; forced here on the CPU, so no GPU is needed."""
    from dialogue.fast_decoder import FastDecoder

    lm = CachedLM(model)
    assert lm.fast is not None
    rng = random.Random(3)
    ref, bat = twins(lm, [rand_ids(rng, n) for n in (5, 23, 2)])
    try:
        lm.fast.decode_attention = how
        greedy_both(lm, ref, bat, 8)
    finally:
        lm.fast.decode_attention = FastDecoder.decode_attention
    assert len({len(c.ids) for c in bat}) == 3


def test_greedy_decode_at_equal_positions(model: PreTrainedModel) -> None:
    lm = CachedLM(model)
    rng = random.Random(2)
    ref, bat = twins(lm, [rand_ids(rng, 11) for _ in range(3)])
    greedy_both(lm, ref, bat, 5)


def test_batch_of_one_equals_feed_exactly(model: PreTrainedModel) -> None:
    lm = CachedLM(model)
    rng = random.Random(3)
    ref, bat = twins(lm, [rand_ids(rng, 14)])
    for _ in range(4):
        tok = [int(torch.argmax(ref[0].logits))]
        a = lm.feed(ref[0], tok)
        (b,) = lm.feed_batch(bat, [tok])
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)


def test_forward_batch_of_one_equals_forward(model: PreTrainedModel) -> None:
    """The batched forward itself (CachedLM routes a batch of one to the single path)."""
    lm = CachedLM(model)
    assert lm.fast is not None
    rng = random.Random(4)
    ref, bat = twins(lm, [rand_ids(rng, 10)])
    with torch.inference_mode():
        for ids in ([5], [6, 7, 8], [9]):
            start = len(ref[0].ids)
            want = lm.fast.forward(ref[0].cache, ids, start)
            (got,) = lm.fast.forward_batch([bat[0].cache], [ids], [start])
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
            ref[0].ids += ids
            bat[0].ids += ids


# -- ragged multi-token feeds ------------------------------------------------------------------


def test_prefill_slices_of_different_lengths(model: PreTrainedModel) -> None:
    lm = CachedLM(model)
    rng = random.Random(5)
    ref, bat = twins(lm, [rand_ids(rng, n) for n in (1, 25, 8)])
    for sizes in ((7, 1, 3), (1, 12, 1), (4, 4, 4), (1, 1, 9)):
        step_both(lm, ref, bat, [rand_ids(rng, k) for k in sizes])
        assert_same(lm, ref, bat)
    greedy_both(lm, ref, bat, 3)


def test_first_feed_into_empty_caches(model: PreTrainedModel) -> None:
    lm = CachedLM(model)
    rng = random.Random(6)
    ref, bat = [lm.new() for _ in range(3)], [lm.new() for _ in range(3)]
    step_both(lm, ref, bat, [rand_ids(rng, k) for k in (6, 1, 13)])
    assert_same(lm, ref, bat)


# -- rollback and eviction stay per session ----------------------------------------------------


def test_rollback_on_one_session_in_between(model: PreTrainedModel) -> None:
    lm = CachedLM(model)
    rng = random.Random(7)
    ref, bat = twins(lm, [rand_ids(rng, n) for n in (12, 30, 5)])
    greedy_both(lm, ref, bat, 4)
    for cs in (ref, bat):  # a barge-in drops session 1's reply and its last prompt tokens
        lm.rollback(cs[1], 24)
    # session 1 has no logits now: it is fed a new user turn while the others keep decoding
    user = rand_ids(rng, 6)
    feeds = [[int(torch.argmax(ref[0].logits))], user, [int(torch.argmax(ref[2].logits))]]
    step_both(lm, ref, bat, feeds)
    assert_same(lm, ref, bat)
    assert len(bat[1].ids) == 30
    greedy_both(lm, ref, bat, 4)


def test_eviction_on_one_session_only(model: PreTrainedModel) -> None:
    lm = CachedLM(model, sink_tokens=4, window_tokens=40, evict_chunk=8)
    rng = random.Random(8)
    ref, bat = twins(lm, [rand_ids(rng, n) for n in (6, 42, 15)])
    evictions = [0, 0, 0]
    for _ in range(6):
        ta = [[int(torch.argmax(c.logits))] for c in ref]
        ea, eb = step_both(lm, ref, bat, ta)
        assert ea == eb
        evictions = [x + y for x, y in zip(evictions, eb, strict=True)]
        assert_same(lm, ref, bat, atol=1e-4)
    # only session 1 crossed the window (and its keys were re-rotated); the others were untouched
    assert evictions[1] > 0 and evictions[0] == evictions[2] == 0
    assert [c.evicted for c in bat] == evictions


def test_feed_longer_than_the_window_goes_in_rounds(model: PreTrainedModel) -> None:
    lm = CachedLM(model, sink_tokens=4, window_tokens=40, evict_chunk=8)
    rng = random.Random(9)
    ref, bat = twins(lm, [rand_ids(rng, n) for n in (10, 20)])
    ea, eb = step_both(lm, ref, bat, [rand_ids(rng, 95), rand_ids(rng, 3)])
    assert ea == eb and eb[0] > 0 and eb[1] == 0
    assert_same(lm, ref, bat, atol=1e-4)
    greedy_both(lm, ref, bat, 3)


# -- independence from the rest of the batch ---------------------------------------------------


def test_result_does_not_depend_on_the_other_members(model: PreTrainedModel) -> None:
    """The same session, batched with different companions (other lengths, other tokens, more of
    them), gets the same logits every time."""
    lm = CachedLM(model)
    rng = random.Random(10)
    me = lm.new()
    lm.feed(me, rand_ids(rng, 19))
    tail = rand_ids(rng, 2)
    results = []
    for others in ((3,), (60, 1), (19, 40, 7, 2)):
        mine = lm.fork(me)
        comp = []
        for n in others:
            c = lm.new()
            lm.feed(c, rand_ids(rng, n))
            comp.append(c)
        feeds = [tail] + [rand_ids(rng, rng.randint(1, 5)) for _ in comp]
        res = lm.feed_batch([mine, *comp], feeds)
        results.append(res[0].logits)
    for r in results[1:]:
        torch.testing.assert_close(r, results[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_per_session_quant_is_independent_of_the_batch(arch: str) -> None:
    """On a dynamically int8-quantised model, per_session_quant gives each session its own
    activation scales, so batched decode equals one by one there too."""
    m = quantize_int8_dynamic(tiny_model(arch, seed=22))
    lm = CachedLM(m, sink_tokens=4, window_tokens=40, evict_chunk=8)
    rng = random.Random(11)
    ref, bat = twins(lm, [rand_ids(rng, n) for n in (4, 38, 17)])
    greedy_both(lm, ref, bat, 8, per_session_quant=True)
    assert sum(c.evicted for c in bat) > 0
    # without it the rows share one scale per product: close to the one-by-one numbers, not equal
    toks = [[int(torch.argmax(c.logits))] for c in ref]
    for c, t in zip(ref, toks, strict=True):
        lm.feed(c, t)
    lm.feed_batch(bat, toks)
    scale = max(float(c.logits.abs().max()) for c in ref)
    worst = max(float((a.logits - b.logits).abs().max()) for a, b in zip(ref, bat, strict=True))
    assert worst < 0.25 * scale


# -- fallbacks and errors ----------------------------------------------------------------------


def test_without_the_fast_decoder_it_feeds_one_by_one(model: PreTrainedModel) -> None:
    lm = CachedLM(model, fast=False)
    rng = random.Random(12)
    ref, bat = twins(lm, [rand_ids(rng, n) for n in (5, 21)])
    step_both(lm, ref, bat, [rand_ids(rng, 3), [1]])
    for a, b in zip(ref, bat, strict=True):
        assert torch.equal(a.logits, b.logits)


def test_bad_batches_raise(model: PreTrainedModel) -> None:
    lm = CachedLM(model)
    a, b = lm.new(), lm.new()
    lm.feed(a, [1, 2])
    lm.feed(b, [3])
    for caches, ids in (([a, b], [[1]]), ([a, a], [[1], [2]]), ([a, b], [[1], []])):
        with pytest.raises(ValueError):
            lm.feed_batch(caches, ids)
    assert a.ids == [1, 2] and b.ids == [3]
    assert lm.feed_batch([], []) == []
