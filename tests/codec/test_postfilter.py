"""The codec's global-variance postfilter on a tiny seeded codec: folded into the head it equals the affine map
on the decoded coefficients, alpha 0 changes nothing, alpha 1 gives the teacher's mean and std on the frames
it was fitted on, the written file loads with the same latent (so a flow model trained on it still fits), and a
file that already has one is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from codec.speech_codec import latent_sha256, load_codec
from codec.training.postfilter import affine, envelope_stats, fold, main
from tests.codec.test_speech_codec import TINY, tiny_codec


def examples(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Random utterances: audio and teacher envelopes drawn around the codec's PCA means."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        frames = int(rng.integers(30, 60)) * TINY.down
        audio = (0.1 * rng.standard_normal(frames * 300)).astype(np.float32)
        lh = (-3.0 + 0.5 * rng.standard_normal((frames, 601))).astype(np.float32)
        nz = (-6.0 + 0.5 * rng.standard_normal((frames, 601))).astype(np.float32)
        out.append((audio, lh, nz))
    return out


def latent(m, b: int = 2, n: int = 7, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, m.fsq.codebook_size, (b, n, m.cfg.groups), generator=g)
    return m.fsq.from_codes(codes)


def test_folded_head_equals_the_affine_map_on_its_coefficients() -> None:
    m = tiny_codec(2)
    stats = envelope_stats(m, examples(3))
    zq = latent(m)
    with torch.no_grad():
        before = m.decode_features(zq)
        fold(m, stats, 1.5)
        after = m.decode_features(zq)
    for name in ("lh", "nz"):
        scale, shift = affine(stats[name], 1.5)
        np.testing.assert_allclose(getattr(after, name), getattr(before, name) * scale + shift, atol=1e-5)
    # voicing and F0 are not touched
    assert torch.equal(after.voicing, before.voicing) and torch.equal(after.log_f0, before.log_f0)


def test_alpha_zero_is_the_identity() -> None:
    m = tiny_codec(2)
    w, b = m.head.weight.clone(), m.head.bias.clone()
    fold(m, envelope_stats(m, examples(2)), 0.0)
    torch.testing.assert_close(m.head.weight, w)
    torch.testing.assert_close(m.head.bias, b)


def test_alpha_one_gives_the_teachers_mean_and_std_on_the_fitted_frames() -> None:
    m = tiny_codec(4)
    ex = examples(3, seed=5)
    stats = envelope_stats(m, ex)
    fold(m, stats, 1.0)
    again = envelope_stats(m, ex)
    for name in ("lh", "nz"):
        torch.testing.assert_close(again[name]["m_p"], stats[name]["m_t"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(again[name]["s_p"], stats[name]["s_t"], atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(again[name]["s_t"], stats[name]["s_t"])


def test_written_file_keeps_the_latent_and_refuses_a_second_fold(tmp_path: Path) -> None:
    m = tiny_codec(3)
    src = tmp_path / "in" / "speech_codec.safetensors"
    src.parent.mkdir()
    save_file(
        {k: v.contiguous() for k, v in m.state_dict().items()},
        str(src),
        metadata={"config": json.dumps(TINY.to_dict()), "step": "7"},
    )
    src.with_suffix(".json").write_text(json.dumps({"step": 7, "train_command": "x"}))
    out = main(
        ["--weights", str(src), "--alpha", "2", "--stats", "2", "--out", str(tmp_path / "out")],
        examples=lambda n: examples(n),
    )
    folded = load_codec(str(out))
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["step"] == 7 and meta["postfilter"]["alpha"] == 2.0 and meta["bytes"] == out.stat().st_size
    assert latent_sha256(str(out)) == latent_sha256(str(src))
    assert not torch.equal(folded.head.weight, m.head.weight)
    # the encoder is bit for bit the same: codes of the same audio are equal
    audio = torch.from_numpy(examples(1, seed=9)[0][0])[None]
    assert torch.equal(folded.encode(audio), m.encode(audio))
    with pytest.raises(SystemExit, match="already has one"):
        main(["--weights", str(out), "--alpha", "1", "--out", str(tmp_path / "again")], examples=examples)
    # writing over the source folder works (everything is read first)
    main(["--weights", str(src), "--alpha", "1", "--stats", "2", "--out", str(src.parent)], examples=examples)
    assert json.loads(src.with_suffix(".json").read_text())["postfilter"]["alpha"] == 1.0
