"""Tuning the codec's decoder on the flow model's predictions: the latents it reads are the flow's sample on
the FSQ grid for the chosen share of examples (a pure function of the index), the encoder's otherwise; the
encoder never moves; a run without a frozen encoder refuses such latents. Tiny seeded models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codec.training.train_codec import Trainer, encoder_latents, is_encoder_param
from tests.codec.test_speech_codec import TINY, fake_source, tiny_codec
from tts.flow_model import FlowConfig, FlowModel
from tts.training.tune_decoder import flow_latents


def tiny_flow() -> FlowModel:
    torch.manual_seed(3)
    cfg = FlowConfig(latent_dim=TINY.latent_dim, enc_dim=32, enc_layers=1, enc_heads=2, dim=32, layers=1)
    m = FlowModel(cfg)
    with torch.no_grad():  # adaLN-zero layers would otherwise predict a constant
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m.eval()


def source(index: int) -> dict:
    raw = fake_source(index)
    r = np.random.default_rng(index + 100)
    phonemes = int(r.integers(5, 12))
    return raw | {"index": index, "ids": r.integers(1, 170, phonemes), "units": r.integers(1, 6, phonemes)}


def mel_of(codec, raw: dict) -> torch.Tensor:
    mel = codec.mel(torch.from_numpy(raw["audio"])[None])[0]
    return mel[: mel.shape[0] // TINY.down * TINY.down]


def test_flow_latents_are_the_flows_sample_on_the_grid_for_its_share() -> None:
    codec, flow = tiny_codec(1), tiny_flow()
    every = flow_latents(codec, flow, share=1.0, steps=2, chunk=4)
    never = flow_latents(codec, flow, share=0.0, steps=2, chunk=4)
    half = flow_latents(codec, flow, share=0.5, steps=2, chunk=4)
    enc = encoder_latents(codec)
    from_flow = 0
    for i in range(12):
        raw = source(i)
        mel = mel_of(codec, raw)
        z, w = every(raw, mel)
        assert w == 0.0 and enc(raw, mel)[1] == 1.0  # the flow's own intonation is not the teacher's
        assert z.shape == (mel.shape[0] // TINY.down, TINY.latent_dim)
        assert torch.equal(codec.fsq.snap(z), z)  # on the grid the decoder was trained on
        assert torch.equal(every(raw, mel)[0], z)  # a pure function of the example
        e = enc(raw, mel)[0]
        assert not torch.equal(z, e)
        assert torch.equal(never(raw, mel)[0], e)
        h = half(raw, mel)[0]
        from_flow += int(torch.equal(h, z))
        assert torch.equal(h, z) or torch.equal(h, e)
    assert 2 <= from_flow <= 10


def test_the_decoder_learns_from_flow_latents_and_the_encoder_stays() -> None:
    t = Trainer(
        TINY, source, pool_size=6, batch=3, crop=30, refresh=1, pca_examples=4, seed=7, freeze_encoder=True
    )
    t.pool.latents = flow_latents(t.model, tiny_flow(), share=0.5, steps=2, chunk=4)
    enc0 = {k: v.clone() for k, v in t.model.state_dict().items() if is_encoder_param(k)}
    dec0 = t.model.dec_in.weight.detach().clone()
    t.start()
    assert all(
        it is not None and it["zq"].shape == (it["f0"].shape[0] // 3, TINY.latent_dim) for it in t.pool.items
    )
    b = t.pool.batch(np.random.default_rng(0), 3, 30, TINY.down)
    assert b["zq"].shape == (3, 10, TINY.latent_dim)
    assert sorted({it["f0_weight"] for it in t.pool.items}) == [0.0, 1.0]  # both kinds in the pool
    from codec.training.train_codec import codec_loss

    assert codec_loss(t.model, b | {"f0_weight": torch.zeros(3, 1)})[1]["f0"] == 0.0
    assert codec_loss(t.model, b | {"f0_weight": torch.ones(3, 1)})[1]["f0"] > 0.0
    losses = [t.step()["total"] for _ in range(4)]
    assert all(np.isfinite(losses))
    assert not torch.equal(t.model.dec_in.weight, dec0)
    for k, v in t.model.state_dict().items():
        if k in enc0:
            assert torch.equal(v, enc0[k]), k


def test_latents_made_outside_the_loss_need_a_frozen_encoder() -> None:
    with pytest.raises(ValueError, match="frozen encoder"):
        Trainer(TINY, source, pool_size=2, pca_examples=2, latents=encoder_latents(tiny_codec()))
