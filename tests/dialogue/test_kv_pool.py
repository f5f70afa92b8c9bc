"""Sessions' caches in one KvPool (the GPU's batched decode) == plain DynamicCaches fed one by one.

Every check runs the same conversation through a plain `CachedLM` (DynamicCache per session, the
reference) and a pooled one (`kv_pool_slots`), both over the same tiny seeded float32 model on the CPU,
and compares logits, hidden states, greedy tokens and cache contents: ragged positions, prefill slices of
different lengths, eviction (sinks + window) in one session only, rollback, fork, a full pool handing out
DynamicCaches (mixed batches), and slots coming back when a session's cache is dropped.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

from dialogue.kv_cache import CachedLM, LmCache
from dialogue.kv_pool import KvPool, PooledCache
from tests.dialogue.test_batched_decode import assert_same
from tests.dialogue.test_kv_cache import rand_ids, tiny_model

ATOL = 1e-5  # as test_batched_decode's


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return tiny_model(request.param, seed=5)


def pair(model: PreTrainedModel, slots: int = 8, **kw: int) -> tuple[CachedLM, CachedLM]:
    return CachedLM(model, kv_pool_slots=0, **kw), CachedLM(model, kv_pool_slots=slots, **kw)


def same(a: LmCache, b: LmCache) -> None:
    """The pooled cache `b` holds what the plain cache `a` does (test_batched_decode's check, one pair)."""
    assert_same(None, [a], [b], ATOL)  # type: ignore[arg-type]  (the lm is not used)
    assert b.cache.get_seq_length() == a.cache.get_seq_length()


def test_new_caches_take_slots_and_give_them_back(model: PreTrainedModel) -> None:
    _, lm = pair(model, slots=2)
    assert lm.pool is not None and lm.pool.free_slots == 2
    a, b, c = lm.new(), lm.new(), lm.new()
    assert isinstance(a.cache, PooledCache) and isinstance(b.cache, PooledCache)
    assert isinstance(c.cache, DynamicCache)  # the pool is full: the old kind of cache
    assert lm.nbytes(a) == lm.pool.slot_bytes() > 0
    lm.feed_batch([a, b], [rand_ids(random.Random(1), 9), rand_ids(random.Random(2), 5)])
    fork = lm.fork(b)  # the pool is full: a DynamicCache
    gc.collect()
    gc.disable()
    try:
        # dropped by reference counting alone, as a session's ending drops it: no cycle keeps the slot
        # taken until the collector's next full pass (minutes in a server with the models loaded)
        del a
        assert lm.pool.free_slots == 1 and isinstance(lm.new().cache, PooledCache)
        del fork
    finally:
        gc.enable()


def test_no_pool_on_the_cpu_by_default(model: PreTrainedModel) -> None:
    assert CachedLM(model).pool is None and CachedLM(model, fast=False, kv_pool_slots=4).pool is None


def test_one_session_feed_equals_the_plain_cache(model: PreTrainedModel) -> None:
    ref_lm, lm = pair(model, sink_tokens=2, window_tokens=40, evict_chunk=8)
    rng = random.Random(1)
    a, b = ref_lm.new(), lm.new()
    for size in (17, 1, 6, 30, 2, 11, 1, 1):  # evicts on the way (window 40)
        ids = rand_ids(rng, size)
        ra, rb = ref_lm.feed(a, ids), lm.feed(b, ids)
        assert ra.evicted == rb.evicted
        same(a, b)
    assert b.evicted > 0
    ref_lm.rollback(a, 20)
    lm.rollback(b, 20)
    ids = rand_ids(rng, 5)
    ref_lm.feed(a, ids)
    lm.feed(b, ids)
    same(a, b)


def test_batched_steps_equal_one_by_one_with_eviction_and_rollback(model: PreTrainedModel) -> None:
    """Ragged sessions, prefill slices of different lengths, then greedy decode; one session evicts (its
    window fills first) and one rolls back in between."""
    ref_lm, lm = pair(model, sink_tokens=2, window_tokens=48, evict_chunk=8)
    rng = random.Random(2)
    ref = [ref_lm.new() for _ in range(4)]
    bat = [lm.new() for _ in range(4)]
    assert all(isinstance(c.cache, PooledCache) for c in bat)
    for sizes in ((3, 17, 40, 9), (5, 1, 2, 12)):
        feeds = [rand_ids(rng, n) for n in sizes]
        for c, f in zip(ref, feeds, strict=True):
            ref_lm.feed(c, f)
        lm.feed_batch(bat, feeds)
        for a, b in zip(ref, bat, strict=True):
            same(a, b)
    for step in range(12):
        if step == 5:
            ref_lm.rollback(ref[1], 10)
            lm.rollback(bat[1], 10)
            ref_lm.feed(ref[1], [7])
            lm.feed(bat[1], [7])
        picks = [[int(torch.argmax(c.logits))] for c in ref]
        assert picks == [[int(torch.argmax(c.logits))] for c in bat]
        for c, p in zip(ref, picks, strict=True):
            ref_lm.feed(c, p)
        lm.feed_batch(bat, picks)
        for a, b in zip(ref, bat, strict=True):
            same(a, b)
    assert bat[2].evicted > 0 and bat[0].evicted == 0  # eviction in one session only
    assert len({len(c.ids) for c in bat}) == 4


def test_fork_takes_its_own_slot(model: PreTrainedModel) -> None:
    ref_lm, lm = pair(model)
    rng = random.Random(3)
    prompt = rand_ids(rng, 12)
    a, b = ref_lm.new(), lm.new()
    ref_lm.feed(a, prompt)
    lm.feed(b, prompt)
    a2, b2 = ref_lm.fork(a), lm.fork(b)
    assert isinstance(b2.cache, PooledCache) and b2.cache.slot != b.cache.slot
    ref_lm.feed(a2, [1, 2, 3])
    lm.feed(b2, [1, 2, 3])
    same(a2, b2)
    same(a, b)  # the original did not move


def test_a_mixed_batch_runs_the_plain_way(model: PreTrainedModel) -> None:
    """With the pool full, new sessions get DynamicCaches; a batch of both kinds still equals one by one."""
    ref_lm, lm = pair(model, slots=2)
    rng = random.Random(4)
    ref = [ref_lm.new() for _ in range(3)]
    bat = [lm.new() for _ in range(3)]
    assert [type(c.cache) for c in bat] == [PooledCache, PooledCache, DynamicCache]
    feeds = [rand_ids(rng, n) for n in (4, 9, 2)]
    for c, f in zip(ref, feeds, strict=True):
        ref_lm.feed(c, f)
    lm.feed_batch(bat, feeds)
    for _ in range(3):
        picks = [[int(torch.argmax(c.logits))] for c in ref]
        for c, p in zip(ref, picks, strict=True):
            ref_lm.feed(c, p)
        lm.feed_batch(bat, picks)
    for a, b in zip(ref, bat, strict=True):
        same(a, b)


def test_pool_refuses_bad_sizes_and_overflow() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        KvPool(0, 2, 2, 8, 4, torch.float32, "cpu")
    pool = KvPool(1, 2, 2, 8, 4, torch.float32, "cpu")
    c = pool.new_cache()
    assert c is not None and pool.new_cache() is None
    with pytest.raises(RuntimeError, match="capacity"):
        c.advance(9)
