"""A streaming ASR's decoder signals used alongside the VAD (issue 5): its end-of-utterance signal
ends a turn the VAD would hold open (a hum or a noisy room after the words), its next words resume
the turn, and sound over an answer with no word in it neither holds nor stops the answer.

Replayed on a fake clock with tone speech (duplex.testing.fakes): the energy VAD hears white noise as
speech, the tone streaming ASR hears it as no word (as a recogniser hears a fan), so the two disagree
exactly where the decoder's opinion matters.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from duplex.base.config import ConfigError, load_profile
from duplex.core.endpointing import Endpointer
from duplex.core.session import SR, SessionCore
from duplex.testing.fakes import (
    EnergyVad,
    ToneStreamingAsr,
    decode_tone_words,
    decode_tones,
    fake_turn_stages,
    scripted_answer,
    tone_speech,
)
from duplex.testing.replay import FakeClock, replay

COSTS = {
    "vad": 0.002,
    "asr.partial": 0.02,
    "asr.final": 0.03,
    "llm.first": 0.2,
    "llm.step": 0.1,
    "llm.listen": 0.03,
    "llm.overlap": 0.03,
    "tts": 0.02,
}
EOU_S = 0.64


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(SR * seconds), dtype=np.float32)


def noise(seconds: float, rms: float = 0.05, seed: int = 0) -> np.ndarray:
    return (rms * np.random.default_rng(seed).standard_normal(int(SR * seconds))).astype(np.float32)


def make_core(**overrides):
    profile = load_profile("cpu")
    clock = FakeClock()
    stages = fake_turn_stages(scripted_answer, asr=ToneStreamingAsr(eou_silence_ms=1000 * EOU_S))
    options = dataclasses.replace(profile.session, partial_interval_ms=160, **overrides)
    return SessionCore("s1", profile, stages, clock, options=options), clock


def test_the_tone_streaming_asr_hears_noise_as_no_word():
    speech = tone_speech("what is the capital of france")
    audio = np.concatenate([silence(0.3), speech, noise(1.0)])
    words = decode_tone_words(audio, SR, tonal_only=True)
    assert [w for w, _, _ in words] == "what is the capital of france".split()
    assert abs(words[-1][2] - (0.3 + len(speech) / SR - 0.05)) < 0.02
    # while the energy VAD hears the noise as speech
    vad_out, _ = EnergyVad().step(EnergyVad().init_state(), noise(1.0))
    assert vad_out and all(p == 1.0 for _, p in vad_out)


def test_decoder_silence_pauses_and_ends_the_turn_from_the_last_word():
    ep = Endpointer(threshold=0.5, off_threshold=0.35, min_speech=512, end_silence=SR)
    assert [e.kind for e in ep.feed(512, 1.0, 512)] == ["start"]
    pos = 512
    for _ in range(20):
        pos += 512
        assert ep.feed(pos, 1.0, 512) == []  # loud: talking
    word_end = pos - 4 * 512
    ep.decoder_silence(word_end)
    pos += 512
    edges = ep.feed(pos, 1.0, 512)  # the VAD still hears sound, the decoder no word
    assert [(e.kind, e.sample) for e in edges] == [("pause", word_end)]
    assert ep.run == pos - word_end
    ends = []
    while not ends:
        pos += 512
        ends = [e for e in ep.feed(pos, 1.0, 512) if e.kind == "end"]
    # the end-of-turn silence is counted from the last word, not from when the VAD went quiet
    assert ends[0].sample == word_end and pos - word_end >= SR and pos - word_end - 512 < SR
    assert ep.decoder_quiet_since is None and not ep.in_speech


def test_decoder_words_resume_and_a_vad_pause_is_left_alone():
    ep = Endpointer(threshold=0.5, off_threshold=0.35, min_speech=512, end_silence=4 * SR)
    ep.feed(512, 1.0, 512)
    ep.decoder_silence(256)
    assert [e.kind for e in ep.feed(1024, 1.0, 512)] == ["pause"]
    assert [e.kind for e in ep.feed(1536, 1.0, 512)] == []  # loud, but the decoder says no word yet
    assert [(e.kind, e.sample) for e in ep.decoder_words(1400)] == [("resume", 1400)]
    assert ep.feed(2048, 1.0, 512) == [] and not ep.paused
    # in a pause the VAD called itself, the decoder's silence changes nothing: the VAD resumes at once
    assert [e.kind for e in ep.feed(2560, 0.0, 512)] == ["pause"]
    ep.decoder_silence(2048)
    assert ep.decoder_quiet_since is None
    assert [e.kind for e in ep.feed(3072, 1.0, 512)] == ["resume"]


def test_a_question_followed_by_noise_is_answered_at_the_decoders_end_of_utterance():
    speech = tone_speech("what is the capital of france")
    noise_s = 3.0
    audio = np.concatenate([silence(0.5), speech, noise(noise_s), silence(4.0)])
    speech_end = 0.5 + len(speech) / SR - 0.05
    noise_end = 0.5 + len(speech) / SR + noise_s

    core, clock = make_core()
    result = replay(core, clock, audio, COSTS, tail_seconds=4.0)
    decision = result.events("turn.decision")[-1]
    assert decision.decision == "speak" and decision.text == "what is the capital of france"
    # the turn ended at the decoder's end of utterance (640 ms of no word, a 160 ms chunk, the head)
    stopped = result.events("speech.stopped")[0]
    assert stopped.t - speech_end < EOU_S + 0.3
    assert abs(stopped.audio_ms / 1000 - speech_end) < 0.05  # the speech ended at the last word
    # and answered while the noise goes on (the noise starts a segment over the answer and holds its
    # audio until the decoder has heard 640 ms of it with no word: ~0.3 s more)
    first_audio = result.audio_frames()[0].t
    assert first_audio < noise_end and first_audio - speech_end < EOU_S + 0.8
    # and the noise that goes on over the answer neither holds nor stops it
    assert not result.events("response.interrupted")
    done = result.events("response.done")
    assert [d.status for d in done] == ["completed"] and done[0].text == "paris is the capital of france"
    assert decode_tones(result.audio(), 24000) == done[0].text.split()
    assert [m["role"] for m in core.history] == ["user", "assistant"]

    # the same audio with the decoder's signal off: the VAD holds the turn open until the noise ends
    core, clock = make_core(asr_end_of_utterance=False)
    result = replay(core, clock, audio, COSTS, tail_seconds=4.0)
    assert result.audio_frames()[0].t > noise_end


def test_words_after_a_decoder_pause_resume_the_same_turn():
    # a hum in the middle of the sentence: the decoder pauses the turn, the head says "not finished",
    # and the next word resumes it; one turn, one answer to the whole sentence
    first = tone_speech("what is the capital of")
    audio = np.concatenate([silence(0.5), first, noise(1.2), tone_speech("france"), silence(3.0)])
    core, clock = make_core()
    result = replay(core, clock, audio, COSTS)
    decisions = [(d.decision, d.text) for d in result.events("turn.decision")]
    assert ("listen", "what is the capital of") in decisions  # the decoder's pause, during the hum
    assert decisions[-1] == ("speak", "what is the capital of france")
    assert [e.text for e in result.events("transcript.final")] == ["what is the capital of france"]
    assert len(result.events("response.started")) == 1
    resumed_at = 0.5 + len(first) / SR + 1.2
    assert result.audio_frames()[0].t > resumed_at


def test_noise_over_an_answer_does_not_stop_it_but_words_still_do():
    q = tone_speech("tell me a story")
    noisy = np.concatenate([silence(0.5), q, silence(2.5), noise(2.0), silence(12.0)])
    core, clock = make_core()
    result = replay(core, clock, noisy, COSTS)
    assert not result.events("response.interrupted")
    done = result.events("response.done")
    assert [d.status for d in done] == ["completed"]
    assert decode_tones(result.audio(), 24000) == done[0].text.split()
    assert len(result.events("response.started")) == 1  # the noise was not a turn

    # VAD alone: 2 s of sound over the answer is longer than any backchannel, so it stopped the answer
    core, clock = make_core(asr_end_of_utterance=False)
    assert len(replay(core, clock, noisy, COSTS).events("response.interrupted")) == 1

    # words in a noisy room still interrupt: noise, then "stop what is two plus two"
    t_noise = 0.5 + len(q) / SR + 2.5
    words = np.concatenate(
        [
            silence(0.5),
            q,
            silence(2.5),
            noise(1.5),
            tone_speech("stop"),
            silence(0.3),
            tone_speech("what is two plus two"),
            silence(4.0),
        ]
    )
    core, clock = make_core()
    result = replay(core, clock, words, COSTS)
    interrupted = result.events("response.interrupted")
    assert len(interrupted) == 1 and interrupted[0].t > t_noise + 1.5
    last = result.events("response.done")[-1]
    assert last.status == "completed" and last.text == "two plus two is four"


def test_the_option_is_a_session_setting():
    options = load_profile("cpu").session
    assert options.asr_end_of_utterance is True
    assert options.with_overrides({"asr_end_of_utterance": False}).asr_end_of_utterance is False
    with pytest.raises(ConfigError, match="true or false"):
        options.with_overrides({"asr_end_of_utterance": "no"})
