"""The acoustic end-of-turn recipe's parts: AUROC, the logistic fit, the turn store, the softened ending."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asr.training.train_end_of_turn import TurnStore, auroc, choose_l2, fit_logistic, soften_end


def test_auroc_counts_ordered_pairs_and_ties_half() -> None:
    assert auroc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert auroc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
    assert auroc([0, 1], [0.5, 0.5]) == 0.5
    assert auroc([0, 1, 1], [0.2, 0.1, 0.3]) == 0.5
    assert np.isnan(auroc([1, 1], [0.2, 0.3]))


def test_logistic_fit_separates_and_l2_is_chosen_by_held_out_engines() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400).astype(float)
    x = rng.standard_normal((400, 3)) + np.outer(2 * y - 1, [1.0, 0.0, 0.0])
    w, b = fit_logistic(x, y, 1e-3)
    assert w[0] > 1.0 and abs(w[1]) < 0.3 and abs(w[2]) < 0.3
    assert auroc(y, x @ w + b) > 0.9
    engines = np.array(["a", "b"] * 200)
    l2, table = choose_l2(x, y, engines)
    assert set(table[str(l2)]) == {"a", "b", "mean"} and table[str(l2)]["mean"] > 0.9


def test_turn_store_round_trips_and_keeps_the_index(tmp_path: Path) -> None:
    store = TurnStore(tmp_path / "t.npz")
    store.add(np.linspace(-0.5, 0.5, 1600, dtype=np.float32), 1, "flite:kal", "Hello there.", 7)
    store.add(np.zeros(800, np.float32), 0, "espeak:en", "Hello", 9)
    store.save()
    back = TurnStore(tmp_path / "t.npz")
    assert back.labels == [1, 0] and back.voices == ["flite:kal", "espeak:en"] and back.index == [7, 9]
    assert back.texts == ["Hello there.", "Hello"]
    np.testing.assert_allclose(back.float_audio(0), np.linspace(-0.5, 0.5, 1600), atol=1e-4)


def test_softened_end_fades_the_voice_and_adds_a_floor() -> None:
    t = np.arange(8000) / 16000
    voice = (0.3 * np.sin(2 * np.pi * 150 * t)).astype(np.float32)
    x = np.concatenate([voice, np.zeros(3200, np.float32)])
    out = soften_end(x, np.random.default_rng(1))
    assert out.shape == x.shape
    assert np.abs(out[7950:8000]).max() < 0.6 * np.abs(out[6000:7000]).max()  # faded into the stop
    tail = out[9000:]
    assert 0 < np.sqrt(np.mean(tail**2)) < 0.3 * 10 ** (-20 / 20)  # a noise floor, 25-60 dB down
    assert not np.array_equal(out, soften_end(x, np.random.default_rng(2)))
    np.testing.assert_array_equal(out, soften_end(x, np.random.default_rng(1)))


@pytest.mark.parametrize("n", [0, 5])
def test_empty_and_tiny_audio_soften_without_error(n: int) -> None:
    assert soften_end(np.zeros(n, np.float32), np.random.default_rng(0)).shape == (n,)
