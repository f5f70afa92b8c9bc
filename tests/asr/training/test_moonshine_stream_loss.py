"""The streamed recogniser's decoder loss: where the KL teaches and where only the known text does."""

import pytest
import torch

from asr.moonshine import EOS
from asr.training.train_moonshine_stream import decoder_loss

VOCAB = max(EOS, 10) + 1


class TableDecoder:
    """A fake decoder: the frames *are* the next-token logits ([1, T, V]); the ids only set how many are read."""

    def __call__(self, ids: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        return frames[:, : ids.shape[1]]


def _logits(argmaxes: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, len(argmaxes), VOCAB, generator=g)
    for i, t in enumerate(argmaxes):
        x[0, i, t] = 8.0
    return x


def test_kl_where_right_drops_only_the_positions_where_the_teacher_mishears():
    tokens = [3, 4, 5]  # the known text; the positions predict 3, 4, 5, EOS
    teacher = _logits([3, 7, 5, EOS], seed=1)  # the teacher mishears the second token
    student = _logits([3, 4, 6, EOS], seed=2).requires_grad_()
    kl_all, ce_all, m = decoder_loss(TableDecoder(), student, teacher, tokens)
    kl_right, ce_right, m_right = decoder_loss(TableDecoder(), student, teacher, tokens, kl_where="right")
    assert m["teacher_right"] == pytest.approx(0.75) == m_right["teacher_right"]
    assert torch.equal(ce_all, ce_right)  # the text's cross-entropy is the same either way
    t, s = torch.log_softmax(teacher[0], -1), torch.log_softmax(student[0].detach(), -1)
    per = (t.exp() * (t - s)).sum(-1)
    assert kl_all.item() == pytest.approx(float(per.mean()), rel=1e-5)
    assert kl_right.item() == pytest.approx(float((per[0] + per[2] + per[3]) / 4), rel=1e-5)
    # at the misheard position the KL sends no gradient: only the cross-entropy pulls towards the text
    kl_right.backward()
    assert student.grad is not None
    assert torch.count_nonzero(student.grad[0, 1]) == 0
    assert torch.count_nonzero(student.grad[0, 2]) > 0


def test_kl_where_is_checked():
    x = _logits([3, EOS], seed=0)
    with pytest.raises(ValueError, match="kl_where"):
        decoder_loss(TableDecoder(), x, x, [3], kl_where="wrong")
