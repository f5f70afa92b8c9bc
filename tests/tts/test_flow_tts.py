"""The flow TTS stage: the stage contract, text tags that cover the input exactly, ~225 ms chunks,
split invariance, determinism, batched == one by one, and a clear error without weights. Tiny seeded
models and a toy front end (hibari's G2P only where the word mapping needs it)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from codec.speech_codec import CodecConfig, SpeechCodec
from duplex.base.config import ComponentConfig
from duplex.base.errors import ModelError
from duplex.base.messages import TtsInput
from duplex.base.stage import IncrementalStage, StreamingStage
from tts.flow_model import FlowConfig, FlowModel
from tts.flow_tts import FlowTtsStage, load_flow_tts_stage, word_map

SPACE = 16
TEXTS = [
    "Hello there, how are you doing today? I hope it is going well.",
    "Sure, the capital of France is Paris; it is a lovely city with many museums and parks!",
    "Okay",
]


class ToyFrontEnd:
    """Letters -> ids, words separated by the space id, one id list per sentence (with 0 pads)."""

    space_id = SPACE

    def sentences(self, text: str) -> list[list[int]]:
        out = []
        for sent in re.split(r"(?<=[.!?])\s+", text.strip()):
            words = [w for w in sent.split() if re.search(r"\w", w)]
            if not words:
                continue
            ids: list[int] = []
            for w in words:
                if ids:
                    ids.append(SPACE)
                ids += [20 + ord(ch) % 100 for ch in w.lower() if ch.isalpha()] + [
                    4 for ch in w if ch in ".,!?;"
                ]
            out.append([0, *ids, 0])
        return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_stage(**kw) -> FlowTtsStage:
    torch.manual_seed(0)
    codec = SpeechCodec(
        CodecConfig(
            enc_fast_dim=16,
            enc_fast_blocks=1,
            enc_dim=16,
            enc_blocks=1,
            groups=1,
            dec_dim=16,
            dec_blocks=1,
            dec_fast_dim=16,
            dec_fast_blocks=1,
            n_pca=4,
        )
    )
    with torch.no_grad():
        codec.lh_basis.normal_(0, 0.05)
        codec.nz_basis.normal_(0, 0.05)
        codec.lh_mean.fill_(-3)
        codec.nz_mean.fill_(-5)
    model = FlowModel(
        FlowConfig(latent_dim=4, enc_dim=32, enc_layers=2, dim=32, layers=2, t_dim=16, chunk=6, left_chunks=2)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return FlowTtsStage(model, codec, ToyFrontEnd(), steps=2, **kw)


STAGE = None


def stage() -> FlowTtsStage:
    global STAGE
    if STAGE is None:
        STAGE = make_stage()
    return STAGE


def run(st: FlowTtsStage, deltas: list[str]):
    state = st.init_state()
    chunks = []
    for i, d in enumerate(deltas):
        out, state = st.step(state, TtsInput(d, final=i == len(deltas) - 1))
        chunks += out
    return chunks


def test_is_a_streaming_stage() -> None:
    st = stage()
    assert isinstance(st, StreamingStage)
    assert st.kind == "tts" and st.sample_rate == 24000


@pytest.mark.parametrize("text", TEXTS)
def test_text_tags_cover_the_input_exactly(text: str) -> None:
    chunks = run(stage(), [text])
    spoken = " ".join(c.text for c in chunks if c.text)
    assert spoken == " ".join(text.split())
    assert all(c.audio.dtype == np.float32 and np.isfinite(c.audio).all() for c in chunks)


def test_chunks_are_about_200_ms() -> None:
    chunks = run(stage(), [TEXTS[1]])
    sizes = [len(c.audio) for c in chunks]
    assert max(sizes[:-1]) == 6 * 900  # 225 ms; the last chunk of each utterance may be shorter
    assert sum(s == 5400 for s in sizes) >= len(sizes) // 2


def test_words_arrive_no_earlier_than_their_audio() -> None:
    """A chunk is tagged with a word only once the word's last frame is in the audio so far."""
    st = make_stage(first_phrase_words=12)  # one phrase, so `utterances` sees what the stage speaks
    text = "Hello there how are you doing today and tomorrow?"
    utts = st.utterances(text)
    chunks = run(st, [text])
    heard = 0
    for c in chunks:
        heard += len(c.audio)
        for w in c.text.split():
            u = next(u for u in utts if w in u.words)
            end = u.word_end[u.words.index(w)]
            lag = st.codec.cfg.output_delay  # the word's last frame's audio ends this much later
            assert heard + u.skip * 900 >= min(end * 900 + lag, u.frames * 900)  # the lead is not played


def test_the_lead_silence_is_computed_but_not_played() -> None:
    """Each utterance starts with the lead pad the model was trained on; all but LEAD_KEEP_FRAMES of its
    frames are dropped from the audio, so phrases follow each other without 300 ms gaps."""
    from tts.flow_tts import LEAD_KEEP_FRAMES, LEAD_UNITS

    st = make_stage(first_phrase_words=12)
    text = "Hello there. How are you?"
    utts = st.utterances(text)
    assert len(utts) == 2 and all(u.skip == LEAD_UNITS * 2 // 3 - LEAD_KEEP_FRAMES for u in utts)
    audio = sum(len(c.audio) for c in run(st, [text]))
    flush = st.codec.cfg.output_delay  # overlap-add + the vocoder's envelope delay
    assert audio == sum(u.frames - u.skip for u in utts) * 900 + flush


def test_split_invariant_and_deterministic() -> None:
    text = TEXTS[0] + " " + TEXTS[1]
    whole = run(stage(), [text])
    words = run(stage(), re.findall(r"\s*\S+", text))
    a = np.concatenate([c.audio for c in whole])
    b = np.concatenate([c.audio for c in words])
    np.testing.assert_allclose(a, b, atol=1e-5)
    assert " ".join(c.text for c in whole if c.text) == " ".join(c.text for c in words if c.text)
    again = np.concatenate([c.audio for c in run(stage(), [text])])
    assert np.array_equal(a, again)
    other = make_stage(seed=5)
    assert not np.allclose(a, np.concatenate([c.audio for c in run(other, [text])]))


def test_step_batch_equals_one_by_one() -> None:
    st = stage()
    one = [st.step(st.init_state(), TtsInput(t, final=True)) for t in TEXTS]
    # a second call on a session that already spoke (continuing decoder state) batched with new ones
    first, state = st.step(st.init_state(), TtsInput("Well, hello there. ", final=False))
    batch = st.step_batch(
        [(st.init_state(), TtsInput(t, final=True)) for t in TEXTS] + [(state, TtsInput("Bye now.", True))]
    )
    alone = st.step(state, TtsInput("Bye now.", True))
    for (o1, _), (o2, _) in zip([*one, alone], batch, strict=True):
        assert [c.text for c in o1] == [c.text for c in o2]
        for c1, c2 in zip(o1, o2, strict=True):
            np.testing.assert_allclose(c1.audio, c2.audio, atol=1e-4)
    assert first and state.decoder is not None


def test_front_half_batched_over_phrases_equals_one_by_one() -> None:
    """`utterances_batch` pads every sentence of every phrase into one encoder/duration/regulator pass
    (what a step_batch of many sessions' first phrases runs): each utterance is what it is alone."""
    st = stage()
    phrases = [*TEXTS, "Hi.", "One more sentence here, and then another one. Short!"]
    batched = st.utterances_batch(phrases)
    for phrase, got in zip(phrases, batched, strict=True):
        alone = st.utterances(phrase)
        assert len(got) == len(alone)
        for a, b in zip(alone, got, strict=True):
            assert (a.words, a.word_end, a.word_ids, a.skip) == (b.words, b.word_end, b.word_ids, b.skip)
            assert a.cond.shape == b.cond.shape and a.mu.shape == b.mu.shape
            torch.testing.assert_close(b.cond, a.cond, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(b.mu, a.mu, atol=1e-5, rtol=1e-5)
    assert st.utterances_batch([]) == []
    # the padding itself: a short sentence padded beside a long one encodes as it does unpadded
    enc = st.front_model.encoder
    short, long_ = [0, 30, 31, SPACE, 32, 0], [0, *range(40, 70), 0]
    ids = torch.zeros(2, len(long_), dtype=torch.long)
    ids[0, : len(short)], ids[1] = torch.tensor(short), torch.tensor(long_)
    valid = ids.new_zeros(ids.shape, dtype=torch.bool)
    valid[0, : len(short)], valid[1] = True, True
    h = enc(ids, valid)
    torch.testing.assert_close(h[0, : len(short)], enc(torch.tensor([short]))[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h[1], enc(torch.tensor([long_]))[0], atol=1e-5, rtol=1e-5)


def drain(st: FlowTtsStage, deltas: list[str]) -> tuple[list, list[int]]:
    """Drive an incremental stage as the session core does: each delta, then empty steps while it owes."""
    state, chunks, per_call = st.init_state(), [], []
    for i, d in enumerate(deltas):
        final = i == len(deltas) - 1
        out, state = st.step(state, TtsInput(d, final=final))
        chunks, per_call = chunks + out, per_call + [len(out)]
        while st.pending(state):
            out, state = st.step(state, TtsInput("", final=final))
            chunks, per_call = chunks + out, per_call + [len(out)]
    return chunks, per_call


def test_chunk_by_chunk_calls_give_the_same_samples_and_words() -> None:
    """chunks_per_call: the first call of a response returns after one chunk and owes the rest; stepping it
    until it owes nothing gives exactly the samples and word tags of speaking everything at once."""
    text = TEXTS[0] + " " + TEXTS[1]
    whole = run(stage(), [text])
    inc = make_stage(chunks_per_call=2)
    assert isinstance(inc, IncrementalStage)
    for deltas in ([text], re.findall(r"\s*\S+", text)):
        chunks, per_call = drain(inc, deltas)
        assert [c.text for c in chunks] == [c.text for c in whole]
        for c1, c2 in zip(chunks, whole, strict=True):
            np.testing.assert_allclose(c1.audio, c2.audio, atol=1e-5)
        # a call stops at its first (then second) chunk with speech; lead-only chunks before it ride along
        assert max(per_call) <= 3 and per_call[next(i for i, n in enumerate(per_call) if n)] <= 2
    out, state = inc.step(inc.init_state(), TtsInput(text, final=True))
    assert len(out) <= 2 and len(out[-1].audio) > 900  # ends with the first chunk that holds speech
    assert inc.pending(state) and state.decoder is not None  # nothing flushed yet


def test_a_whole_input_is_spoken_in_one_call() -> None:
    inc = make_stage(chunks_per_call=1)
    out, state = inc.step(inc.init_state(), TtsInput("Mm-hmm.", final=True, whole=True))
    ref, _ = stage().step(stage().init_state(), TtsInput("Mm-hmm.", final=True))
    assert not inc.pending(state) and state.decoder is None and len(out) == len(ref)


def test_incremental_step_batch_equals_one_by_one() -> None:
    inc = make_stage(chunks_per_call=2)
    states = [inc.step(inc.init_state(), TtsInput(t, final=True))[1] for t in TEXTS]
    batch = inc.step_batch([(s, TtsInput("", final=True)) for s in states])
    for s, (o2, s2) in zip(states, batch, strict=True):
        o1, s1 = inc.step(s, TtsInput("", final=True))
        assert [c.text for c in o1] == [c.text for c in o2] and len(s1.backlog) == len(s2.backlog)
        for c1, c2 in zip(o1, o2, strict=True):
            np.testing.assert_allclose(c1.audio, c2.audio, atol=1e-4)


def test_final_flushes_and_resets() -> None:
    st = stage()
    out, state = st.step(st.init_state(), TtsInput("Hi there.", final=True))
    assert state.decoder is None and state.phrases.pending == ""
    out2, _ = st.step(st.init_state(), TtsInput("", final=True))
    assert out2 == []


def test_missing_weights_say_how_to_train(tmp_path) -> None:
    cfg = ComponentConfig(name="tts", backend="flow", weights={"path": str(tmp_path)})
    with pytest.raises(ModelError, match="tts.training.train_flow"):
        load_flow_tts_stage(cfg)


def test_word_map_with_hibari_g2p() -> None:
    """Numbers expand to several phoneme words; the map still gives each text word its own."""
    pytest.importorskip("hibari")
    from tts.flow_tts import HibariFrontEnd, _phoneme_words

    fe = HibariFrontEnd()
    text = "Dr. Smith paid $9.99 for it."
    sents = fe.sentences(text)
    counts = [len({w for w in _phoneme_words(ids, fe.space_id) if w >= 0}) for ids in sents]
    owner = word_map(text.split(), counts, fe)
    assert len(owner) == sum(counts) > len(text.split())
    assert owner == sorted(owner) and set(owner) == set(range(len(text.split())))


def test_loader_reads_exported_weights_and_checks_the_codec(tmp_path) -> None:
    """Weights + json written as the recipe exports them load into a working stage; another codec is refused."""
    pytest.importorskip("hibari")
    import hashlib
    import json

    from safetensors.torch import save_file

    st = make_stage()
    save_file(
        {k: v.half().contiguous() for k, v in st.model.state_dict().items()},
        str(tmp_path / "flow_model.safetensors"),
    )
    codec_sd = {k: v.contiguous() for k, v in st.codec.state_dict().items()}
    save_file(
        codec_sd, str(tmp_path / "codec.safetensors"), metadata={"config": json.dumps(st.codec.cfg.to_dict())}
    )
    sha = hashlib.sha256((tmp_path / "codec.safetensors").read_bytes()).hexdigest()
    meta = {"config": st.model.cfg.to_dict(), "codec_file": "codec.safetensors", "codec_sha256": sha}
    (tmp_path / "flow_model.json").write_text(json.dumps(meta))
    cfg = ComponentConfig(name="tts", backend="flow", weights={"path": str(tmp_path)}, options={"steps": 2})
    loaded = load_flow_tts_stage(cfg)
    out, _ = loaded.step(loaded.init_state(), TtsInput("Hello there, friend.", final=True))
    assert " ".join(c.text for c in out if c.text) == "Hello there, friend."
    (tmp_path / "flow_model.json").write_text(json.dumps(meta | {"codec_sha256": "0" * 64}))
    with pytest.raises(ModelError, match="retrain"):
        load_flow_tts_stage(cfg)

    # a codec whose decoder alone was trained further fits through the latent fingerprint; another encoder not
    from codec.speech_codec import latent_sha256

    meta["codec_latent_sha256"] = latent_sha256(str(tmp_path / "codec.safetensors"))

    def write_codec(prefix: str) -> None:
        sd = {
            k: v + 0.01 if k.startswith(prefix) and v.is_floating_point() else v for k, v in codec_sd.items()
        }
        save_file(
            sd, str(tmp_path / "codec.safetensors"), metadata={"config": json.dumps(st.codec.cfg.to_dict())}
        )

    (tmp_path / "flow_model.json").write_text(json.dumps(meta))
    write_codec("dec_")
    assert hashlib.sha256((tmp_path / "codec.safetensors").read_bytes()).hexdigest() != sha
    assert load_flow_tts_stage(cfg).codec is not None
    write_codec("enc_")
    with pytest.raises(ModelError, match="another encoder"):
        load_flow_tts_stage(cfg)


def test_device_option_is_checked_before_loading(tmp_path) -> None:
    """A bad `device` is a ConfigError naming it; `cuda` without CUDA says how to fall back (no GPU needed)."""
    from duplex.base.config import ConfigError

    cfg = ComponentConfig(
        name="tts", backend="flow", weights={"path": str(tmp_path)}, options={"device": "gpu"}
    )
    with pytest.raises(ConfigError, match="not cpu, cuda or cuda:N"):
        load_flow_tts_stage(cfg)
    if not torch.cuda.is_available():
        cfg = ComponentConfig(
            name="tts", backend="flow", weights={"path": str(tmp_path)}, options={"device": "cuda"}
        )
        with pytest.raises(ConfigError, match="device: cpu"):
            load_flow_tts_stage(cfg)


def test_stage_on_an_explicit_device_equals_the_default() -> None:
    """device="cpu" given explicitly moves nothing and changes no sample (the path CUDA takes, on the CPU)."""
    a = run(make_stage(), ["Sure, the capital of France is Paris."])
    b = run(make_stage(device=torch.device("cpu")), ["Sure, the capital of France is Paris."])
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.text == y.text and np.array_equal(x.audio, y.audio)


def test_threads_option_holds_only_during_the_call() -> None:
    """`threads` sets torch's intra-op threads around each call on the calling thread (the live server's
    process keeps one per core for the others) and restores them after; the samples do not change."""
    st = make_stage(threads=2)
    seen: list[int] = []
    real_step = st.model.step

    def step(*a, **kw):
        seen.append(torch.get_num_threads())
        return real_step(*a, **kw)

    st.model.step = step  # type: ignore[method-assign]
    before = torch.get_num_threads()
    a = run(st, ["Sure, the capital of France is Paris."])
    assert seen and set(seen) == {2}
    assert torch.get_num_threads() == before == 1
    b = run(make_stage(), ["Sure, the capital of France is Paris."])
    assert [c.text for c in a] == [c.text for c in b]
    np.testing.assert_allclose(
        np.concatenate([c.audio for c in a]), np.concatenate([c.audio for c in b]), atol=1e-5
    )


@pytest.mark.parametrize("bad", [0, -1, 1.5, "two", True])
def test_threads_option_is_checked(tmp_path, bad) -> None:
    from duplex.base.config import ConfigError

    cfg = ComponentConfig(
        name="tts", backend="flow", weights={"path": str(tmp_path)}, options={"threads": bad}
    )
    with pytest.raises(ConfigError, match="threads must be an integer >= 1"):
        load_flow_tts_stage(cfg)
