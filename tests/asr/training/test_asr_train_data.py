"""The streaming ASR's training data: espeak word times land on the words' sound, augmentation moves them
with the audio, and the alignment loss's frame targets put each piece inside its word."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("espeakng_loader")

from asr.training.data import SAMPLE_RATE, Speaker, VoiceSpec, augment_timed, normalize_text  # noqa: E402
from asr.training.targets import FRAME_S, PHONE_CLASSES, alignment_targets, phone_class, phone_targets  # noqa: E402


def _envelope(audio: np.ndarray) -> np.ndarray:
    hop = SAMPLE_RATE // 100
    frames = audio[: audio.size // hop * hop].reshape(-1, hop).astype(np.float64)
    return np.sqrt(np.mean(frames**2, axis=1))


@pytest.fixture(scope="module")
def speaker() -> Speaker:
    return Speaker()


def test_espeak_word_times_cover_every_word_on_its_sound(speaker):
    text = "The well-known actor, Mr. Smith, didn't arrive; it's late!"
    audio, times = speaker.speak_words(text, VoiceSpec("espeak", "en-US", rate=160))
    words = normalize_text(text).split()
    assert times is not None and len(times) == len(words) == 10  # "well-known" is one espeak event
    starts = [a for a, _ in times]
    assert starts == sorted(starts) and all(b > a for a, b in times)
    env = _envelope(audio)
    loud = env > 0.05 * env.max()
    onset = np.flatnonzero(loud)[0] / 100
    assert abs(times[0][0] - onset) < 0.03  # the first word starts where the sound does
    assert times[-1][1] <= audio.size / SAMPLE_RATE + 0.01
    for a, b in times:  # every word's span holds sound
        assert loud[int(a * 100) : int(b * 100) + 1].any()
    # the silence after "actor," (a comma pause) is outside both neighbouring words
    actor, mr = times[words.index("actor")], times[words.index("mr")]
    assert mr[0] - actor[1] > 0.05


def test_espeak_phonemes_tile_the_words(speaker):
    audio, words, phones = speaker.speak_timed(
        "Hello there, my friend.", VoiceSpec("espeak", "en-GB-scotland+m3")
    )
    assert [p.replace("'", "") for p, _, _ in phones][:4] == ["h", "@", "l", "oU"]
    assert all(a < b for _, a, b in phones)
    assert all(
        phones[k][2] == phones[k + 1][1] for k in range(len(phones) - 1)
    )  # each ends where the next starts
    assert abs(phones[0][1] - words[0][0]) < 0.03 and phones[-1][2] <= audio.size / SAMPLE_RATE + 1e-6
    spoken = [p for p, _, _ in phones if phone_class(p) != 0]
    assert spoken and all(phone_class(p) != PHONE_CLASSES - 1 for p in spoken)  # all in the table


def test_hibari_reports_no_word_times(speaker):
    pytest.importorskip("hibari")
    audio, times, phones = speaker.speak_timed("hello there", VoiceSpec("hibari"))
    assert times is None and phones is None and audio.size > SAMPLE_RATE // 4


@pytest.mark.parametrize("seed", range(8))
def test_augmentation_moves_word_times_with_the_audio(seed):
    # a tone burst at 0.5 s in 1.5 s of near-silence: after trimming, speed change, padding, reverb, noise
    # and telephone band, its onset is where the returned (offset, scale) says
    t = np.arange(int(1.5 * SAMPLE_RATE)) / SAMPLE_RATE
    audio = np.where((t >= 0.5) & (t < 0.9), 0.5 * np.sin(2 * np.pi * 440 * t), 0.0).astype(np.float32)
    audio[int(0.2 * SAMPLE_RATE)] = 0.01  # a faint click before it: trimming starts here, not at the burst
    out, offset, scale = augment_timed(audio, np.random.default_rng(seed), strength=1.0)
    env = _envelope(out)
    onset = np.flatnonzero(env > 0.5 * env.max())[0] / 100
    assert abs(onset - (offset + scale * 0.5)) < 0.02
    assert 0.85 < scale < 1.15


def test_alignment_targets_place_pieces_inside_their_words():
    blank = 9
    pieces = [["▁he", "llo", "▁wor", "ld"], ["▁hi"], ["▁a", "▁b"], ["▁a"]]
    ids = [[1, 2, 3, 4], [5], [6, 7], [6]]
    times = [[(0.10, 0.50), (0.60, 1.00)], None, [(0.0, 0.1)], [(0.0, 5.0)]]
    n_frames = [15, 15, 10, 10]
    out = alignment_targets(pieces, times, n_frames, blank, ids)
    assert out.shape == (4, 15)
    row = out[0].tolist()
    # "he" ends 2/5 into "hello" (0.26 s -> frame 3), "llo" at its end (0.50 s -> frame 6), "wor" 3/5 into
    # "world" (0.84 s -> frame 10), "ld" at 1.00 s (frame 12); blank everywhere else
    assert {f: v for f, v in enumerate(row) if v != blank} == {3: 1, 6: 2, 10: 3, 12: 4}
    assert out[1].eq(-100).all()  # no word times (hibari): ignored
    assert out[2].eq(-100).all()  # two words, one time span: ignored
    assert out[3].eq(-100).all()  # the word ends after the last frame: ignored
    assert FRAME_S == 0.08


def test_alignment_targets_push_colliding_pieces_to_later_frames():
    out = alignment_targets([["▁x", "y", "z"]], [[(0.0, 0.1)]], [6], 0, [[1, 2, 3]])
    assert out[0].tolist() == [1, 2, 3, 0, 0, 0]


def test_phone_targets_label_every_frame_by_the_phoneme_at_its_centre():
    phones = [("h", 0.10, 0.20), ("'oU", 0.20, 0.44), ("_:", 0.44, 0.60), ("D", 0.60, 0.70)]
    out = phone_targets([phones, None], [11, 4])
    h, ou, d = phone_class("h"), phone_class("oU"), phone_class("D")
    assert phone_class("'oU") == ou and phone_class("_:") == 0 and phone_class("zz") == PHONE_CLASSES - 1
    # frame centres: 80 j - 30 ms -> -30, 50, 130, 210, 290, 370, 450, 530, 610, 690, 770
    assert out[0].tolist() == [0, 0, h, ou, ou, ou, 0, 0, d, d, 0]
    assert out[1].eq(-100).all()


def test_an_espeak_crash_costs_one_utterance_not_the_process():
    from asr.training.espeak_voice import IsolatedEspeak, SynthesisCrash

    voice = IsolatedEspeak()
    try:
        # the espeak-ng of espeakng-loader 0.2.4 segfaults on exactly this (found by a training run)
        with pytest.raises(SynthesisCrash, match="crashed"):
            voice.synthesize_timed("support the", "en-GB-scotland+rob", 175, 31, 90)
        audio, words, phonemes = voice.synthesize_timed("support the", "en-US")
        assert audio.size > 0.3 * voice.sample_rate and len(words) == 2 and phonemes
        with pytest.raises(ValueError, match="no voice"):
            voice.synthesize("hello", "xx-no-such-voice")
    finally:
        voice.close()
