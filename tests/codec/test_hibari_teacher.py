"""The hibari 0.2.1 graph edit: durations as an extra output, features and audio unchanged."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("hibari")
pytest.importorskip("onnx")

from asr.training.data import is_heldout_text
from codec.training import hibari_teacher as ht  # noqa: E402


@pytest.fixture(scope="module")
def teacher():
    return ht.HibariTeacher(threads=1)


def test_durations_match_frames_and_audio_equals_hibari(teacher):
    for text, speed in (("Hello there, how are you doing today?", 1.0), ("The cat sat on the mat.", 1.3)):
        ps = teacher.phonemize(text)[0]
        out = teacher.run(ps, speed=speed, audio_seed=3)
        assert out.durations.shape == out.ids.shape
        assert (out.durations >= 0).all()
        assert 2 * int(out.durations.sum()) == out.frames == out.lh.shape[1]
        for name in ("lh", "theta", "ln", "lr", "phi"):
            assert getattr(out, name).shape == (601, out.frames)
        ref = teacher.tts.from_phonemes(ps, speed=speed, seed=3)
        np.testing.assert_array_equal(out.audio, ref)
        assert len(out.audio) == out.frames * ht.HOP


def test_slower_speech_has_longer_durations(teacher):
    ps = teacher.phonemize("Slow and steady wins the race.")[0]
    assert teacher.run(ps, speed=0.8).durations.sum() > teacher.run(ps, speed=1.25).durations.sum()


def test_edited_model_is_cached(tmp_path):
    p1 = ht.edited_model_path(tmp_path)
    mtime = p1.stat().st_mtime_ns
    assert ht.edited_model_path(tmp_path) == p1 and p1.stat().st_mtime_ns == mtime


def test_wrong_hibari_version_fails_clearly(monkeypatch, tmp_path):
    import hibari

    monkeypatch.setattr(hibari, "__version__", "9.9.9")
    with pytest.raises(ht.TeacherVersionError, match="0.2.1"):
        ht.edited_model_path(tmp_path)


def test_training_text_never_contains_heldout_sentences():
    held = {ht.normalize_text(s) for s in ht.heldout_sentences()}
    train = ht.training_sentences()
    assert len(train) > 1000
    assert not held & {ht.normalize_text(s) for s in train}
    assert not any(is_heldout_text(s) for s in train[:2000])


def test_merged_noise_keeps_expected_power():
    ln = np.array([[-3.0, -20.0, 0.5]], np.float32)
    lr = np.array([[-20.0, -2.0, 0.1]], np.float32)
    got = np.exp(2 * ht.merged_noise(ln, lr))
    np.testing.assert_allclose(
        got, 2 * np.exp(2 * ln.astype(np.float64)) + np.exp(2 * lr.astype(np.float64)), rtol=1e-5
    )
