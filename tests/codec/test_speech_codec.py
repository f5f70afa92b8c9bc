"""FSQ, streaming == offline decode, batching, determinism and exact resume, on tiny seeded models."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from codec.dsp_vocoder import HarmonicNoiseVocoder
from codec.fsq import FSQ, round_ste
from codec.speech_codec import CodecConfig, DecoderState, SpeechCodec


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small tensors: one thread is fastest and leaves the other core to whatever else runs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TINY = CodecConfig(
    n_mels=16,
    enc_fast_dim=16,
    enc_fast_blocks=1,
    enc_dim=24,
    enc_blocks=1,
    enc_lookahead=2,
    groups=2,
    dec_dim=24,
    dec_blocks=2,
    dec_fast_dim=16,
    dec_fast_blocks=2,
    kernel=5,
    n_pca=8,
)


def tiny_codec(seed: int = 0) -> SpeechCodec:
    torch.manual_seed(seed)
    m = SpeechCodec(TINY).eval()
    g = torch.Generator().manual_seed(seed)
    for name in ("lh", "nz"):
        q, _ = torch.linalg.qr(torch.randn(601, TINY.n_pca, generator=g))
        getattr(m, f"{name}_basis").copy_(q.T)
        getattr(m, f"{name}_mean").fill_(-3.0 if name == "lh" else -6.0)
    with torch.no_grad():  # make the voicing/F0 head produce voiced frames around 200 Hz
        m.head.bias[0] = 2.0
        m.head.bias[1] = 0.0
    return m


def random_codes(m: SpeechCodec, b: int, n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, m.fsq.codebook_size, (b, n, m.cfg.groups), generator=g)


# -- FSQ ------------------------------------------------------------------------------------------------
def test_round_ste_passes_gradient_straight_through():
    x = torch.linspace(-3, 3, 13, requires_grad=True)
    round_ste(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    assert torch.equal(round_ste(x.detach()), torch.round(x.detach()))


def test_fsq_codes_in_range_and_invertible():
    q = FSQ((8, 5, 5, 5), groups=3)
    z = torch.randn(500, 12) * 3
    zq, codes = q(z)
    assert codes.dtype == torch.int64 and codes.shape == (500, 3)
    assert int(codes.min()) >= 0 and int(codes.max()) < 1000
    assert torch.allclose(q.from_codes(codes), zq)
    assert zq.abs().max() <= 1.0
    every = torch.arange(1000).reshape(-1, 1).repeat(1, 3)
    assert torch.equal(q.codes(q.from_codes(every)), every)
    assert math.isclose(q.bits_per_frame, 3 * math.log2(1000))


def test_fsq_has_gradient_and_reaches_every_level():
    q = FSQ((8, 5, 5, 5))
    z = torch.linspace(-6, 6, 400).reshape(100, 4).requires_grad_(True)
    q.quantize(z).sum().backward()
    assert (z.grad.abs() > 0).all()
    d = q.digits(q(z.detach())[1])[:, 0]
    for i, L in enumerate(q.levels):
        assert set(d[:, i].tolist()) == set(range(L))


def test_fsq_snap_maps_predictions_to_the_nearest_grid_point():
    q = FSQ((8, 5, 5, 5), groups=3)
    zq, codes = q(torch.randn(200, 12) * 3)
    assert torch.equal(q.snap(zq), zq)  # grid points stay
    assert torch.equal(q.codes(q.snap(zq + 0.04 * torch.randn_like(zq).clamp(-1, 1))), codes)
    far = q.snap(torch.full((1, 12), 5.0))  # out of range: the top level of each dimension
    assert torch.equal(q.codes(far), torch.full((1, 3), 999))
    assert torch.equal(q.codes(q.snap(torch.full((1, 12), -5.0))), torch.zeros(1, 3, dtype=torch.long))


# -- streaming decode -----------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 40])
def test_streaming_decode_equals_offline(chunk):
    m = tiny_codec()
    codes = random_codes(m, 2, 40)
    offline = m.decode(codes)
    state, parts = m.init_state(2), []
    for i in range(0, codes.shape[1], chunk):
        a, state = m.decode_step(state, codes[:, i : i + chunk])
        assert a.shape == (2, codes[:, i : i + chunk].shape[1] * m.cfg.samples_per_code)
        parts.append(a)
    streamed = torch.cat([*parts, m.flush(state)], 1)
    assert streamed.shape == offline.shape == (2, 40 * 900 + m.cfg.output_delay)
    assert offline.abs().max() > 1e-3  # not trivially silent
    torch.testing.assert_close(streamed, offline, atol=2e-5, rtol=1e-4)


def test_uneven_chunking_equals_offline():
    m = tiny_codec(3)
    codes = random_codes(m, 1, 30, seed=5)
    offline = m.decode(codes)
    state, parts, i = m.init_state(1), [], 0
    for c in (1, 4, 2, 9, 3, 11):
        a, state = m.decode_step(state, codes[:, i : i + c])
        parts.append(a)
        i += c
    torch.testing.assert_close(torch.cat([*parts, m.flush(state)], 1), offline, atol=2e-5, rtol=1e-4)


def test_batched_step_equals_one_by_one():
    m = tiny_codec()
    codes = [random_codes(m, 1, 12, seed=s) for s in (1, 2, 3)]
    # sessions at different points of their streams
    states = []
    for s, c in enumerate(codes):
        st = m.init_state(1)
        _, st = m.decode_step(st, c[:, : 2 + 3 * s])
        states.append(st)
    nxt = [c[:, 8:12] for c in codes]
    singles = [m.decode_step(st, x) for st, x in zip(states, nxt, strict=True)]
    audio, new_states = m.decode_step_batch(states, nxt)
    for (a1, s1), a2, s2 in zip(singles, audio, new_states, strict=True):
        torch.testing.assert_close(a2, a1, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(m.flush(s2), m.flush(s1), atol=1e-5, rtol=1e-4)
    stacked = DecoderState.stack(new_states)
    assert stacked.vocoder.phase.shape == (3,)


def test_decode_is_deterministic():
    codes = random_codes(tiny_codec(), 1, 20)
    a = tiny_codec(0).decode(codes)
    b = tiny_codec(0).decode(codes)
    assert torch.equal(a, b)


def test_encode_shapes_and_round_trip_runs():
    m = tiny_codec()
    audio = torch.randn(2, 24000) * 0.1
    codes = m.encode(audio)
    assert codes.shape == (2, 24000 // 900, m.cfg.groups)
    assert m.decode(codes).shape == (2, codes.shape[1] * 900 + m.cfg.output_delay)
    assert math.isclose(CodecConfig().bitrate, 80 / 3 * 3 * math.log2(1000))
    assert CodecConfig().bitrate < 1000


def _voc_inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    f0 = torch.where(
        torch.rand(1, n, generator=g) > 0.3, 150 + 50 * torch.rand(1, n, generator=g), torch.zeros(1, n)
    )
    return f0, -3 + torch.randn(1, n, 601, generator=g), -7 + torch.randn(1, n, 601, generator=g)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_vocoder_with_envelope_delay_streams_as_offline(chunk):
    v = HarmonicNoiseVocoder(env_delay=2)
    n = 23
    f0, lh, nz = _voc_inputs(n)
    off = v(f0, lh, nz)
    assert off.shape == (1, n * 300 + v.output_delay) and v.output_delay == 900 + 600
    st, parts = v.init_state(1), []
    for i in range(0, n, chunk):
        a, st = v.step(st, f0[:, i : i + chunk], lh[:, i : i + chunk], nz[:, i : i + chunk])
        assert a.shape[1] == 300 * min(chunk, n - i)
        parts.append(a)
    torch.testing.assert_close(torch.cat([*parts, v.flush(st)], 1), off, atol=2e-5, rtol=1e-4)


def test_envelope_delay_applies_frame_k_to_the_pulses_of_block_k_plus_d():
    """With env_delay d, the envelopes of frame k shape pulse block k + d: the same audio as no delay with
    the envelopes shifted d frames later (silence in front), for every sample of the n blocks."""
    from codec.dsp_vocoder import SILENT_LOG

    n, d = 20, 2
    f0, lh, nz = _voc_inputs(n, seed=3)
    delayed = HarmonicNoiseVocoder(env_delay=d)(f0, lh, nz, flush=False)
    pad = torch.full((1, d, 601), SILENT_LOG)
    shifted = HarmonicNoiseVocoder()(
        f0, torch.cat([pad, lh[:, :-d]], 1), torch.cat([pad, nz[:, :-d]], 1), flush=False
    )
    torch.testing.assert_close(delayed, shifted, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="env_delay"):
        HarmonicNoiseVocoder(env_delay=-1)


def test_the_envelope_delay_does_not_change_the_latent_fingerprint():
    """A flow model predicts the latent; how the decoder's features become audio is not part of it."""
    from dataclasses import replace

    from codec.speech_codec import latent_fingerprint

    m = tiny_codec()
    sd = m.state_dict()
    fp = {d: latent_fingerprint(json.dumps(replace(TINY, env_delay=d).to_dict()), sd) for d in (0, 2)}
    assert fp[0] == fp[2] == m.latent_sha256()
    no_field = {
        k: v for k, v in TINY.to_dict().items() if k != "env_delay"
    }  # a file written before the field
    assert latent_fingerprint(json.dumps(no_field), sd) == fp[0]
    assert latent_fingerprint(json.dumps(replace(TINY, groups=3).to_dict()), sd) != fp[0]


def test_vocoder_streaming_equals_offline():
    v = HarmonicNoiseVocoder()
    g = torch.Generator().manual_seed(0)
    n = 25
    f0 = torch.where(
        torch.rand(1, n, generator=g) > 0.3, 150 + 50 * torch.rand(1, n, generator=g), torch.zeros(1, n)
    )
    lh = -3 + torch.randn(1, n, 601, generator=g)
    nz = -7 + torch.randn(1, n, 601, generator=g)
    off = v(f0, lh, nz)
    st, parts = v.init_state(1), []
    for i in range(0, n, 4):
        a, st = v.step(st, f0[:, i : i + 4], lh[:, i : i + 4], nz[:, i : i + 4])
        parts.append(a)
    torch.testing.assert_close(torch.cat([*parts, v.flush(st)], 1), off, atol=2e-5, rtol=1e-4)


def test_vocoder_pulse_train_has_the_right_pitch():
    v = HarmonicNoiseVocoder()
    n = 80
    f0 = torch.full((1, n), 200.0)
    lh = torch.zeros(1, n, 601)
    nz = torch.full((1, n, 601), -20.0)
    y = v(f0, lh, nz)[0, 3000:15000].numpy()
    spec = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    hz = np.fft.rfftfreq(len(y), 1 / 24000)
    at = lambda f: spec[np.abs(hz - f) < 3].max()  # noqa: E731
    harmonics = [at(200 * h) for h in (1, 2, 3, 5)]
    between = [at(200 * h + 100) for h in (1, 2, 3, 5)]
    assert min(harmonics) > 20 * max(between)


# -- training: exact resume -----------------------------------------------------------------------------
def fake_source(index: int) -> dict:
    r = np.random.default_rng(index)
    frames = int(r.integers(40, 90))
    t = np.arange(frames * 300) / 24000
    f0 = np.where(r.random(frames) > 0.3, 180 + 40 * r.random(frames), 0.0).astype(np.float32)
    audio = (0.1 * np.sin(2 * np.pi * 200 * t) + 0.01 * r.standard_normal(len(t))).astype(np.float32)
    return {
        "audio": audio,
        "f0": f0,
        "lh": (-4 + r.standard_normal((frames, 601))).astype(np.float32),
        "nz": (-8 + r.standard_normal((frames, 601))).astype(np.float32),
    }


def make_trainer(**kw):
    from codec.training.train_codec import Trainer

    return Trainer(
        TINY,
        fake_source,
        pool_size=6,
        batch=3,
        crop=30,
        refresh=1,
        pca_examples=4,
        seed=7,
        log=lambda _: None,
        **kw,
    )


def test_checkpoint_resume_gives_identical_next_step(tmp_path):
    from codec.training.train_codec import save_checkpoint

    a = make_trainer()
    a.start()
    for _ in range(3):
        a.step()
    save_checkpoint(tmp_path / "ck.pt", **a.state_dict())
    expected = [a.step()["total"] for _ in range(2)]

    b = make_trainer()
    b.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=False))
    b.start()
    got = [b.step()["total"] for _ in range(2)]
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert b.step_n == a.step_n and b.pos == a.pos


def test_export_round_trip(tmp_path):
    from codec.speech_codec import load_codec
    from codec.training.train_codec import CKPT, export, save_checkpoint

    t = make_trainer()
    t.start()
    t.step()
    save_checkpoint(tmp_path / CKPT, **t.state_dict())
    path = export(tmp_path, tmp_path / "w")
    m = load_codec(str(path))
    assert m.cfg == TINY
    codes = random_codes(m, 1, 6)
    ref = t.ema.eval().decode(codes)
    torch.testing.assert_close(m.decode(codes), ref, atol=5e-3, rtol=5e-2)


def _export(trainer, folder):
    from codec.training.train_codec import CKPT, export, save_checkpoint

    folder.mkdir()
    save_checkpoint(folder / CKPT, **trainer.state_dict())
    return export(folder, folder / "w")


def test_frozen_encoder_keeps_the_latent_and_its_fingerprint(tmp_path):
    """--freeze-encoder trains the decoder only: encoder tensors (model and EMA) stay bit for bit, so the
    exported codec has another sha256 but the same latent fingerprint; the checkpoint says it is frozen."""
    from codec.speech_codec import latent_sha256
    from codec.training.train_codec import is_encoder_param

    t = make_trainer()
    t.start()
    t.step()
    before = _export(t, tmp_path / "a")

    f = make_trainer(freeze_encoder=True)  # as `--init`: model and EMA from the shipped weights
    f.model.load_state_dict(t.ema.state_dict())
    f.ema.load_state_dict(t.ema.state_dict())
    f.pca_ready, f.pos = True, t.pos
    enc0 = {k: v.clone() for k, v in f.model.state_dict().items() if is_encoder_param(k)}
    dec0 = {k: v.clone() for k, v in f.model.state_dict().items() if k.startswith("dec_")}
    f.start()
    for _ in range(3):
        f.step()
    for m in (f.model, f.ema):
        for k, v in m.state_dict().items():
            if is_encoder_param(k):
                assert torch.equal(v, enc0[k]), k
    assert any(not torch.equal(v, dec0[k]) for k, v in f.model.state_dict().items() if k in dec0)
    after = _export(f, tmp_path / "b")
    assert before.read_bytes() != after.read_bytes()
    assert latent_sha256(str(before)) == latent_sha256(str(after))
    assert f.state_dict()["freeze_encoder"] is True

    t.step()  # the encoder trained on: another latent
    assert latent_sha256(str(_export(t, tmp_path / "c"))) != latent_sha256(str(before))


def test_a_failing_evaluation_is_logged_and_training_goes_on():
    from codec.training.train_codec import guarded

    lines: list[str] = []

    def broken() -> None:
        raise AttributeError("'FSQ' object has no attribute 'snap'")

    guarded("gate", broken, lines.append)  # does not raise
    assert lines == ["gate failed (AttributeError: 'FSQ' object has no attribute 'snap'); training goes on"]


def test_a_wider_codec_warm_starts_from_an_export(tmp_path):
    """--warm-start: a codec with another FSQ shape copies every tensor whose name and shape match (the
    encoder's and decoder's bodies, heads, PCA bases) and starts only the latent's projections new."""
    from dataclasses import replace

    from codec.training.train_codec import Trainer, warm_start

    path = _export(make_trainer(), tmp_path / "a")
    (path.with_suffix(".json")).write_text('{"examples_seen": 123}')
    wide = replace(TINY, levels=(5, 5, 5, 5), groups=TINY.groups + 1)
    b = Trainer(wide, fake_source, pool_size=6, batch=3, crop=30, pca_examples=4, log=lambda _: None)
    copied, new = warm_start(b, path)
    assert set(new) == {"enc_out.weight", "enc_out.bias", "dec_in.weight"}
    from safetensors.torch import load_file

    src = load_file(str(path))
    for k in copied:
        assert torch.equal(b.model.state_dict()[k], src[k].float()), k
        assert torch.equal(b.ema.state_dict()[k], src[k].float()), k
    assert b.pca_ready and b.pos == 123 and b.step_n == 0
    b.start()
    assert math.isfinite(b.step()["total"])


def test_levels_must_be_integers_of_at_least_two():
    import argparse

    from codec.training.train_codec import parse_levels

    assert parse_levels("5,5,5,5") == (5, 5, 5, 5)
    for bad in ("5,x", "5,1", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_levels(bad)


def test_a_run_keeps_the_shape_it_was_trained_or_initialised_with(tmp_path):
    from dataclasses import replace

    from codec.speech_codec import CodecConfig
    from codec.training.train_codec import resolve_config

    assert resolve_config(None, None, (5, 5, 5, 5), 4) == replace(
        CodecConfig(), levels=(5, 5, 5, 5), groups=4
    )
    assert resolve_config(None, None, None, None) == CodecConfig()
    assert resolve_config(TINY.to_dict(), None, None, None) == TINY
    path = _export(make_trainer(), tmp_path / "a")
    assert resolve_config(None, path, None, TINY.groups) == TINY  # from the file's metadata
    for saved, init in ((TINY.to_dict(), None), (None, path)):
        with pytest.raises(ValueError, match="keeps"):
            resolve_config(saved, init, (5, 5, 5, 5), None)
    with pytest.raises(ValueError, match="groups"):
        resolve_config(None, None, None, 0)


def test_envelope_coefs_invert_the_decoders_projection() -> None:
    """The decoder's target (normalised PCA coefficients) and `expand`'s projection back to 601 bins agree."""
    from codec.speech_codec import Features

    m = tiny_codec()
    with torch.no_grad():
        m.lh_std.uniform_(0.5, 2.0)
        m.nz_std.uniform_(0.5, 2.0)
    g = torch.Generator().manual_seed(3)
    k = TINY.n_pca
    feats = Features(
        torch.ones(1, 5),
        torch.zeros(1, 5),
        torch.randn(1, 5, k, generator=g),
        torch.randn(1, 5, k, generator=g),
    )
    _, lh, nz = m.expand(feats)
    assert torch.allclose(m.envelope_coefs("lh", lh), feats.lh, atol=1e-4)
    assert torch.allclose(m.envelope_coefs("nz", nz), feats.nz, atol=1e-4)
    with pytest.raises(ValueError, match="lh or nz"):
        m.envelope_coefs("f0", lh)


# -- training: the spectral loss (the vocoder's output against the teacher features') -------------------
def _teacher_batch(m: SpeechCodec, b: int = 2, t: int = 48, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    f0 = torch.where(torch.rand(b, t, generator=g) > 0.3, 150 + 60 * torch.rand(b, t, generator=g), 0.0)
    return {
        "f0": f0,
        "lh": torch.randn(b, t, TINY.n_pca, generator=g),
        "nz": torch.randn(b, t, TINY.n_pca, generator=g),
        "mask": torch.ones(b, t),
    }


def _teacher_features(batch: dict[str, torch.Tensor]):
    from codec.speech_codec import LOG_F0_MEAN, LOG_F0_STD, Features

    voiced = batch["f0"] > 40
    log_f0 = (torch.log(batch["f0"].clamp(min=40)) - LOG_F0_MEAN) / LOG_F0_STD
    voicing = torch.where(voiced, 5.0, -5.0)
    return Features(voicing, log_f0, batch["lh"].clone(), batch["nz"].clone())


def test_spectral_loss_is_zero_for_the_teachers_own_features():
    from codec.training.train_codec import spectral_loss

    m = tiny_codec()
    batch = _teacher_batch(m)
    assert float(spectral_loss(m, _teacher_features(batch), batch)) < 1e-3


def test_spectral_loss_trains_the_envelopes_and_leaves_pitch_to_its_own_loss():
    from codec.training.train_codec import spectral_loss

    m = tiny_codec()
    batch = _teacher_batch(m)
    feats = _teacher_features(batch)
    g = torch.Generator().manual_seed(9)
    feats.lh = (feats.lh + 2.0 * torch.randn(feats.lh.shape, generator=g)).requires_grad_()
    feats.nz = (feats.nz + 2.0 * torch.randn(feats.nz.shape, generator=g)).requires_grad_()
    feats.log_f0.requires_grad_()
    opt = torch.optim.Adam([feats.lh, feats.nz], lr=0.05)
    first = None
    for _ in range(30):
        loss = spectral_loss(m, feats, batch)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        assert feats.log_f0.grad is None  # the pulses follow a detached F0
        opt.step()
    assert first > 0.05
    assert float(spectral_loss(m, feats, batch).detach()) < 0.6 * first


def test_a_spectral_run_reports_its_loss_and_resumes_exactly(tmp_path):
    from codec.training.train_codec import save_checkpoint

    a = make_trainer(spectral=1.0)
    a.start()
    parts = a.step()
    assert parts["spectral"] > 0 and parts["total"] > parts["lh"] + parts["nz"]
    save_checkpoint(tmp_path / "ck.pt", **a.state_dict())
    expected = a.step()["total"]
    b = make_trainer(spectral=1.0)
    b.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=False))
    b.start()
    assert b.step()["total"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
