"""The Moonshine-feature distillation's targets follow the augmentation's time map; its loss and head."""

from __future__ import annotations

import numpy as np
import torch

from asr.training.distill import (
    DistillHead,
    distill_loss,
    fit_frames,
    frame_norm,
    student_targets,
    teacher_times,
)


def _ramp_teacher(seconds: float, dim: int = 4) -> np.ndarray:
    """A teacher whose every dimension is the clean time (s) at the frame's centre: targets then read
    back which clean moment each student frame was mapped to."""
    n = int(seconds * 16000 / 384)
    return np.repeat(teacher_times(n)[:, None], dim, axis=1).astype(np.float32)


def test_identity_map_gives_each_frame_its_own_time() -> None:
    tg, mask = student_targets(_ramp_teacher(3.0), 0.0, 1.0, 30, 3.0)
    inside = np.flatnonzero(mask)
    # frames wholly inside the teacher's frame centres read their own centre time
    for f in inside[(inside > 1) & (inside < 25)]:
        assert abs(tg[f, 0] - (0.08 * f + 0.04)) < 1e-3


def test_lead_silence_and_speed_change_move_the_targets() -> None:
    offset, scale = 0.4, 1.1  # 0.4 s of added silence, then the speech 10 % slower
    tg, mask = student_targets(_ramp_teacher(2.0), offset, scale, 40, 2.0)
    # nothing before the speech starts, nothing after it ends
    assert not mask[: int(offset / 0.08)].any()
    assert not mask[int((offset + scale * 2.0) / 0.08) + 1 :].any()
    f = int(np.flatnonzero(mask)[5])
    expected = (0.08 * f + 0.04 - offset) / scale  # the clean moment under that frame's centre
    assert abs(tg[f, 0] - expected) < 2e-3
    assert (tg[~mask] == 0).all()


def test_frame_norm_is_zero_mean_unit_variance() -> None:
    h = np.random.default_rng(0).normal(3.0, 5.0, (7, 416))
    n = frame_norm(h)
    assert np.allclose(n.mean(-1), 0, atol=1e-6) and np.allclose(n.std(-1), 1, atol=1e-4)


def test_loss_is_zero_on_the_target_and_ignores_masked_frames() -> None:
    torch.manual_seed(0)
    target = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    pred = target.clone()
    pred[~mask] = 100.0  # wrong only where there is no target
    assert float(distill_loss(pred, target, mask)) < 1e-5
    assert float(distill_loss(-target, target, mask)) > 2.0  # opposite: L1 + 2 (cosine -1)
    assert float(distill_loss(pred, target, torch.zeros_like(mask))) == 0.0


def test_head_sees_the_whole_utterance_and_fits_frames() -> None:
    torch.manual_seed(0)
    head = DistillHead(16, width=32, heads=4, teacher_dim=8).eval()
    x = torch.randn(1, 16, 10)
    y = head(x, torch.tensor([10]))
    assert y.shape == (1, 10, 8)
    x2 = x.clone()
    x2[:, :, 9] += 1.0  # a change at the last frame reaches the first: full context, not causal
    assert not torch.allclose(head(x2, torch.tensor([10]))[0, 0], y[0, 0])
    # padding beyond the length changes nothing inside it
    x3 = torch.cat([x, torch.randn(1, 16, 4)], dim=2)
    assert torch.allclose(head(x3, torch.tensor([10]))[:, :10], y, atol=1e-5)
    assert fit_frames(torch.ones(2, 3, 4), 5).shape == (2, 5, 4)
    assert fit_frames(torch.ones(2, 7), 5).shape == (2, 5)
