"""FastDecoder (dialogue/fast_decoder.py): the lean forward equals the transformers forward.

Tiny seeded Llama and Qwen2 decoders (tests/dialogue/test_kv_cache.py's), in float32, bfloat16 and the
service's SmoothQuant int8; the fused int8 products must be bit-identical to the separate ones,
and the model's own forward must still give the same numbers after fusing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

from dialogue.fast_decoder import FastDecoder, FusedPart, unsupported_reason
from dialogue.kv_cache import CachedLM
from dialogue.llm_weights import quantize_int8_dynamic
from tests.dialogue.test_kv_cache import VOCAB, tiny_model


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def hf_hidden(model: PreTrainedModel, cache: DynamicCache, ids: list[int], start: int) -> torch.Tensor:
    pos = torch.arange(start, start + len(ids))
    out = model.model(
        input_ids=torch.tensor([ids]),
        past_key_values=cache,
        use_cache=True,
        cache_position=pos,
        position_ids=pos[None],
    )
    return out.last_hidden_state


def variant(arch: str, dtype: str) -> PreTrainedModel:
    m = tiny_model(arch, seed=3, layers=3)
    if dtype == "bfloat16":
        return m.to(torch.bfloat16)
    if dtype == "int8-dynamic":
        return quantize_int8_dynamic(m)
    return m


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8-dynamic"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fast_forward_equals_the_transformers_forward(arch: str, dtype: str) -> None:
    ref = variant(arch, dtype)
    fast_model = copy.deepcopy(ref)
    dec = FastDecoder(fast_model)
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (17, 1, 1, 5, 1, 9, 1)]
    c_ref, c_fast = DynamicCache(config=ref.config), DynamicCache(config=ref.config)
    start = 0
    with torch.inference_mode():
        for ids in chunks:  # a prefill, decode steps and more prefills after them, as a session does
            a = hf_hidden(ref, c_ref, ids, start)
            b = dec.forward(c_fast, ids, start)
            assert torch.equal(a, b), (arch, dtype, len(ids), (a.float() - b.float()).abs().max())
            start += len(ids)
        for la, lb in zip(c_ref.layers, c_fast.layers, strict=True):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_int8_products_keep_the_model_forward_exact(arch: str) -> None:
    m = variant(arch, "int8-dynamic")
    ids = list(range(3, 40))
    with torch.inference_mode():
        before = hf_hidden(m, DynamicCache(config=m.config), ids, 0)
        FastDecoder.for_model(m)
        layer = m.model.layers[0]
        assert isinstance(layer.self_attn.q_proj, FusedPart) and isinstance(layer.mlp.up_proj, FusedPart)
        assert layer.self_attn.q_proj.fused is layer.self_attn.v_proj.fused  # held once
        after = hf_hidden(m, DynamicCache(config=m.config), ids, 0)
    assert torch.equal(before, after)
    # a second decoder over the same model reuses the fused layers (no second copy, no error)
    assert FastDecoder.for_model(m) is FastDecoder.for_model(m)
    again = FastDecoder(m)
    with torch.inference_mode():
        assert torch.equal(again.forward(DynamicCache(config=m.config), ids, 0), before)


def test_cached_lm_uses_it_and_can_do_without() -> None:
    m = tiny_model("qwen2", seed=5)
    fast, plain = (
        CachedLM(m, sink_tokens=2, window_tokens=64),
        CachedLM(m, sink_tokens=2, window_tokens=64, fast=False),
    )
    assert fast.fast is not None and plain.fast is None
    a, b = fast.new(), plain.new()
    for ids in ([5, 6, 7, 8, 9], [10], [11, 12]):
        ra, rb = fast.feed(a, ids), plain.feed(b, ids)
        assert torch.equal(ra.logits, rb.logits) and torch.equal(ra.hidden, rb.hidden)


def test_unsupported_models_are_named() -> None:
    m = tiny_model("llama")
    assert unsupported_reason(m) is None
    odd = copy.deepcopy(m)
    odd.config.hidden_act = "gelu"
    assert "hidden_act" in unsupported_reason(odd)
    assert FastDecoder.for_model(odd) is None
    with pytest.raises(ValueError, match="unsupported"):
        FastDecoder(odd)


def test_a_copied_or_edited_model_gets_its_own_decoder() -> None:
    m = tiny_model("llama", seed=9)
    dec = FastDecoder.for_model(m)
    ids = list(range(5, 20))
    twin = copy.deepcopy(m)  # the kept decoder is copied along, but reads the original's weights
    with torch.no_grad():
        twin.model.layers[0].mlp.up_proj.weight.mul_(3.0)
    assert FastDecoder.for_model(twin) is not dec
    m.model.layers[1].self_attn.o_proj = torch.nn.Linear(64, 64, bias=False)  # replaced after it was built
    assert FastDecoder.for_model(m) is not dec
    with torch.inference_mode():
        for model in (twin, m):
            want = hf_hidden(model, DynamicCache(config=model.config), ids, 0)
            got = FastDecoder.for_model(model).forward(DynamicCache(config=model.config), ids, 0)
            assert torch.equal(want, got)


def _int8_linear(seed: int, bias: bool = True) -> torch.nn.Module:
    from torch.ao.nn.quantized.dynamic import Linear as DynLinear

    torch.manual_seed(seed)
    lin = torch.nn.Linear(64, 48, bias=bias)
    return DynLinear.from_float(_with_qconfig(lin))


def _with_qconfig(lin: torch.nn.Linear) -> torch.nn.Linear:
    from torch.ao.quantization import per_channel_dynamic_qconfig

    lin.qconfig = per_channel_dynamic_qconfig
    return lin


@pytest.mark.parametrize("bias", [True, False])
def test_per_token_scales_round_each_row_on_its_own_range(bias: bool) -> None:
    """A token with large values no longer coarsens the other tokens' rounding in a multi-token feed."""
    from dialogue.fast_decoder import _linear_fn

    mod = _int8_linear(4, bias)
    w, b = torch.ops.quantized.linear_unpack(mod._packed_params._packed_params)
    exact = lambda x: torch.nn.functional.linear(x, w.dequantize(), b)  # noqa: E731
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(8, 64, generator=g)
    loud = 60 * torch.randn(1, 64, generator=g)  # a token with outlying activations in the same feed
    with_loud = torch.cat([rows, loud])
    per_tensor, per_token = _linear_fn(mod, "tensor"), _linear_fn(mod, "token")
    with torch.inference_mode():
        # per token: the quiet rows come out the same with or without the loud one beside them
        assert torch.allclose(per_token(with_loud)[:8], per_token(rows), atol=1e-5)
        # and nearer the float product than the shared scale leaves them
        err_token = (per_token(with_loud)[:8] - exact(rows)).abs().mean()
        err_tensor = (per_tensor(with_loud)[:8] - exact(rows)).abs().mean()
        assert err_token < err_tensor / 5, (err_token, err_tensor)
        # one row (a decode step) is scaled on its own range either way: the very same numbers
        assert torch.equal(per_token(rows[:1]), per_tensor(rows[:1]))
    with pytest.raises(ValueError, match="act_scale"):
        _linear_fn(mod, "channel")


def test_per_token_decoder_decodes_as_the_shipped_one_and_is_kept_per_scale() -> None:
    m = variant("qwen2", "int8-dynamic")
    tensor = FastDecoder.for_model(m)
    token = FastDecoder.for_model(m, "token")
    assert token is not tensor and token.act_scale == "token"
    assert FastDecoder.for_model(m, "token") is token  # kept while asked for with the same scale
    c_a, c_b = DynamicCache(config=m.config), DynamicCache(config=m.config)
    ids = list(range(3, 12))
    with torch.inference_mode():
        for i, t in enumerate(ids):  # one token at a time: one row per product, the same arithmetic
            assert torch.equal(tensor.forward(c_a, [t], i), token.forward(c_b, [t], i))
        feed = token.forward(DynamicCache(config=m.config), ids, 0)
    assert feed.shape == (1, len(ids), m.config.hidden_size) and torch.isfinite(feed).all()
    with pytest.raises(ValueError, match="act_scale"):
        FastDecoder(m, "row")
