"""Word error rate: Levenshtein distance over words of normalised text."""

from __future__ import annotations

from asr.train_data import normalize_text


def word_errors(reference: str, hypothesis: str) -> int:
    """Substitutions + deletions + insertions turning `reference` into `hypothesis` (normalised words)."""
    ref, hyp = normalize_text(reference).split(), normalize_text(hypothesis).split()
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def wer(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER: total word errors / total reference words."""
    if len(references) != len(hypotheses):
        raise ValueError("references and hypotheses differ in length")
    words = sum(len(normalize_text(r).split()) for r in references)
    return sum(word_errors(r, h) for r, h in zip(references, hypotheses, strict=False)) / max(words, 1)
