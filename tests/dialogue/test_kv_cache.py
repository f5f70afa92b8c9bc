"""CachedLM (dialogue/kv_cache.py): continuation, rollback, sinks + rolling window, fork.

Every check compares the cache against the ground truth it claims to equal: one fresh prefill of
the ids the cache holds, at positions 0..len-1. The models are tiny seeded Llama and Qwen2
decoders built from config (no downloads). Random init leaves attention almost uniform, and then
RoPE positions barely matter and a wrong re-rotation could pass unnoticed; the query/key
projections are therefore scaled up so attention is sharp and position-dependent (checked by
`test_rerotation_is_what_keeps_logits_exact`), and lm_head is scaled so greedy choices are not
near-ties.

What eviction can promise: a kept token's keys/values in layers >= 1 were computed while it
attended to tokens that are now evicted, so with two or more layers the rolled cache is *not* the
cache of a fresh prefill of the kept ids (that is StreamingLLM by design, not float error). What
is exact is the first layer, whose keys/values depend only on (token, position): the re-rotated
layer-0 keys must equal a fresh prefill's. A one-layer model therefore has to reproduce the fresh
prefill's logits exactly, and the tests check both.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from dialogue.kv_cache import CachedLM, FeedResult, LmCache
from dialogue.llm_weights import quantize_int8_dynamic

VOCAB = 128


def tiny_model(arch: str, seed: int = 0, rope: dict | None = None, layers: int = 2) -> PreTrainedModel:
    """A seeded GQA decoder; `rope` overrides rope_parameters (theta, scaling type)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_parameters=rope or {"rope_type": "default", "rope_theta": 100000.0})
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, rope_parameters=rope or {"rope_type": "default", "rope_theta": 1000000.0})
        model = Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    model.eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
        model.lm_head.weight.mul_(5.0)
    return model


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return tiny_model(request.param)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def shallow(request: pytest.FixtureRequest) -> PreTrainedModel:
    """One layer: its cache after evictions must equal a fresh prefill's, logits included."""
    return tiny_model(request.param, seed=11, layers=1)


def prefill_logits(model: PreTrainedModel, ids: Sequence[int]) -> torch.Tensor:
    """Ground truth: float32 next-token logits at every position of one fresh prefill at 0..n-1."""
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([list(ids)]), position_ids=torch.arange(len(ids))[None], use_cache=False
        )
    return out.logits[0].float()


def prefill_hidden(model: PreTrainedModel, ids: Sequence[int]) -> torch.Tensor:
    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([list(ids)]), use_cache=False)
    return out.last_hidden_state[0, -1].float()


def greedy(
    lm: CachedLM, c: LmCache, n: int, log: list[tuple[int, int, torch.Tensor]] | None = None
) -> list[int]:
    """Decode n tokens, feeding each back; log (index in ids, token, logits it was chosen from)."""
    out = []
    for _ in range(n):
        assert c.logits is not None
        tok = int(torch.argmax(c.logits))
        if log is not None:
            log.append((len(c.ids), tok, c.logits.clone()))
        lm.feed(c, [tok])
        out.append(tok)
    return out


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# -- 1. continuation == re-prefill --------------------------------------------------------------


def test_incremental_conversation_equals_one_prefill(model: PreTrainedModel) -> None:
    lm = CachedLM(model)  # default window 2048: nothing is evicted here
    rng = random.Random(1)
    c = lm.new()
    log: list[tuple[int, int, torch.Tensor]] = []
    for size in (17, 1, 6, 30, 2, 11):
        res = lm.feed(c, rand_ids(rng, size))
        assert isinstance(res, FeedResult) and res.evicted == 0
        greedy(lm, c, 3, log)
    assert c.evicted == 0 and c.cache.get_seq_length() == len(c.ids) == 67 + 18

    ref = prefill_logits(model, c.ids)
    for idx, tok, logits in log:
        # the token at ids[idx] was chosen from the logits after ids[idx - 1]
        assert int(torch.argmax(ref[idx - 1])) == tok == c.ids[idx]
        torch.testing.assert_close(logits, ref[idx - 1], atol=1e-5, rtol=0)
    assert c.logits is not None and c.hidden is not None
    torch.testing.assert_close(c.logits, ref[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(c.hidden, prefill_hidden(model, c.ids), atol=1e-5, rtol=0)
    assert c.logits.dtype == c.hidden.dtype == torch.float32
    assert c.logits.shape == (VOCAB,) and c.hidden.shape == (model.config.hidden_size,)


# -- 2. rollback and sync -----------------------------------------------------------------------


def test_rollback_restores_exact_logits(model: PreTrainedModel) -> None:
    lm = CachedLM(model)
    rng = random.Random(2)
    a, b = rand_ids(rng, 23), rand_ids(rng, 9)
    c = lm.new()
    lm.feed(c, a)
    first = lm.feed(c, b)
    logits, hidden = first.logits.clone(), first.hidden.clone()
    bytes_ab = lm.nbytes(c)

    lm.rollback(c, len(a))
    assert c.ids == a and c.cache.get_seq_length() == len(a)
    assert c.logits is None and c.hidden is None
    assert lm.nbytes(c) < bytes_ab

    again = lm.feed(c, b)
    assert torch.equal(again.logits, logits) and torch.equal(again.hidden, hidden)
    assert lm.nbytes(c) == bytes_ab


def test_sync_refeeds_only_the_changed_tail(model: PreTrainedModel) -> None:
    lm = CachedLM(model)
    rng = random.Random(3)
    history = rand_ids(rng, 40)
    c = lm.new()
    lm.feed(c, history)

    # a barge-in rewrites the last 3 tokens and the conversation goes on with 5 new ones
    target = history[:-3] + [(t + 1) % VOCAB for t in history[-3:]] + rand_ids(rng, 5)
    assert lm.sync(c, target) == 8
    assert c.ids == target
    assert c.logits is not None and c.hidden is not None
    torch.testing.assert_close(c.logits, prefill_logits(model, target)[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(c.hidden, prefill_hidden(model, target), atol=1e-5, rtol=0)

    # already in sync with fresh logits: nothing runs
    before = c.logits
    assert lm.sync(c, target) == 0 and c.logits is before
    # a strict prefix keeps one token to re-feed, so the logits are those after target[:20][-1]
    assert lm.sync(c, target[:20]) == 1
    assert c.ids == target[:20]
    torch.testing.assert_close(c.logits, prefill_logits(model, target[:20])[-1], atol=1e-5, rtol=0)
    # after a rollback the logits are stale, so even an identical target re-feeds its last token
    lm.rollback(c, 20)
    assert lm.sync(c, target[:20]) == 1 and c.logits is not None
    # nothing in common: everything is fed
    other = [(t + 7) % VOCAB for t in target[:12]]
    assert lm.sync(c, other) == 12 and c.ids == other


# -- 3. sinks + rolling window --------------------------------------------------------------------


def prefill_kv(model: PreTrainedModel, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer-0 keys and values of one fresh prefill of `ids` at positions 0..n-1."""
    cache = CachedLM(model).new().cache
    with torch.inference_mode():
        model.model(input_ids=torch.tensor([list(ids)]), past_key_values=cache, use_cache=True)
    return cache.layers[0].keys, cache.layers[0].values


def assert_matches_prefill(model: PreTrainedModel, c: LmCache, atol: float) -> None:
    """Layer 0 always equals a fresh prefill of the kept ids; with one layer, the logits do too."""
    keys, values = prefill_kv(model, c.ids)
    torch.testing.assert_close(c.cache.layers[0].keys, keys, atol=atol, rtol=0)
    torch.testing.assert_close(c.cache.layers[0].values, values, atol=atol, rtol=0)
    if model.config.num_hidden_layers == 1:
        torch.testing.assert_close(c.logits, prefill_logits(model, c.ids)[-1], atol=atol, rtol=0)
        torch.testing.assert_close(c.hidden, prefill_hidden(model, c.ids), atol=atol, rtol=0)


def run_turns(
    lm: CachedLM, model: PreTrainedModel, turns: int, seed: int, check_every: int, atol: float
) -> tuple[LmCache, list[int], list[int]]:
    """Feed `turns` user turns of 5-12 tokens, each followed by a greedy token fed with the next turn
    (and a 3-token greedy reply every 50 turns); check invariants, and against a re-prefill every
    `check_every` turns. Returns the cache, every token fed and nbytes after each turn."""
    rng = random.Random(seed)
    c = lm.new()
    fed: list[int] = []
    sizes: list[int] = []
    cap = lm.sink_tokens + lm.window_tokens
    reply: list[int] = []
    for turn in range(turns):
        ids = reply + rand_ids(rng, rng.randint(5, 12))
        evicted_before = c.evicted
        res = lm.feed(c, ids)
        fed += ids
        assert res.evicted == c.evicted - evicted_before and res.evicted % lm.evict_chunk == 0
        assert len(c.ids) <= cap and c.cache.get_seq_length() == len(c.ids)
        assert bool(torch.isfinite(res.logits).all()) and bool(torch.isfinite(res.hidden).all())
        reply = [int(torch.argmax(res.logits))]
        if turn % 50 == 49:
            fed += greedy(lm, c, 3)  # starts with the token in `reply`
            reply = []
            assert bool(torch.isfinite(c.logits).all())
        sizes.append(lm.nbytes(c))
        # bookkeeping: every token fed is either kept or counted as evicted, and the kept ones are
        # the sinks plus the most recent tokens
        assert len(c.ids) + c.evicted == len(fed)
        assert c.ids[: lm.sink_tokens] == fed[: lm.sink_tokens]
        assert c.ids[lm.sink_tokens :] == fed[len(fed) - len(c.ids) + lm.sink_tokens :]
        if turn % check_every == check_every - 1:
            assert_matches_prefill(model, c, atol)
    return c, fed, sizes


def test_sink_window_memory_is_flat_over_thousands_of_turns(model: PreTrainedModel) -> None:
    lm = CachedLM(model, sink_tokens=8, window_tokens=96, evict_chunk=16)
    c, fed, sizes = run_turns(lm, model, turns=3000, seed=4, check_every=500, atol=1e-4)

    assert len(fed) > 25_000 and c.evicted > 25_000
    assert c.ids[:8] == fed[:8]  # the sinks survive every eviction
    # flat: the cache reached its ceiling within the first 100 turns and never grew past it
    assert max(sizes) == max(sizes[:100])
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert max(sizes) <= 2 * layers * kv_heads * head_dim * (8 + 96) * 4  # keys+values, float32
    # re-rotation: layer 0 of the rolled cache equals a fresh prefill of the kept ids at 0..len-1
    assert_matches_prefill(model, c, atol=1e-4)


def test_rolled_cache_equals_prefill_of_kept_ids(shallow: PreTrainedModel) -> None:
    """With one layer nothing depends on evicted context, so the logits after hundreds of
    evictions (each window key re-rotated several times) equal a fresh prefill of `ids`."""
    lm = CachedLM(shallow, sink_tokens=8, window_tokens=96, evict_chunk=16)
    c, fed, _ = run_turns(lm, shallow, turns=400, seed=12, check_every=40, atol=1e-4)
    assert c.evicted > 3000 and c.ids[:8] == fed[:8]


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_rerotation_honours_rope_scaling(rope: dict) -> None:
    """The shift comes from the model's own rotary_emb, so scaled RoPE (and YaRN's attention
    scaling, which must not be applied twice) stays exact."""
    model = tiny_model("llama", seed=5, rope=rope, layers=1)
    if rope["rope_type"] == "yarn":
        assert model.model.rotary_emb.attention_scaling != 1.0
    lm = CachedLM(model, sink_tokens=4, window_tokens=40, evict_chunk=8)
    c, _, _ = run_turns(lm, model, turns=60, seed=6, check_every=20, atol=1e-4)
    assert c.evicted > 300


def test_rerotation_is_what_keeps_logits_exact(
    shallow: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: without the -k rotation the same run drifts far from the re-prefill, so
    the exactness checks above do test the rotation (the model is position-sensitive)."""
    lm = CachedLM(shallow, sink_tokens=8, window_tokens=96, evict_chunk=16)
    monkeypatch.setattr(CachedLM, "_rotate", staticmethod(lambda keys, cos, sin: keys))
    c, _, _ = run_turns(lm, shallow, turns=40, seed=7, check_every=10**9, atol=0)
    assert c.evicted > 0
    drift = (c.logits - prefill_logits(shallow, c.ids)[-1]).abs().max().item()
    assert drift > 1e-2
    with pytest.raises(AssertionError):
        assert_matches_prefill(shallow, c, atol=1e-4)


def test_feed_longer_than_the_window_goes_in_pieces(model: PreTrainedModel) -> None:
    lm = CachedLM(model, sink_tokens=8, window_tokens=96, evict_chunk=16)
    rng = random.Random(8)
    seq = rand_ids(rng, 250)
    c = lm.new()
    res = lm.feed(c, seq)
    n = len(c.ids)
    assert n <= 104 and res.evicted == c.evicted == 250 - n
    assert c.ids == seq[:8] + seq[250 - (n - 8) :]
    assert bool(torch.isfinite(res.logits).all())
    assert_matches_prefill(model, c, atol=1e-4)
    # the cache keeps working as a normal one afterwards
    lm.feed(c, rand_ids(rng, 5))
    assert len(c.ids) <= 104 and c.cache.get_seq_length() == len(c.ids)


def test_picks_for_the_last_tokens_are_the_tail_of_every_pick(model: PreTrainedModel) -> None:
    """`feed(picks_last=k)` gives the greedy pick after each of the last k fed tokens (the lm_head runs
    on those only), across window pieces too."""
    rng = random.Random(10)
    prompt, tail = rand_ids(rng, 12), rand_ids(rng, 120)
    for window in (4000, 48):
        lm = CachedLM(model, sink_tokens=8, window_tokens=window, evict_chunk=16)
        every, last = lm.new(), lm.new()
        lm.feed(every, prompt)
        lm.feed(last, prompt)
        picks = lm.feed(every, tail, greedy=True).greedy
        assert picks is not None and len(picks) == len(tail)
        for k in (1, 5, 60):
            c = lm.fork(last)
            assert lm.feed(c, tail, picks_last=k).greedy == picks[-k:]


def test_sink_prompt_longer_than_window_is_kept(shallow: PreTrainedModel) -> None:
    """A system prompt used as sinks may be longer than the window; it must never be evicted."""
    lm = CachedLM(shallow, sink_tokens=30, window_tokens=16, evict_chunk=4)
    rng = random.Random(9)
    prompt = rand_ids(rng, 30)
    c = lm.new()
    lm.feed(c, prompt)
    for _ in range(20):
        lm.feed(c, rand_ids(rng, 7))
        assert c.ids[:30] == prompt and len(c.ids) <= 46
    assert c.evicted > 0
    assert_matches_prefill(shallow, c, atol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8-dynamic"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_low_precision_models(arch: str, dtype: str) -> None:
    """The service runs bfloat16 or dynamically int8-quantized models (quantized Linear modules have
    no `.weight`): eviction, rollback and sync must work there too, returning float32 results."""
    model = tiny_model(arch, seed=13)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    else:
        model = quantize_int8_dynamic(model)
    lm = CachedLM(model, sink_tokens=4, window_tokens=40, evict_chunk=8)
    c, _, _ = run_turns(lm, model, turns=80, seed=14, check_every=10**9, atol=0)
    assert c.evicted > 400 and c.logits.dtype == c.hidden.dtype == torch.float32
    if dtype == "bfloat16":
        # the shift is computed in float32 and rounded once: layer 0 stays within bf16 rounding
        keys, values = prefill_kv(model, c.ids)
        scale = keys.abs().max().item()
        torch.testing.assert_close(c.cache.layers[0].keys, keys, atol=0.02 * scale, rtol=0)
        # values carry no position; the tolerance only absorbs kernel-dependent bf16 rounding
        torch.testing.assert_close(
            c.cache.layers[0].values, values, atol=0.01 * values.abs().max().item(), rtol=0
        )
    n = len(c.ids)
    tail = c.ids[-5:]
    first = lm.feed(c, [1, 2, 3])
    logits = first.logits.clone()
    lm.rollback(c, n)
    assert torch.equal(lm.feed(c, [1, 2, 3]).logits, logits)
    assert lm.sync(c, c.ids[:n] + [1, 2, 4]) == 1 and c.ids[-3:] == [1, 2, 4] and c.ids[n - 5 : n] == tail


# -- 4. fork and argument errors -----------------------------------------------------------------


def _snapshot(c: LmCache) -> list[torch.Tensor]:
    return [t.clone() for layer in c.cache.layers for t in (layer.keys, layer.values)]


def test_fork_is_independent(model: PreTrainedModel) -> None:
    lm = CachedLM(model, sink_tokens=4, window_tokens=32, evict_chunk=8)
    rng = random.Random(10)
    base = lm.new()
    lm.feed(base, rand_ids(rng, 20))
    ids, logits, kv, size = list(base.ids), base.logits.clone(), _snapshot(base), lm.nbytes(base)

    f = lm.fork(base)
    more = rand_ids(rng, 30)  # enough to evict and re-rotate in the fork
    res = lm.feed(f, more)
    assert res.evicted > 0 and f.evicted == res.evicted
    lm.rollback(f, 10)

    assert base.ids == ids and base.evicted == 0 and lm.nbytes(base) == size
    assert torch.equal(base.logits, logits)
    assert all(torch.equal(a, b) for a, b in zip(kv, _snapshot(base), strict=True))
    # the original still continues exactly like a second fork would
    g = lm.fork(base)
    assert torch.equal(lm.feed(base, more).logits, lm.feed(g, more).logits)


@pytest.mark.parametrize(
    "call",
    [
        lambda lm, c: lm.rollback(c, -1),
        lambda lm, c: lm.rollback(c, len(c.ids) + 1),
        lambda lm, c: lm.sync(c, []),
        lambda lm, c: lm.feed(c, []),
    ],
    ids=["rollback-negative", "rollback-too-long", "sync-empty", "feed-empty"],
)
def test_bad_arguments_raise(model: PreTrainedModel, call: Callable[[CachedLM, LmCache], object]) -> None:
    lm = CachedLM(model)
    c = lm.new()
    lm.feed(c, [1, 2, 3])
    with pytest.raises(ValueError):
        call(lm, c)
    assert c.ids == [1, 2, 3] and c.cache.get_seq_length() == 3
    lm.rollback(c, 3)  # the bounds themselves are fine
    lm.rollback(c, 0)
    assert c.ids == [] and c.cache.get_seq_length() == 0 and lm.nbytes(c) == 0


def test_bad_construction_raises(model: PreTrainedModel) -> None:
    for kwargs in ({"window_tokens": 0}, {"evict_chunk": 0}, {"sink_tokens": -1}):
        with pytest.raises(ValueError):
            CachedLM(model, **kwargs)


@pytest.mark.parametrize("fast", [True, False])
def test_feed_greedy_picks_are_the_argmax_after_every_token(model: PreTrainedModel, fast: bool) -> None:
    """What a speculative check compares a draft with: the same picks as a fresh prefill's, and
    the last one is the argmax of the cache's next-token logits."""
    rng = random.Random(3)
    prompt, draft = rand_ids(rng, 9), rand_ids(rng, 5)
    lm = CachedLM(model, sink_tokens=2, window_tokens=64, fast=fast)
    c = lm.new()
    lm.feed(c, prompt)
    res = lm.feed(c, draft, greedy=True)
    truth = prefill_logits(model, prompt + draft)[len(prompt) :].argmax(-1).tolist()
    assert res.greedy == truth
    assert res.greedy[-1] == int(torch.argmax(c.logits))
    assert lm.feed(c, [1]).greedy is None  # off by default
