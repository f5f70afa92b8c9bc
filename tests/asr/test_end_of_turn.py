"""The acoustic end-of-turn cue: pitch, the prosodic features, and the logistic model's file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asr.end_of_turn import N_FEATURES, WEIGHTS, EndOfTurnModel, features, pitch

SR = 16000


def _voice(f0_start: float, f0_end: float, seconds: float, seed: int = 0) -> np.ndarray:
    """A buzzy 'vowel': harmonics of a gliding F0 with a little noise."""
    t = np.arange(int(seconds * SR)) / SR
    f0 = np.linspace(f0_start, f0_end, len(t))
    phase = 2 * np.pi * np.cumsum(f0) / SR
    x = sum(np.sin(k * phase) / k for k in range(1, 8))
    rng = np.random.default_rng(seed)
    return (0.2 * x + 0.003 * rng.standard_normal(len(t))).astype(np.float32)


def _gap(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * SR), np.float32)


@pytest.mark.parametrize("f0", [90.0, 140.0, 220.0, 330.0])
def test_pitch_of_a_harmonic_tone(f0: float) -> None:
    hz, peak = pitch(_voice(f0, f0, 0.5))
    voiced = hz[5:-5]
    assert (voiced > 0).all()
    assert abs(np.median(voiced) / f0 - 1) < 0.04  # no octave errors; lag quantisation only


def test_silence_and_noise_are_unvoiced() -> None:
    hz, _ = pitch(_gap(0.3))
    assert (hz == 0).all()
    hz, _ = pitch(np.random.default_rng(0).standard_normal(SR // 2).astype(np.float32) * 0.1)
    assert (hz > 0).mean() < 0.1


def _sentence(last: tuple[float, float], seed: int = 0) -> np.ndarray:
    """Three 'syllables' at a level pitch, then a last one gliding from last[0] to last[1]."""
    parts = []
    for k in range(3):
        parts += [_voice(150.0, 150.0, 0.2, seed + k), _gap(0.05)]
    parts += [_voice(*last, 0.3, seed + 3), _gap(0.3)]
    return np.concatenate(parts)


def test_a_falling_end_and_a_level_end_differ_in_pitch_and_slope() -> None:
    fall = features(_sentence((150.0, 100.0)))
    level = features(_sentence((150.0, 150.0)))
    f0_bins = slice(40, 45)
    slope = N_FEATURES - 4
    assert fall[f0_bins][-1] < level[f0_bins][-1] - 3  # semitones below the segment's median
    assert fall[slope] < -0.5 < level[slope] + 0.5 and abs(level[slope]) < 0.3


def test_features_ignore_gain_trailing_silence_and_the_voice_s_register() -> None:
    x = _sentence((150.0, 110.0))
    base = features(x)
    assert base.shape == (N_FEATURES,)
    np.testing.assert_allclose(features(0.2 * x), base, atol=1e-3)
    # more silence after the voice stopped: the same features (the cue is where the voice stopped)
    np.testing.assert_allclose(features(np.concatenate([x, _gap(0.5)])), base, atol=1e-3)
    # an octave-higher voice saying the same melody: pitch features relative to its own median
    parts = []
    for k in range(3):
        parts += [_voice(300.0, 300.0, 0.2, k), _gap(0.05)]
    high = features(np.concatenate([*parts, _voice(300.0, 220.0, 0.3, 3), _gap(0.3)]))
    np.testing.assert_allclose(high[40:45], base[40:45], atol=0.6)


def test_a_segment_shorter_than_the_tail_still_has_features() -> None:
    out = features(_voice(120.0, 100.0, 0.15))
    assert out.shape == (N_FEATURES,) and np.isfinite(out).all()
    out = features(_gap(0.05))
    assert np.isfinite(out).all()


def test_model_round_trips_through_json_and_rejects_another_feature_size(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    model = EndOfTurnModel(
        rng.standard_normal(N_FEATURES).astype(np.float32),
        (1 + rng.random(N_FEATURES)).astype(np.float32),
        rng.standard_normal(N_FEATURES).astype(np.float32),
        0.3,
        {"what": "test"},
    )
    model.to_json(tmp_path / "m.json")
    back = EndOfTurnModel.load(tmp_path / "m.json")
    x = _sentence((150.0, 100.0))
    assert abs(back.p_complete(x) - model.p_complete(x)) < 1e-4
    assert back.meta == {"what": "test"}
    wrong = EndOfTurnModel(model.mean[:5], model.std[:5], model.weight[:5], 0.0, {})
    wrong.to_json(tmp_path / "w.json")
    with pytest.raises(ValueError, match="features have"):
        EndOfTurnModel.load(tmp_path / "w.json")


def test_the_shipped_cue_loads_and_is_a_probability() -> None:
    model = EndOfTurnModel.load(WEIGHTS)
    assert model.meta["heldout_auroc"] > 0.5
    p = model.p_complete(_sentence((150.0, 100.0)))
    assert 0.0 < p < 1.0
