"""The dialogue engine's conversations in session KV caches, with tiny seeded models.

A tiny ChatML tokenizer is trained here (byte-level BPE) and tiny random Llama/Qwen2 models are
built from configs, so nothing is downloaded. They prove: the conversation continued through the
session cache equals a full re-prefill; slice-by-slice listening with revised partials rolls back
exactly; an answer cut at a barge-in is rolled back to the heard words; sinks + window keep a
session's memory flat over thousands of turns; the relay commits or discards a draft.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from dialogue.conversation import ChatRenderer, Conversations, pieces_for
from dialogue.engine import DialogueStage, DrafterOptions, SlowOptions
from dialogue.kv_cache import CachedLM
from dialogue.verifier import prefix_ends_word
from duplex.base.config import ConfigError
from duplex.base.messages import ListenStep, OverlapStep, RespondStep

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "what is the capital of france",
    "the capital of france is paris",
    "tell me a story please",
    "once upon a time there was a cat",
    "how are you today",
    "i am fine thanks",
    "stop what is two plus two",
    "two plus two is four",
    "you are a friendly voice assistant on a phone call",
] * 20
SYSTEM = "You are a friendly voice assistant on a phone call."


@pytest.fixture(autouse=True)
def one_thread():
    # tiny models: thread hand-offs cost more than the matmuls
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    return fast


def tiny(arch: str, vocab: int, seed: int):
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(LlamaConfig(**kw)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**kw))
    return model.eval()


def fresh_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_conversation_through_the_cache_equals_a_full_reprefill(tokenizer, arch):
    model = tiny(arch, len(tokenizer), 0)
    r = ChatRenderer(tokenizer, SYSTEM)
    conv = Conversations(CachedLM(model, sink_tokens=len(r.system_ids), window_tokens=4000), r)
    track = conv.new_track()
    history: list[dict[str, str]] = []
    for user, bot in [
        ("what is the capital of france", "the capital of france is paris"),
        ("tell me a story", "once upon a time there was a cat"),
        ("how are you", "i am fine"),
    ]:
        # the user's words arrive slice by slice, with one revision, then the turn ends
        words = user.split()
        for k in range(1, len(words) + 1):
            conv.sync(track, pieces_for(r, history, open_user=" ".join(words[:k])))
        conv.sync(track, pieces_for(r, history, open_user=user + " x"))  # a partial the ASR revised
        fed = conv.sync(track, pieces_for(r, history + [{"role": "user", "content": user}], answer_prefix=""))
        assert (
            fed <= len(r.encode(" x<|im_end|>\n<|im_start|>assistant\n")) + 1
        )  # little left at the end of turn
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": bot}]
        conv.sync(track, pieces_for(r, history))
        ids = r.system_ids + [i for p in pieces_for(r, history) for i in p.ids]
        assert track.cache.ids == ids
        torch.testing.assert_close(track.cache.logits, fresh_logits(model, ids), atol=1e-5, rtol=1e-5)


def test_rollback_of_a_revised_partial_restores_exact_logits(tokenizer):
    model = tiny("llama", len(tokenizer), 1)
    r = ChatRenderer(tokenizer, SYSTEM)
    conv = Conversations(CachedLM(model, sink_tokens=len(r.system_ids), window_tokens=4000), r)
    track = conv.new_track()
    conv.sync(track, pieces_for(r, [], open_user="what is the capital"))
    before = track.cache.logits.clone()
    conv.sync(track, pieces_for(r, [], open_user="what is the capital of spain"))
    fed = conv.sync(track, pieces_for(r, [], open_user="what is the capital"))
    assert fed == 0  # the slice boundary was a checkpoint: nothing is re-run
    assert torch.equal(track.cache.logits, before)
    # a rollback to a position that was never a slice boundary re-runs only the last kept token
    fed = conv.sync(track, pieces_for(r, [], open_user="what is the cap"))
    assert fed <= 2
    ids = r.system_ids + r.message_ids("user", "what is the cap", complete=False)
    torch.testing.assert_close(track.cache.logits, fresh_logits(model, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sync_checked_is_sync_then_append_checked_in_one_forward(tokenizer, arch):
    """The exact relay's check: the end of the user's message, the answer's header and the draft go in
    one forward, and the picks after the header and after each drafted token are those of a sync followed
    by `append_checked`; the caches hold the same tokens and give the same logits."""
    model = tiny(arch, len(tokenizer), 6)
    r = ChatRenderer(tokenizer, SYSTEM)
    draft = "the capital is"
    msgs = [{"role": "user", "content": "what is the capital of france"}]
    drafted = r.answer_ids(draft)[len(r.answer_ids("")) :]
    tracks = []
    for merged in (False, True):
        conv = Conversations(CachedLM(model, sink_tokens=len(r.system_ids), window_tokens=4000), r)
        track = conv.new_track()
        conv.sync(track, pieces_for(r, [], open_user="what is the capital of"))  # heard while they talked
        if merged:
            got = conv.sync_checked(track, pieces_for(r, msgs, answer_prefix=draft), len(drafted))
            assert got is not None
            fed, picks = got
            assert fed == len(r.encode(" france<|im_end|>\n<|im_start|>assistant\n")) + len(drafted)
        else:
            conv.sync(track, pieces_for(r, msgs, answer_prefix=""))
            picks = [int(torch.argmax(track.cache.logits))] + conv.append_checked(track, drafted)
        tracks.append((conv, track, picks))
    (_, one, want), (conv, merged_track, got) = tracks
    assert got == want and len(got) == len(drafted) + 1
    assert merged_track.cache.ids == one.cache.ids
    torch.testing.assert_close(merged_track.cache.logits, one.cache.logits, atol=1e-5, rtol=1e-5)
    # the draft's rejected tail goes back, and no checkpoint past the end survives to be restored later
    conv.take_back(merged_track, 2)
    assert all(cp[0] <= len(merged_track.cache.ids) for cp in merged_track.checkpoints)
    conv.append(merged_track, drafted[-2:])
    torch.testing.assert_close(merged_track.cache.logits, one.cache.logits, atol=1e-5, rtol=1e-5)


def test_sync_checked_leaves_a_draft_already_held_to_the_caller(tokenizer):
    """Nothing new to feed (the draft is in the cache already): no picks, and the track holds the target."""
    model = tiny("llama", len(tokenizer), 7)
    r = ChatRenderer(tokenizer, SYSTEM)
    conv = Conversations(CachedLM(model, sink_tokens=len(r.system_ids), window_tokens=4000), r)
    track = conv.new_track()
    target = pieces_for(r, [{"role": "user", "content": "hello"}], answer_prefix="hi there")
    conv.sync(track, target)
    assert conv.sync_checked(track, target, 2) is None
    assert track.cache.ids == r.system_ids + [i for p in target for i in p.ids]
    with pytest.raises(ValueError, match="answer"):
        conv.sync_checked(track, pieces_for(r, [{"role": "user", "content": "hello"}]), 2)


def test_answer_cut_at_barge_in_keeps_only_the_heard_words(tokenizer):
    model = tiny("qwen2", len(tokenizer), 2)
    r = ChatRenderer(tokenizer, SYSTEM)
    conv = Conversations(CachedLM(model, sink_tokens=len(r.system_ids), window_tokens=4000), r)
    track = conv.new_track()
    hist = [{"role": "user", "content": "tell me a story"}]
    conv.sync(track, pieces_for(r, hist, answer_prefix=""))
    conv.append(track, r.encode("once upon a time there was a cat"))
    heard = hist + [{"role": "assistant", "content": "once upon a time"}]
    conv.sync(track, pieces_for(r, heard + [{"role": "user", "content": "stop"}]))
    ids = r.system_ids + [
        i for p in pieces_for(r, heard + [{"role": "user", "content": "stop"}]) for i in p.ids
    ]
    assert track.cache.ids == ids
    torch.testing.assert_close(track.cache.logits, fresh_logits(model, ids), atol=1e-5, rtol=1e-5)


def test_memory_stays_flat_over_thousands_of_turns(tokenizer):
    model = tiny("llama", len(tokenizer), 3)
    r = ChatRenderer(tokenizer, SYSTEM)
    lm = CachedLM(model, sink_tokens=len(r.system_ids), window_tokens=256, evict_chunk=32)
    conv = Conversations(lm, r)
    track = conv.new_track()
    history: list[dict[str, str]] = []
    sizes = []
    for turn in range(3000):
        history += [
            {"role": "user", "content": f"{CORPUS[turn % 9]} {turn}"},
            {"role": "assistant", "content": CORPUS[(turn + 1) % 9]},
        ]
        if len(history) > 24:
            del history[:12]  # the session core trims its history in bulk
        conv.sync(track, pieces_for(r, history))
        sizes.append((lm.nbytes(track.cache), len(track.pieces)))
        assert len(track.cache.ids) <= lm.capacity
        assert track.cache.ids[: len(r.system_ids)] == r.system_ids  # the system prompt is the sink
    assert max(s for s, _ in sizes[100:]) == max(s for s, _ in sizes)  # flat after warm-up
    assert max(n for _, n in sizes) <= 64 + 26
    assert track.rebuilds == 0  # trimming the history does not re-prefill the window each time
    assert torch.isfinite(track.cache.logits).all()


class _Heads(torch.nn.Module):
    def turn(self, h):
        return torch.tensor([0.1, 0.1, 0.8])

    def overlap(self, h):
        return torch.tensor(0.9)


class _Verifier(torch.nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, hidden, stats, mask):
        return torch.full((hidden.shape[0],), self.p)


@pytest.mark.parametrize("p_accept", [0.9, 0.1])
def test_relay_commits_or_discards_the_draft_and_the_slow_model_continues(tokenizer, p_accept):
    slow, drafter = tiny("qwen2", len(tokenizer), 4), tiny("llama", len(tokenizer), 5)
    stage = DialogueStage(
        slow,
        tokenizer,
        SlowOptions(system_prompt=SYSTEM, max_new_tokens=12),
        drafter,
        tokenizer,
        DrafterOptions(draft_words=3),
        _Heads(),
        None,
        _Verifier(p_accept),
        0.5,
    )
    state = stage.init_state()
    listen, state = stage.step(state, ListenStep([], "what is the capital of france"))
    assert listen.probs[2] == pytest.approx(0.8) and listen.prefill_tokens > 0
    over, _ = stage.step(state, OverlapStep("stop"))
    assert over.interrupt
    msgs = [{"role": "user", "content": "what is the capital of france"}]
    out, state = stage.step(state, RespondStep(msgs, 4))
    assert out.relay is not None and out.relay.committed == (p_accept >= 0.5)
    text = out.text
    first, info = out.text, out.relay
    while not out.done:
        out, state = stage.step(state, RespondStep(None, 4))
        text += out.text
    if p_accept >= 0.5:
        assert text.startswith(out_prefix := stage_prefix(state)) and out_prefix
        # the slow model's cache holds the committed draft followed by its own continuation
        gen = stage.slow.renderer.generation_ids
        answer = state.slow.pieces[-1]
        assert answer.ids[: len(gen)] == gen
        tail = tokenizer.decode(answer.ids[len(gen) :])
        assert tail.startswith(out_prefix) and len(tail) > len(out_prefix)
        # a prefix that ends a word goes out with its space (the TTS may speak its last word at once);
        # the slow model's continuation follows without a second space
        ends_word = prefix_ends_word(info.draft, info.prefix, info.ended)
        assert first == out_prefix + (" " if ends_word else "")
        cont = tail[len(out_prefix) :]
        # (the cache lags the text by the last decoded token, which is fed only if decoding goes on)
        assert text.startswith(first + (cont[1:] if cont.startswith(" ") else cont) if ends_word else tail)
    slow_only, _ = DialogueStage(
        slow, tokenizer, SlowOptions(system_prompt=SYSTEM, max_new_tokens=12)
    ).generate(msgs)
    if p_accept < 0.5:
        assert text == slow_only  # a discarded draft leaves no trace in the answer


@pytest.mark.parametrize("force", [True, False])
def test_evaluation_can_force_the_relay_decision(tokenizer, force):
    slow, drafter = tiny("qwen2", len(tokenizer), 4), tiny("llama", len(tokenizer), 5)
    # the verifier's score would commit (0.9) or discard (0.1): the forced decision wins either way
    for p in (0.9, 0.1):
        stage = DialogueStage(
            slow,
            tokenizer,
            SlowOptions(system_prompt=SYSTEM, max_new_tokens=12),
            drafter,
            tokenizer,
            DrafterOptions(draft_words=3),
            _Heads(),
            None,
            _Verifier(p),
            0.5,
        )
        state = stage.init_state()
        msgs = [{"role": "user", "content": "what is the capital of france"}]
        out, state = stage.step(state, RespondStep(msgs, 4, commit=force))
        assert out.relay is not None and out.relay.p_accept == pytest.approx(p)
        assert out.relay.committed == (force and bool(out.relay.draft.strip()))


def test_a_vetoed_draft_is_not_committed_whatever_its_score(tokenizer, monkeypatch):
    import dialogue.verifier as V

    seen = []

    def veto(prefix, previous=None, user_text=None, previous_request=None):
        seen.append((prefix, previous, user_text, previous_request))
        return "repeat"

    monkeypatch.setattr(V, "draft_veto", veto)
    slow, drafter = tiny("qwen2", len(tokenizer), 4), tiny("llama", len(tokenizer), 5)
    stage = DialogueStage(
        slow,
        tokenizer,
        SlowOptions(system_prompt=SYSTEM, max_new_tokens=12),
        drafter,
        tokenizer,
        DrafterOptions(draft_words=3),
        _Heads(),
        None,
        _Verifier(0.99),
        0.5,
    )
    history = [
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": "The dragon is a"},
        {"role": "user", "content": "stop what is two plus two"},
    ]
    out, state = stage.step(stage.init_state(), RespondStep(history, 4))
    assert (
        out.relay.veto == "repeat" and not out.relay.committed and out.relay.p_accept == pytest.approx(0.99)
    )
    # judged on the draft, the answer the caller cut off and what they said then
    assert seen == [
        (prefix_text_of(out.relay), "The dragon is a", "stop what is two plus two", "tell me a story")
    ]
    # the evaluation's forced commit still commits it (the veto is the engine's decision)
    out, _ = stage.step(stage.init_state(), RespondStep(history, 4, commit=True))
    assert out.relay.committed


def _relay_answer(tokenizer, slow, drafter, opts, msgs, relay_check, verifier):
    """The whole answer to `msgs` with the relay checked by `relay_check`, and its first step's RelayInfo."""
    stage = DialogueStage(
        slow,
        tokenizer,
        opts,
        drafter,
        tokenizer,
        DrafterOptions(draft_words=3),
        _Heads(),
        None,
        verifier,
        0.5,
    )
    out, state = stage.step(stage.init_state(), RespondStep(msgs, 4, relay_check=relay_check))
    info, text = out.relay, out.text
    while not out.done:
        out, state = stage.step(state, RespondStep(None, 4))
        text += out.text
    return info, text


@pytest.mark.parametrize("head", ["", "first"])
def test_grounded_relay_commits_only_the_head_that_restates_the_caller(tokenizer, monkeypatch, head):
    """relay_check "grounded": the verifier's commit is cut to `grounded_prefix`'s head (asked for at
    least the drafter's `draft_words`, the TTS's first phrase) and the slow model goes on from that head;
    with no such head the draft is vetoed ("ungrounded") and the slow model answers alone."""
    import dialogue.verifier as V

    seen = []

    def grounded(prefix, user_text, min_words=2):
        seen.append((prefix, user_text, min_words))
        return prefix.split()[0] if head else ""

    monkeypatch.setattr(V, "grounded_prefix", grounded)
    slow, drafter = tiny("qwen2", len(tokenizer), 4), tiny("llama", len(tokenizer), 5)
    opts = SlowOptions(system_prompt=SYSTEM, max_new_tokens=16)
    question = "what is the capital of france"
    msgs = [{"role": "user", "content": question}]
    slow_only, _ = DialogueStage(slow, tokenizer, opts).generate(msgs, relay=False)

    # the verifier alone commits the whole prefix; no grounding asked
    info, _ = _relay_answer(tokenizer, slow, drafter, opts, msgs, "verifier", _Verifier(0.99))
    assert info.committed and not seen
    full = info.prefix
    info, text = _relay_answer(tokenizer, slow, drafter, opts, msgs, "grounded", _Verifier(0.99))
    # the commit is asked of the verifier's prefix, for at least the first phrase's words
    assert seen == [(full, question, 3)]
    if head:
        assert info.committed and info.veto is None and info.prefix == full.split()[0]
        assert text.startswith(info.prefix) and info.draft.startswith(info.prefix)
    else:
        assert info.veto == "ungrounded" and not info.committed and info.prefix == ""
        assert text == slow_only  # a discarded draft leaves no trace in the answer


def prefix_text_of(info) -> str:
    from dialogue.verifier import prefix_text

    return prefix_text(info.draft, ended=info.ended, max_words=3)


def test_a_rolling_operating_point_judges_each_draft_against_recent_scores(tokenizer):
    from dialogue.verifier import RollingThreshold

    slow, drafter = tiny("qwen2", len(tokenizer), 4), tiny("llama", len(tokenizer), 5)
    stage = DialogueStage(
        slow,
        tokenizer,
        SlowOptions(system_prompt=SYSTEM, max_new_tokens=12),
        drafter,
        tokenizer,
        DrafterOptions(draft_words=3),
        _Heads(),
        None,
        _Verifier(0.9),
        0.5,
    )
    # recent drafts all scored 0.95: a 0.9 is in their bottom share, so it is discarded ...
    stage.rolling_threshold = RollingThreshold([0.95] * 10, commit=0.8, window=10)
    msgs = [{"role": "user", "content": "what is the capital of france"}]
    decisions = []
    for _ in range(4):
        out, _ = stage.step(stage.init_state(), RespondStep(msgs, 4))
        decisions.append(out.relay.committed)
        assert out.relay.threshold <= 0.95
    # ... until the window's 8th best score (80 % committed) is a 0.9 itself: the rule keeps a share
    # committed, not a number
    assert decisions == [False, False, False, True]
    # forced decisions (evaluation) leave the window alone
    before = stage.rolling_threshold.threshold()
    stage.step(stage.init_state(), RespondStep(msgs, 4, commit=True))
    assert stage.rolling_threshold.threshold() == before


def test_preclose_prefills_the_turn_end_so_the_draft_starts_at_once(tokenizer):
    slow, drafter = tiny("qwen2", len(tokenizer), 4), tiny("llama", len(tokenizer), 5)
    msgs = [{"role": "user", "content": "what is the capital of france"}]
    drafts, listens = [], []
    for preclose in (False, True):
        stage = DialogueStage(
            slow,
            tokenizer,
            SlowOptions(system_prompt=SYSTEM, max_new_tokens=12),
            drafter,
            tokenizer,
            DrafterOptions(draft_words=3),
            _Heads(),
            None,
            _Verifier(0.9),
            0.5,
        )
        state = stage.init_state()
        # slice by slice: each slice rolls back the previous slice's pre-closed turn end
        for text in ("what is", "what is the capital", "what is the capital of france"):
            listens.append(stage.step(state, ListenStep([], text, preclose=preclose))[0].probs)
        n_before = len(state.drafter.cache.ids)
        out, state = stage.step(state, RespondStep(msgs, 4))
        drafts.append(out.relay.draft)
        if preclose:
            # nothing left to prefill: the draft's first token came from the cached header logits
            gen = stage.drafter.renderer.generation_ids
            assert state.drafter.cache.ids[n_before - len(gen) : n_before] == gen
    assert drafts[0] == drafts[1] and drafts[0]
    assert listens[:3] == listens[3:]  # the heads read the open turn either way


def stage_prefix(state) -> str:
    return state.prefix


def test_relay_hands_the_committed_prefix_to_a_remote_slow_model(tokenizer):
    from dialogue.remote_llm import RemoteChatLlm
    from tests.dialogue.test_remote_llm import FakeOpenAI

    fake = FakeOpenAI()
    try:
        remote = RemoteChatLlm({"base_url": fake.base_url, "model": "slow", "system_prompt": SYSTEM})
        drafter = tiny("llama", len(tokenizer), 6)
        stage = DialogueStage(
            None,
            None,
            SlowOptions(system_prompt=SYSTEM),
            drafter,
            tokenizer,
            DrafterOptions(draft_words=3),
            _Heads(),
            None,
            _Verifier(0.9),
            0.5,
            remote,
        )
        msgs = [{"role": "user", "content": "what is the capital of france"}]
        text, info = stage.generate(msgs)
        assert info is not None and info.committed and info.prefix
        # joined verbatim (the server continues the prefix), after the space that ends the prefix's last word
        seam = " " if prefix_ends_word(info.draft, info.prefix, info.ended) else ""
        assert text == info.prefix + seam + "Paris is the capital."
        body = fake.requests[-1].body
        assert body["messages"][0] == {"role": "system", "content": SYSTEM}
        assert body["messages"][-1] == {"role": "assistant", "content": info.prefix}
        assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    finally:
        fake.close()


def test_a_second_relayed_answer_continues_its_own_prefix_not_the_previous_answer(tokenizer):
    slow, drafter = tiny("qwen2", len(tokenizer), 7), tiny("llama", len(tokenizer), 8)
    stage = DialogueStage(
        slow,
        tokenizer,
        SlowOptions(system_prompt=SYSTEM, max_new_tokens=12),
        drafter,
        tokenizer,
        DrafterOptions(draft_words=3),
        _Heads(),
        None,
        _Verifier(0.9),
        0.5,
    )
    state = stage.init_state()
    first = [{"role": "user", "content": "tell me a story"}]
    out, state = stage.step(state, RespondStep(first, 4))
    out, state = stage.step(state, RespondStep(None, 4))  # the first answer is being decoded...
    second = first + [
        {"role": "user", "content": "what is the capital of france"}
    ]  # ...and cut by a new turn
    out, state = stage.step(state, RespondStep(second, 4))
    assert out.relay is not None and out.relay.committed
    prefix = out.text
    out, state = stage.step(state, RespondStep(None, 4))
    want = stage.slow.renderer.system_ids + [
        i for p in pieces_for(stage.slow.renderer, second, answer_prefix=prefix) for i in p.ids
    ]
    assert state.slow.cache.ids[: len(want)] == want


def test_first_step_decodes_until_the_first_phrase_and_the_answer_is_unchanged(tokenizer):
    from dialogue.engine import FIRST_PHRASE_MAX_TOKENS
    from duplex.base.phrases import first_phrase_ready

    slow = tiny("qwen2", len(tokenizer), 4)
    opts = SlowOptions(system_prompt=SYSTEM, max_new_tokens=24)
    msgs = [{"role": "user", "content": "tell me a story please"}]
    plain, _ = DialogueStage(slow, tokenizer, opts).generate(msgs, relay=False)
    stage = DialogueStage(slow, tokenizer, opts)
    out, state = stage.step(stage.init_state(), RespondStep(msgs, 4, False, phrase_words=3))
    # it stopped at the first token that made the phrase speakable (or at its cap / the end)
    assert out.done or out.n_tokens == FIRST_PHRASE_MAX_TOKENS or first_phrase_ready(out.text, False, 3)
    assert out.n_tokens == 1 or not first_phrase_ready(
        tokenizer.decode(state.response_ids[:-1], skip_special_tokens=True), False, 3
    )
    text = out.text
    while not out.done:
        out, state = stage.step(state, RespondStep(None, 4))
        text += out.text
    assert text == plain  # how the steps are cut does not change the answer


@pytest.mark.parametrize("same", [True, False])
@pytest.mark.parametrize("phrase_words", [3, 0])
def test_exact_relay_speaks_the_slow_models_own_answer_sooner(tokenizer, same, phrase_words):
    """relay_check "exact": the slow model reads the draft in one forward and keeps only the tokens it
    would have picked itself, so the answer is the slow-only answer token for token, whatever the
    drafter said; a drafter that agrees saves the slow model's sequential steps."""
    slow = tiny("qwen2", len(tokenizer), 4)
    drafter = slow if same else tiny("llama", len(tokenizer), 5)
    opts = SlowOptions(system_prompt=SYSTEM, max_new_tokens=16)
    msgs = [{"role": "user", "content": "what is the capital of france"}]
    slow_only, _ = DialogueStage(slow, tokenizer, opts).generate(msgs, relay=False)
    stage = DialogueStage(
        slow,
        tokenizer,
        opts,
        drafter,
        tokenizer,
        DrafterOptions(draft_words=3, relay_check="exact"),
        _Heads(),
        None,
        _Verifier(0.0),  # the learned verifier would discard every draft: it is not asked
        0.5,
    )
    state = stage.init_state()
    _, state = stage.step(state, ListenStep([], "what is the capital of france"))
    out, state = stage.step(state, RespondStep(msgs, 4, phrase_words=phrase_words))
    info = out.relay
    assert info is not None and info.draft
    text = out.text
    while not out.done:
        out, state = stage.step(state, RespondStep(None, 4))
        text += out.text
    assert text == slow_only
    assert slow_only.startswith(info.prefix)
    if same:  # the drafter is the slow model: its draft is kept (up to where the tiny model's byte
        # soup stops surviving a decode and re-encode)
        assert info.committed and info.p_accept > 0 and info.prefix


def test_slow_instructions_reach_the_slow_model_only(tokenizer):
    """`slow_instructions` extend the slow model's system prompt; the drafter (whose hidden states the
    turn heads and the verifier were trained on) keeps the shared prompt."""
    slow, drafter = tiny("qwen2", len(tokenizer), 4), tiny("llama", len(tokenizer), 5)
    extra = "Use your for the caller's things."
    opts = SlowOptions(system_prompt=SYSTEM, max_new_tokens=12, slow_instructions=extra)
    assert opts.slow_system_prompt == f"{SYSTEM} {extra}"
    stage = DialogueStage(slow, tokenizer, opts, drafter, tokenizer, DrafterOptions(), _Heads(), None, None)
    assert stage.slow.renderer.system_ids == ChatRenderer(tokenizer, f"{SYSTEM} {extra}").system_ids
    assert stage.drafter.renderer.system_ids == ChatRenderer(tokenizer, SYSTEM).system_ids
    assert SlowOptions.from_mapping({"system_prompt": SYSTEM, "slow_instructions": extra}) == opts.__class__(
        system_prompt=SYSTEM, slow_instructions=extra
    )


@pytest.mark.parametrize("notes", [True, False])
def test_caller_notes_reach_the_slow_model_as_it_reads_the_question(tokenizer, notes):
    """With `caller_notes` on, the slow model's cache holds the question about the caller with the
    caller's earlier fact restated (dialogue/caller_notes.py); off, the question as said."""
    from dialogue.caller_notes import note_for

    slow = tiny("qwen2", len(tokenizer), 4)
    opts = SlowOptions(system_prompt=SYSTEM, max_new_tokens=6, caller_notes=notes)
    stage = DialogueStage(slow, tokenizer, opts, None, None, DrafterOptions(), None, None, None)
    history = [
        {"role": "user", "content": "My dog is called Max."},
        {"role": "assistant", "content": "What a nice name."},
    ]
    question = "What is my dog called?"
    state = stage.init_state()
    _, state = stage.step(state, ListenStep(history, question))
    out, state = stage.step(state, RespondStep([*history, {"role": "user", "content": question}], 4))
    users = [p.key[1] for p in state.slow.pieces if p.key[0] == "user"]
    said = question + note_for(["their dog is called Max"]) if notes else question
    assert users == ["My dog is called Max.", said]
    # on, the answer starts with the caller's thing (caller_notes.answer_lead): the slow model read it as
    # the answer's first words and went on from there; it goes out with the first words after it
    assert out.text.startswith("Your dog") == notes
    answers = [p.key[1] for p in state.slow.pieces if p.key[0] == "answer"]
    assert (answers == ["Your dog"]) == notes


def test_pause_threads_run_only_the_steps_the_onset_waits_on(tokenizer, monkeypatch):
    """`pause_threads` goes to the listen step at a pause (no slow prefill) and the answer's first step;
    listen steps while the user talks, continuations and overlap steps keep `threads`. The answer is the
    same either way."""
    import dialogue.engine as engine_mod

    seen: list[int | None] = []
    real = engine_mod.torch_threads

    def record(n):
        seen.append(n)
        return real(n)

    monkeypatch.setattr(engine_mod, "torch_threads", record)
    slow, drafter = tiny("qwen2", len(tokenizer), 4), tiny("llama", len(tokenizer), 5)
    texts = []
    for pause_threads in (None, 2):
        opts = SlowOptions(system_prompt=SYSTEM, max_new_tokens=8, threads=1, pause_threads=pause_threads)
        stage = DialogueStage(
            slow, tokenizer, opts, drafter, tokenizer, DrafterOptions(), _Heads(), None, None
        )
        state = stage.init_state()
        seen.clear()
        q = "what is the capital of france"
        stage.step(state, ListenStep([], "what is the"))  # while they talk
        stage.step(state, ListenStep([], q, prefill_slow=False))  # at the pause
        stage.step(state, OverlapStep("stop"))
        out, state = stage.step(state, RespondStep([{"role": "user", "content": q}], 4))
        text = out.text
        while not out.done:
            out, state = stage.step(state, RespondStep(None, 4))
            text += out.text
        texts.append(text)
        urgent = 1 if pause_threads is None else 2
        assert seen[:4] == [1, urgent, 1, urgent] and set(seen[4:]) == {1}
    assert texts[0] == texts[1]
    with pytest.raises(ConfigError, match="pause_threads"):
        SlowOptions.from_mapping({"pause_threads": 0})
