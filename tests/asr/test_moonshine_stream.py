"""Moonshine's encoder streamed (asr/moonshine_stream.py): streaming == offline, the chunk mask bounds what a
frame reads, the recipe's adapters start as the packaged layers and merge exactly; and, with the packaged weights,
the port is Moonshine's encoder and its frames are heard by Moonshine's decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asr.moonshine_stream import HOP, MoonshineStreamingEncoder, frames_for, merge_adapters
from asr.training.train_moonshine_stream import (
    adapter_state,
    add_adapters,
    augment,
    decoder_loss,
    distill_loss,
)


def _encoder(**kw) -> MoonshineStreamingEncoder:
    torch.manual_seed(0)
    return MoonshineStreamingEncoder(**kw).eval()


def _audio(seconds: float, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy((0.1 * rng.standard_normal(int(seconds * 16000))).astype(np.float32))[None]


@pytest.mark.parametrize("pieces", [[160] * 200, [5000, 1, 7, 12000, 3000], [400, 384 * 20, 2000]])
def test_streaming_equals_offline(pieces: list[int]) -> None:
    enc = _encoder(chunk_frames=5, left_frames=12)
    x = _audio(2.0)
    with torch.no_grad():
        offline = enc(x)
    st, outs, i = enc.init_state(), [], 0
    while i < x.shape[1]:
        n = pieces[len(outs) % len(pieces)]
        outs.append(enc.step(st, x[:, i : i + n], final=i + n >= x.shape[1]))
        i += n
    online = torch.cat(outs, 1)
    assert online.shape == offline.shape == (1, frames_for(x.shape[1]), 416)
    assert torch.allclose(online, offline, atol=1e-4)
    # a chunk's frames come out as soon as the chunk's audio is in, not at the end
    assert sum(o.shape[1] > 0 for o in outs[:-1]) >= 1


def test_a_chunk_never_reads_a_later_chunk() -> None:
    enc = _encoder(chunk_frames=5, left_frames=12)
    x = _audio(1.5)
    y = x.clone()
    cut = 20 * HOP + 2000  # change the audio from frame ~25 on
    y[:, cut:] = _audio(1.5, seed=1)[:, cut:]
    with torch.no_grad():
        a, b = enc(x)[0], enc(y)[0]
    same = (a - b).abs().amax(-1) < 1e-5
    # frames of chunks that end before the change are untouched (the stem reads ~56 ms ahead, inside the chunk)
    assert same[:20].all()
    assert not same[30:].any()


def test_left_context_is_bounded() -> None:
    enc = _encoder(chunk_frames=4, left_frames=8)
    x = _audio(2.0)
    st = enc.init_state()
    enc.step(st, x, final=True)
    assert all(k.shape[2] == 8 for k in st.keys)  # the cache never grows past the window


def test_full_context_mask_is_none_and_streaming_needs_chunks() -> None:
    enc = _encoder(chunk_frames=None, causal_norm=False)
    assert enc.mask(10) is None
    with pytest.raises(ValueError, match="chunk"):
        enc.init_state()


def test_adapters_start_as_the_plain_encoder_and_merge_exactly() -> None:
    plain = _encoder(chunk_frames=5, left_frames=12)
    adapted = _encoder(chunk_frames=5, left_frames=12)
    params = add_adapters(adapted, rank=4, alpha=4.0)
    x = _audio(1.0)
    with torch.no_grad():
        assert torch.allclose(adapted(x), plain(x), atol=1e-6)  # B = 0: the packaged layers exactly
        for p in params:
            p.add_(0.01 * torch.randn_like(p))
        want = adapted(x)
    merge_adapters(plain, adapter_state(adapted), rank=4, alpha=4.0)
    with torch.no_grad():
        assert torch.allclose(plain(x), want, atol=1e-4)
    trained = {k for k, v in adapted.named_parameters() if v.requires_grad}
    assert "layers.0.q_proj.a" in trained and "conv1.weight" not in trained


def test_distill_loss_is_zero_only_for_the_teacher() -> None:
    t = torch.randn(1, 10, 416)
    assert float(distill_loss(t, t)[0]) == pytest.approx(0.0, abs=1e-6)
    assert float(distill_loss(t + 0.5, t)[0]) > 0.4


def _random_decoder(vocab: int, seed: int):
    """A tiny-vocabulary Moonshine decoder with seeded random weights, frozen."""
    from asr.moonshine_decoder import MoonshineDecoder

    torch.manual_seed(seed)
    dec = MoonshineDecoder(vocab=vocab)
    with torch.no_grad():
        for p in dec.parameters():
            p.normal_(0, 0.2)
            p.requires_grad_(False)
    return dec


def test_decoder_loss_is_zero_for_the_teacher_and_reaches_the_student_frames() -> None:
    dec = _random_decoder(50, 0)
    teacher = torch.randn(1, 30, 416)
    same, ce_same, parts = decoder_loss(dec, teacher.clone(), teacher, [5, 7, 9])
    assert float(same) == pytest.approx(0.0, abs=1e-5) and parts["agree"] == 1.0
    student = (teacher + torch.randn(1, 30, 416)).requires_grad_(True)
    loss, ce, _ = decoder_loss(dec, student, teacher, [5, 7, 9])
    (loss + ce).backward()
    assert float(loss) > 1e-3 and float(student.grad.abs().sum()) > 0
    assert float(ce) > 0 and float(ce_same) > 0  # the text's cross-entropy (a random decoder is unsure)
    assert not any(p.grad is not None for p in dec.parameters())  # the decoder stays frozen


def test_decoder_is_causal_and_ignores_padded_frames() -> None:
    dec = _random_decoder(40, 1)
    frames = torch.randn(1, 12, 416)
    a = dec(torch.tensor([[1, 5, 6, 7]]), frames)
    b = dec(torch.tensor([[1, 5, 6, 9]]), frames)
    assert torch.allclose(a[:, :3], b[:, :3], atol=1e-5) and not torch.allclose(a[:, 3], b[:, 3])
    padded = torch.cat([frames, torch.randn(1, 5, 416)], 1)
    c = dec(torch.tensor([[1, 5, 6, 7]]), padded, n_frames=torch.tensor([12]))
    assert torch.allclose(a, c, atol=1e-5)


def test_augment_adds_silence_and_bounds_the_level() -> None:
    audio = (0.3 * np.sin(np.arange(16000) / 10)).astype(np.float32)
    x = augment(audio, np.random.default_rng(0))
    assert x.size >= audio.size + 1600 and x.dtype == np.float32
    assert 0.1 < np.abs(x).max() < 1.0


@pytest.mark.integration
def test_the_port_is_moonshines_encoder_and_its_frames_are_heard() -> None:
    from asr.moonshine import MoonshineModel, decode_tokens, model_file, ort_session
    from asr.moonshine_stream import load_packaged
    from tests.speech import silence, synthesize

    audio = np.concatenate([silence(0.2), synthesize("What is the capital of France?"), silence(0.3)])
    ort = ort_session(model_file("encoder_model.ort"), 1).run(None, {"input_values": audio[None]})[0]
    full = load_packaged(chunk_frames=None, causal_norm=False)
    with torch.no_grad():
        ours = full(torch.from_numpy(audio)[None]).numpy()
    assert ours.shape == ort.shape
    assert np.abs(ours - ort).max() < 1e-3

    model = MoonshineModel(threads=1)

    class Frames:  # Moonshine's decoder reading our frames instead of its encoder's
        def run(self, _names, _feed):
            return [frames]

    stream = load_packaged(chunk_frames=40, left_frames=250)
    st = stream.init_state()
    pieces = [stream.step(st, torch.from_numpy(audio[i : i + 1600])[None], final=i + 1600 >= audio.size)
              for i in range(0, audio.size, 1600)]  # fmt: skip
    frames = torch.cat(pieces, 1).numpy()
    model._encoder = Frames()
    text = decode_tokens(model.tokens, model._greedy(audio)).lower()
    assert "capital" in text and "france" in text, text


@pytest.mark.integration
def test_the_decoder_port_gives_the_packaged_decoders_logits() -> None:
    from asr.moonshine import BOS, MoonshineModel
    from asr.moonshine_decoder import load_packaged_decoder
    from tests.speech import silence, synthesize

    audio = np.concatenate([silence(0.2), synthesize("Turn the lights off in the kitchen."), silence(0.3)])
    model = MoonshineModel(threads=1)
    hidden = model._encoder.run(None, {"input_values": audio[None]})[0]
    prompt = [BOS, *model.transcribe_ids(audio)]
    past = {n: np.zeros((1, h, 0, d), np.float32) for n, (h, d) in model._past_shape.items()}
    feed = {"input_ids": np.array([prompt], np.int64), "encoder_hidden_states": hidden,
            "use_cache_branch": np.array([False]), **past}  # fmt: skip
    ort = model._decoder.run(None, feed)[0]
    with torch.no_grad():
        ours = load_packaged_decoder()(torch.tensor([prompt]), torch.from_numpy(hidden)).numpy()
    assert ours.shape == ort.shape and len(prompt) > 4
    assert np.abs(ours - ort).max() < 1e-3
    assert (ours.argmax(-1) == ort.argmax(-1)).all()


# -- the stage ------------------------------------------------------------------------------------------------


class _Decoder:
    """Moonshine's decoder stand-in: a token per 10 frames, whether the first channel is above its mean picks it; records its drafts."""

    tokens = [b"<unk>", b"<s>", b"</s>", b"\xe2\x96\x81yes", b"\xe2\x96\x81no"]

    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple[int, ...]]] = []

    def decode_frames(self, hidden, n_samples, draft=()):
        self.calls.append((hidden.shape[1], tuple(draft)))
        return [
            3 if hidden[0, i : i + 10, 0].mean() > hidden[0, :, 0].mean() else 4
            for i in range(0, hidden.shape[1], 10)
        ]


def _stage():
    from asr.moonshine_stream_stage import MoonshineStreamAsrStage

    return MoonshineStreamAsrStage(_encoder(chunk_frames=5, left_frames=12), _Decoder())


def test_stage_pieces_equal_whole_and_states_are_never_changed() -> None:
    from duplex.base.messages import AsrChunk

    x = _audio(1.5)[0].numpy()
    stage = _stage()
    whole, _ = stage.step(stage.init_state(), AsrChunk(x, transcribe=True, final=True))
    state, n = stage.init_state(), 0
    for start in range(0, x.size, 2000):
        last = start + 2000 >= x.size
        before = state
        out, state = stage.step(state, AsrChunk(x[start : start + 2000], transcribe=True, final=last))
        assert before.n_samples == n and not before.finished  # the input state is as it was
        n += x[start : start + 2000].size
        # a partial has heard the whole chunks it encoded (5 frames of 384 samples, once the stem's
        # kernels have their samples); the final all of the audio (None)
        if last:
            assert out.heard_seconds is None
        else:
            heard = round(out.heard_seconds * 16000)
            assert heard % (5 * 384) == 0 and n - 2 * 5 * 384 < heard <= n
        if start == 6000:  # a speculative final from a partial's state, then the partials go on from it
            spec, _ = stage.step(state, AsrChunk(np.zeros(0, np.float32), transcribe=True, final=True))
            assert spec.is_final and not state.finished
    assert out.is_final and out.text == whole.text and out.text
    assert out.audio_seconds == pytest.approx(x.size / 16000)
    with pytest.raises(ValueError, match="finalised"):
        stage.step(state, AsrChunk(x[:100]))


def test_stage_passes_the_last_transcript_as_the_draft() -> None:
    from duplex.base.messages import AsrChunk

    stage = _stage()
    x = _audio(1.0)[0].numpy()
    _, state = stage.step(stage.init_state(), AsrChunk(x[:8000], transcribe=True))
    stage.step(state, AsrChunk(x[8000:], transcribe=True, final=True))
    first, second = stage.model.calls
    assert first[1] == () and second[1] == tuple(state.draft) and state.draft
    assert second[0] > first[0]  # the final decodes more frames than the partial


def test_stage_rejects_stereo() -> None:
    from duplex.base.messages import AsrChunk

    stage = _stage()
    with pytest.raises(ValueError, match="mono"):
        stage.step(stage.init_state(), AsrChunk(np.zeros((2, 100), np.float32)))


@pytest.mark.integration
def test_the_profile_loads_and_hears_a_question() -> None:
    from duplex.base.config import load_profile
    from duplex.base.messages import AsrChunk
    from duplex.runtime.service import load_asr
    from tests.speech import silence, synthesize

    stage = load_asr(load_profile("cpu-streaming").component("asr"))
    audio = np.concatenate([silence(0.2), synthesize("What is the capital of France?"), silence(0.3)])
    state, texts = stage.init_state(), []
    for start in range(0, audio.size, 8000):
        last = start + 8000 >= audio.size
        out, state = stage.step(state, AsrChunk(audio[start : start + 8000], transcribe=True, final=last))
        texts.append(out.text)
    assert "capital" in texts[-1].lower() and "france" in texts[-1].lower(), texts
    assert out.p_complete is not None
    assert any(t for t in texts[:-1])  # words arrive before the final
