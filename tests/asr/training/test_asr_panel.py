"""The validation panel: fixed sets (same audio every time), natural held-out voices on conversational
text, and a cache keyed by content so a rerun is cheap."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("espeakng_loader")

from asr.training import panel  # noqa: E402
from asr.training.speakers import HELDOUT_NATURAL, panel_conversational_texts  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DUPLEX_ASR_PANEL_CACHE", str(tmp_path))
    return tmp_path


def test_plain_heldout_set_is_fixed_and_cached(cache) -> None:
    first = panel.panel_set("heldout-synthetic", n=3)
    files = list(cache.glob("heldout-synthetic-*.npz"))
    assert len(files) == 1
    again = panel.panel_set("heldout-synthetic", n=3)
    fresh = panel.panel_set("heldout-synthetic", n=3, cache=False)
    for a, b, c in zip(first, again, fresh, strict=True):
        assert a.text == b.text == c.text and a.voice == c.voice
        assert np.allclose(a.audio, c.audio, atol=1e-6) and np.allclose(b.audio, a.audio, atol=1e-6)
        assert a.audio[:3000].max() < 1e-3  # 0.2 s of silence before the speech
        assert a.word_ends is not None and len(a.word_ends) == len(a.text.split())
        assert all(e < a.audio.size / 16000 for e in a.word_ends)
    assert {u.voice.split("+")[1] for u in first} <= set(panel.PLAIN_HELDOUT_VARIANTS)
    assert len(list(cache.glob("*.npz"))) == 1
    panel.panel_set("heldout-synthetic", n=2)  # another definition, another key
    assert len(list(cache.glob("*.npz"))) == 2


def test_natural_conversational_plan_uses_heldout_voices_only() -> None:
    plan = panel._plan("natural-conversational", 6, 11)
    assert {s.name for _, s in plan} == set(HELDOUT_NATURAL)
    assert [t for t, _ in plan] == list(panel_conversational_texts()[:6])
    assert panel._plan("natural-conversational", 6, 11) == plan


def test_unknown_set_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown panel set"):
        panel._plan("nope", 3, 1)
