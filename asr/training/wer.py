"""Word error rate: Levenshtein distance over words of normalised text."""

from __future__ import annotations

from asr.training.data import normalize_text


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


def matched_words(reference: list[str], hypothesis: list[str]) -> list[tuple[int, int]]:
    """(reference index, hypothesis index) of the words a minimum-edit alignment pairs as equal."""
    n, m = len(reference), len(hypothesis)
    cost = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n + 1):
        for j in range(m + 1):
            if i == 0 or j == 0:
                cost[i][j] = i + j
            else:
                cost[i][j] = min(
                    cost[i - 1][j] + 1,
                    cost[i][j - 1] + 1,
                    cost[i - 1][j - 1] + (reference[i - 1] != hypothesis[j - 1]),
                )
    pairs, i, j = [], n, m
    while i > 0 and j > 0:
        if reference[i - 1] == hypothesis[j - 1] and cost[i][j] == cost[i - 1][j - 1]:
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif cost[i][j] == cost[i - 1][j - 1] + 1:
            i, j = i - 1, j - 1
        elif cost[i][j] == cost[i - 1][j] + 1:
            i -= 1
        else:
            j -= 1
    return pairs[::-1]
