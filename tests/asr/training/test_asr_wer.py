"""Word error rate and the word alignment the ASR eval times partial words with."""

from __future__ import annotations

import pytest

from asr.training.wer import matched_words, wer, word_errors


def test_word_errors_count_edits_on_normalised_words():
    assert word_errors("What is the capital of France?", "what is the capital of france") == 0
    assert word_errors("a b c d", "a x c") == 2  # one substitution, one deletion
    assert word_errors("a b", "a b c d") == 2
    assert wer(["a b c d", "e f"], ["a b c d", ""]) == pytest.approx(2 / 6)
    with pytest.raises(ValueError):
        wer(["a"], [])


def test_matched_words_pair_equal_words_of_a_minimum_edit_alignment():
    ref = "what is the capital of france".split()
    hyp = "what's the capitol of france today".split()
    assert matched_words(ref, hyp) == [(2, 1), (4, 3), (5, 4)]
    assert matched_words(ref, []) == [] and matched_words([], hyp) == []
    assert matched_words(["a", "a"], ["a"]) in ([(0, 0)], [(1, 0)])
