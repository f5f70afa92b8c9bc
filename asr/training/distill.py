"""Distilling what Moonshine hears into the streaming FastConformer (training only, dropped at export).

The teacher is Moonshine base-en's encoder (`encoder_model.ort`, 416-d frames every 24 ms, full context),
run in onnxruntime on each *clean* pool example once, when the pool is made (~20 ms per second of audio on
one thread, shared by the pool's epochs). Each frame is layer-normalised (no affine), so every dimension
has a comparable scale and no frame dominates by loudness.

The student is the streaming encoder's output (80 ms frames, whatever lookahead the batch drew) with a
training-only head on top: a projection, one **full-context** transformer layer and a projection to the
teacher's 416 dimensions. The full-context layer lets a causal encoder match a non-causal teacher without
having to predict the future; it is dropped at export like the phone head.

Targets follow the augmentation's time map (`data.augment_timed`: a moment t of the clean audio is at
`offset + scale * t`): each student frame [0.08 f, 0.08 f + 0.08) s is mapped back to clean time and the
teacher is averaged over it (linear interpolation at four points). Frames outside the clean speech (the
added lead and tail silence) carry no target.

Loss: masked mean of L1 + (1 - cosine) per frame.
"""

from __future__ import annotations

import numpy as np
import torch

from duplex.base.audio import SAMPLE_RATE

TEACHER_DIM = 416
TEACHER_HOP = 384  # samples per Moonshine encoder frame (conv strides 64 x 3 x 2)
TEACHER_CENTER = 447  # sample at the centre of frame 0's receptive field (kernels 127, 7, 3)
STUDENT_FRAME_S = 0.08
_POINTS = (0.125, 0.375, 0.625, 0.875)  # where in a student frame the teacher is sampled


class MoonshineTeacher:
    """Moonshine base-en's encoder on one thread; `features(audio)` -> float16 [T, 416], frame-normalised."""

    def __init__(self, threads: int = 1) -> None:
        from asr.moonshine import model_file, ort_session

        self._session = ort_session(model_file("encoder_model.ort"), threads)

    def features(self, audio: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(audio, dtype=np.float32).reshape(1, -1)
        if x.shape[1] < SAMPLE_RATE // 10:
            x = np.pad(x, ((0, 0), (0, SAMPLE_RATE // 10 - x.shape[1])))
        h = self._session.run(None, {"input_values": x})[0][0].astype(np.float32)
        return frame_norm(h).astype(np.float16)


def frame_norm(h: np.ndarray) -> np.ndarray:
    """Each frame to zero mean and unit variance over its dimensions (a layer norm without affine)."""
    mu = h.mean(axis=-1, keepdims=True)
    sd = h.std(axis=-1, keepdims=True)
    return (h - mu) / (sd + 1e-5)


def teacher_times(n: int) -> np.ndarray:
    """The clean-audio time (s) at the centre of each of `n` teacher frames."""
    return (TEACHER_CENTER + TEACHER_HOP * np.arange(n)) / SAMPLE_RATE


def student_targets(
    teacher: np.ndarray, offset: float, scale: float, n_frames: int, clean_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """Teacher features on the student's `n_frames` 80 ms frames of the augmented audio, whose time map is
    (offset, scale); returns (targets float32 [n_frames, D], mask bool [n_frames]). A frame gets a target
    only when all of it falls inside the clean audio's [0, clean_s)."""
    n_t, dim = teacher.shape
    targets = np.zeros((n_frames, dim), np.float32)
    mask = np.zeros(n_frames, bool)
    if n_t == 0 or n_frames == 0:
        return targets, mask
    starts = np.arange(n_frames) * STUDENT_FRAME_S
    clean_start = (starts - offset) / scale
    clean_end = (starts + STUDENT_FRAME_S - offset) / scale
    mask = (clean_start >= 0) & (clean_end <= clean_s)
    if not mask.any():
        return targets, mask
    t_frames = teacher_times(n_t)
    feats = teacher.astype(np.float32)
    idx = np.arange(n_t, dtype=np.float64)
    acc = np.zeros((n_frames, dim), np.float32)
    for p in _POINTS:
        t = (starts + p * STUDENT_FRAME_S - offset) / scale
        pos = np.interp(t, t_frames, idx)  # clamps to the first / last frame
        lo = np.floor(pos).astype(int)
        hi = np.minimum(lo + 1, n_t - 1)
        w = (pos - lo)[:, None].astype(np.float32)
        acc += (1 - w) * feats[lo] + w * feats[hi]
    targets[mask] = acc[mask] / len(_POINTS)
    return targets, mask


class DistillHead(torch.nn.Module):
    """Training-only: encoder output [B, d_model, T] -> teacher space [B, T, 416] through one full-context
    transformer layer."""

    def __init__(
        self, d_model: int, width: int = 256, heads: int = 4, teacher_dim: int = TEACHER_DIM
    ) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(d_model, width)
        self.layer = torch.nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.out = torch.nn.Linear(width, teacher_dim)

    def forward(self, encoded: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.inp(encoded.transpose(1, 2))
        pad = torch.arange(x.shape[1], device=x.device)[None, :] >= lengths[:, None]
        return self.out(self.layer(x, src_key_padding_mask=pad))


def distill_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over frames of L1 (mean over dimensions) + (1 - cosine); 0 when nothing is masked in."""
    m = mask.to(pred.dtype)
    n = m.sum()
    if float(n) == 0:
        return pred.sum() * 0.0
    l1 = (pred - target).abs().mean(-1)
    cos = torch.nn.functional.cosine_similarity(pred, target, dim=-1, eps=1e-6)
    return ((l1 + 1 - cos) * m).sum() / n


def fit_frames(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T, ...] cropped or zero-padded to `n` frames."""
    if x.shape[1] >= n:
        return x[:, :n]
    pad = [0, 0] * (x.dim() - 2) + [0, n - x.shape[1]]
    return torch.nn.functional.pad(x, pad)
