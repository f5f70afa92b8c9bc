"""Is one system's WER really different from another's on the same sentences? A paired bootstrap.

Two runs of `duplex eval tts` (or any two transcriptions of the same references) differ in a handful of sentences;
on 200 held-out sentences one word is 0.09 points, and a few long sentences with many errors move the corpus WER
by more than a point. `paired_wer_difference` resamples the sentences (the same draw for both systems) and reports
the difference of the corpus WERs with its 95 % interval, so a ship rule can tell a gain from noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from asr.training.data import normalize_text
from asr.training.wer import word_errors


def paired_wer_difference(
    references: Sequence[str],
    baseline: Sequence[str],
    candidate: Sequence[str],
    *,
    resamples: int = 5000,
    seed: int = 0,
) -> dict[str, Any]:
    """Candidate WER minus baseline WER (points) over the same references, with a 95 % bootstrap interval over
    sentences, and how many sentences each got worse or better."""
    if not (len(references) == len(baseline) == len(candidate)):
        raise ValueError(
            f"need one transcript per reference: {len(references)} references, "
            f"{len(baseline)} baseline, {len(candidate)} candidate"
        )
    if not references:
        raise ValueError("no sentences to compare")
    words = np.array([len(normalize_text(r).split()) for r in references], dtype=np.float64)
    if words.sum() == 0:
        raise ValueError("the references have no words")
    e_base = np.array(
        [word_errors(r, h) for r, h in zip(references, baseline, strict=True)], dtype=np.float64
    )
    e_cand = np.array(
        [word_errors(r, h) for r, h in zip(references, candidate, strict=True)], dtype=np.float64
    )
    diff = e_cand - e_base
    rng = np.random.default_rng(seed)
    idx = rng.integers(len(references), size=(resamples, len(references)))
    boot = 100.0 * diff[idx].sum(1) / words[idx].sum(1).clip(min=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {
        "n": len(references),
        "words": int(words.sum()),
        "baseline_wer": float(e_base.sum() / words.sum()),
        "candidate_wer": float(e_cand.sum() / words.sum()),
        "delta_pt": float(100.0 * diff.sum() / words.sum()),
        "ci95_pt": [float(lo), float(hi)],
        "sentences_worse": int((diff > 0).sum()),
        "sentences_better": int((diff < 0).sum()),
        "resamples": resamples,
    }


def describe(d: dict[str, Any]) -> str:
    lo, hi = d["ci95_pt"]
    verdict = "better" if hi < 0 else "worse" if lo > 0 else "not different at 95 %"
    return (
        f"{100 * d['baseline_wer']:.1f} -> {100 * d['candidate_wer']:.1f} % ({d['delta_pt']:+.1f} pt, "
        f"95 % CI {lo:+.1f} .. {hi:+.1f}; {d['sentences_worse']} sentences worse, {d['sentences_better']} better): "
        f"{verdict}"
    )
