"""The streamed recogniser's training schedule: warm-up, the decay phase's cosine, and the weight average."""

import math

import pytest
import torch

from asr.training.train_moonshine_stream import WeightAverage, lr_at


def test_lr_warms_up_then_holds_without_a_decay_phase():
    cfg = {"lr": 1e-4, "opt_start": 100}
    assert lr_at(cfg, 100, 50) == pytest.approx(1e-4 / 50)
    assert lr_at(cfg, 149, 50) == pytest.approx(1e-4)
    assert lr_at(cfg, 5000, 50) == pytest.approx(1e-4)


def test_decay_phase_falls_along_a_cosine_to_the_end_ratio_and_holds():
    cfg = {"lr": 1e-4, "opt_start": 0, "decay": {"start": 1000, "steps": 400, "end": 0.1}}
    assert lr_at(cfg, 1000, 50) == pytest.approx(1e-4)
    assert lr_at(cfg, 1200, 50) == pytest.approx(1e-4 * (0.1 + 0.9 * 0.5))
    assert lr_at(cfg, 1400, 50) == pytest.approx(1e-5)
    assert lr_at(cfg, 9999, 50) == pytest.approx(1e-5)
    rates = [lr_at(cfg, s, 50) for s in range(1000, 1401)]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    assert lr_at(cfg, 1100, 50) == pytest.approx(1e-4 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))))


def test_weight_average_is_the_uniform_mean_and_survives_a_checkpoint():
    avg = WeightAverage()
    with pytest.raises(ValueError):
        avg.mean()
    avg.add({"a": torch.tensor([1.0, 2.0])})
    resumed = WeightAverage(avg.state())  # what a checkpoint carries
    resumed.add({"a": torch.tensor([3.0, 6.0])})
    resumed.add({"a": torch.tensor([2.0, 1.0])})
    assert resumed.n == 3
    assert torch.allclose(resumed.mean()["a"], torch.tensor([2.0, 3.0]))
    assert avg.n == 1  # the checkpointed state is not changed by the resumed run's additions
