"""The recipe's speakers: held-out natural voices never reach training, draws follow the weights, and the
engines that are installed render English at 16 kHz (hibari's F0 / vocal-tract edits change the audio)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from asr.training import speakers as sp
from asr.training.speakers import (
    HELDOUT_NATURAL,
    KOKORO_HELDOUT_STYLE,
    KOKORO_STYLES,
    Speaker,
    SpeakerTable,
    Synth,
    _warp_frequency,
    espeak_weight,
    heldout_natural_speakers,
    kokoro_training_blends,
    training_speakers,
)


def test_heldout_natural_voices_never_in_training() -> None:
    train = training_speakers(sp.ENGINES)  # every engine, installed or not: the list is data
    names = {s.name for s in train}
    assert not names & set(HELDOUT_NATURAL)
    assert {s.name for s in heldout_natural_speakers()} == set(HELDOUT_NATURAL)
    assert all(s.param("voice") not in sp.FLITE_HELDOUT for s in train if s.engine == "flite")
    held = KOKORO_STYLES.index(KOKORO_HELDOUT_STYLE)
    for s in train:
        if s.engine == "kokoro":
            assert s.param("blend")[held] == 0.0  # the held-out style is in no training blend
    assert heldout_natural_speakers()[1].param("blend")[held] > 0.5
    from asr.training.data import HELDOUT_ACCENTS, HELDOUT_VARIANTS

    for s in train:
        if s.engine == "espeak":
            accent, _, variant = str(s.param("voice")).partition("+")
            assert accent not in HELDOUT_ACCENTS and variant not in HELDOUT_VARIANTS
    assert {s.engine for s in train} == set(sp.ENGINES)


def test_kokoro_blends_sum_to_one_and_are_fixed() -> None:
    blends = kokoro_training_blends()
    assert blends == kokoro_training_blends() and len(set(blends)) == len(blends)
    assert all(abs(sum(b) - 1) < 0.01 for b in blends)


def test_draws_follow_engine_shares_and_weights() -> None:
    speakers = [
        Speaker("a", "espeak", weight=1.0),
        Speaker("b", "espeak", weight=3.0),
        Speaker("c", "flite"),
    ]
    table = SpeakerTable(speakers, {"espeak": 0.5, "flite": 0.5, "kokoro": 0.3})  # kokoro: no speaker
    rng = np.random.default_rng(0)
    names = [table.draw(rng).name for _ in range(4000)]
    share = {n: names.count(n) / len(names) for n in "abc"}
    assert share["c"] == pytest.approx(0.5, abs=0.03)
    assert share["b"] == pytest.approx(0.375, abs=0.03) and share["a"] == pytest.approx(0.125, abs=0.03)


def test_espeak_weight_downweights_unintelligible_settings() -> None:
    assert espeak_weight(None) == 1.0 and espeak_weight(0.0) == 1.0
    assert espeak_weight(0.5) == pytest.approx(0.25) and espeak_weight(1.4) == pytest.approx(0.0025)


def test_panel_text_never_in_training_text() -> None:
    from asr.training.data import normalize_text

    panel = {normalize_text(t) for t in sp.panel_conversational_texts()}
    assert len(panel) >= 60
    assert not panel & {normalize_text(t) for t in sp.conversational_sentences()}
    assert not panel & {normalize_text(t) for t in sp.dictionary_sentences()[:20000]}


def test_frequency_warp_moves_formants() -> None:
    x = np.zeros((601, 3), np.float32)
    x[100] = 1.0
    up = _warp_frequency(x, 1.1)
    assert np.argmax(up[:, 0]) == 110 and _warp_frequency(x, 1.0) is x


@pytest.mark.parametrize(
    "speaker",
    [
        Speaker("hibari:f0=1.3,vtl=1.12", "hibari", (("f0", 1.3), ("vtl", 1.12), ("speed", 1.0))),
        Speaker("flite:kal", "flite", (("voice", "kal"), ("stretch", 1.0))),
    ],
    ids=lambda s: s.engine,
)
def test_engines_render_16khz(speaker: Speaker) -> None:
    if speaker.engine not in sp.available_engines():
        pytest.skip(f"{speaker.engine} is not installed")
    r = Synth().render("What is the capital of France?", speaker, np.random.default_rng(0))
    assert r.audio.dtype == np.float32 and 1.0 < r.audio.size / 16000 < 4.0
    assert 0.05 < np.abs(r.audio).max() <= 1.5
    if speaker.engine == "hibari":
        plain = Synth().render(
            "What is the capital of France?",
            replace(speaker, params=(("speed", 1.0),)),
            np.random.default_rng(0),
        )
        assert plain.audio.size == r.audio.size and not np.allclose(plain.audio, r.audio)


def test_training_text_travels_as_a_file(tmp_path, monkeypatch) -> None:
    import gzip

    path = tmp_path / "text.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("the cat sat on the mat\nwhere is the station\n")
    monkeypatch.setenv("DUPLEX_ASR_TEXT", str(path))
    sp.dictionary_sentences.cache_clear()
    try:
        assert sp.dictionary_sentences() == ("the cat sat on the mat", "where is the station")
    finally:
        sp.dictionary_sentences.cache_clear()
