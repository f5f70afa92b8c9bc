"""Metrics the verifier recipe and the judges share: focal loss, AUROC (with a bootstrap interval),
classification metrics at a threshold, and the threshold that maximises macro-F1."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch


def focal_loss(
    logits: torch.Tensor, target: torch.Tensor, alpha: float = 0.5, gamma: float = 2.0
) -> torch.Tensor:
    """Mean binary focal loss: easy examples (p_t near 1) count less, so the hard boundary cases
    (fluent-but-wrong drafts) shape the verifier. alpha weighs the positives, 1-alpha the negatives."""
    target = target.float()
    ce = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
    p = torch.sigmoid(logits)
    p_t = p * target + (1 - p) * (1 - target)
    a_t = alpha * target + (1 - alpha) * (1 - target)
    return (a_t * (1 - p_t) ** gamma * ce).mean()


def auroc(scores: Sequence[float] | torch.Tensor, labels: Sequence[int] | torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count half); nan with a single class."""
    s = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    y = torch.as_tensor(labels).reshape(-1).bool()
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    sorted_s, order = torch.sort(s)
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    avg_rank = (ends - counts + 1 + ends) / 2  # tied scores share the mean of their 1-based ranks
    ranks = torch.empty_like(s)
    ranks[order] = avg_rank[inverse]
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def classify_metrics(
    p: Sequence[float] | torch.Tensor, y: Sequence[int] | torch.Tensor, thr: float
) -> dict[str, Any]:
    """Macro-F1, commit fraction, precision/recall of committed prefixes at threshold `thr`."""
    p_t = torch.as_tensor(p, dtype=torch.float64).reshape(-1)
    y_t = torch.as_tensor(y).reshape(-1).bool()
    c = p_t >= thr
    tp, fp = int((c & y_t).sum()), int((c & ~y_t).sum())
    fn, tn = int((~c & y_t).sum()), int((~c & ~y_t).sum())

    def f1(tp_: int, fp_: int, fn_: int) -> float:
        return 2 * tp_ / (2 * tp_ + fp_ + fn_) if tp_ + fp_ + fn_ else 0.0

    n = len(y_t)
    return {
        "n": n,
        "positives": int(y_t.sum()),
        "macro_f1": (f1(tp, fp, fn) + f1(tn, fn, fp)) / 2,
        "commit_fraction": (tp + fp) / n if n else 0.0,
        "committed": tp + fp,
        "precision_committed": tp / (tp + fp) if tp + fp else float("nan"),
        "recall_acceptable": tp / (tp + fn) if tp + fn else float("nan"),
        "accuracy": (tp + tn) / n if n else float("nan"),
    }


def bootstrap_auroc(
    p: Sequence[float] | torch.Tensor, y: Sequence[int] | torch.Tensor, n: int = 1000, seed: int = 0
) -> list[float]:
    """95 % percentile-bootstrap interval of the AUROC (the held-out set is small: say how small)."""
    p_t, y_t = torch.as_tensor(p).reshape(-1), torch.as_tensor(y).reshape(-1)
    g = torch.Generator().manual_seed(seed)
    vals = []
    for _ in range(n):
        idx = torch.randint(0, len(y_t), (len(y_t),), generator=g)
        a = auroc(p_t[idx], y_t[idx])
        if math.isfinite(a):
            vals.append(a)
    vals.sort()
    if not vals:
        return [float("nan"), float("nan")]
    return [vals[int(0.025 * len(vals))], vals[min(len(vals) - 1, int(0.975 * len(vals)))]]


def tune_threshold(p: Sequence[float] | torch.Tensor, y: Sequence[int] | torch.Tensor) -> float:
    """Threshold maximising macro-F1 (midpoints between distinct scores; ties go to the higher one)."""
    s = sorted(set(float(x) for x in torch.as_tensor(p).reshape(-1).tolist()))
    cands = [(a + b) / 2 for a, b in itertools.pairwise(s)] or [0.5]
    best, best_f1 = 0.5, -1.0
    for t in cands:
        f = classify_metrics(p, y, t)["macro_f1"]
        if f >= best_f1:
            best, best_f1 = t, f
    return float(min(max(best, 1e-4), 1 - 1e-4))
