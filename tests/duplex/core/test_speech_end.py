"""The voice's end from its energy (duplex.core.endpointing.speech_end): a pause is dated back to where
the words end rather than to the VAD's first quiet window, and the final transcript starts before the
VAD calls the pause. Replayed on a fake clock with a VAD that lags like Silero (its probability stays
high for windows after the voice stops)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from duplex.base.config import ConfigError, load_profile
from duplex.base.messages import AsrChunk, AsrResult
from duplex.base.stage import SequentialBatchMixin
from duplex.base.turn_policy import TurnPolicy
from duplex.core.endpointing import FRAME, Endpointer, speech_end
from duplex.core.session import SR, SessionCore
from duplex.testing.fakes import (
    EnergyVad,
    EnergyVadState,
    ToneAsr,
    ToneAsrState,
    fake_turn_stages,
    scripted_answer,
)
from duplex.testing.fakes import tone_speech as tones
from duplex.testing.replay import FakeClock, replay

COSTS = {
    "vad": 0.002,
    "asr.partial": 0.05,
    "asr.final": 0.08,
    "llm.first": 0.05,
    "llm.step": 0.1,
    "llm.listen": 0.03,
    "llm.overlap": 0.03,
    "tts": 0.02,
}
LAG_WINDOWS = 3  # 96 ms: Silero calls the first quiet window 60-100 ms after the last word


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(SR * seconds), dtype=np.float32)


def tone(seconds: float, amplitude: float = 0.3, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(SR * seconds)) / SR
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


# -- speech_end ------------------------------------------------------------------------


def test_speech_end_is_just_past_the_last_loud_frame():
    audio = np.concatenate(
        [silence(0.1), tone(0.3), tone(0.2, amplitude=0.3 * 10 ** (-50 / 20)), silence(0.2)]
    )
    loud_end = int(SR * 0.4)
    end = speech_end(audio, base=0, start=0, until=len(audio), below_peak_db=35)
    assert end is not None and loud_end <= end <= loud_end + FRAME  # the -50 dB tail is not the voice
    # a 30 dB tail is within 35 dB of the peak: the voice goes on through it
    assert speech_end(audio, 0, 0, len(audio), 55) == int(SR * 0.6)
    # positions are stream indices: the same audio later in the stream
    assert speech_end(audio, base=SR, start=SR, until=SR + len(audio), below_peak_db=35) == SR + end


def test_speech_end_in_noise_or_silence_moves_nothing():
    rng = np.random.default_rng(0)
    noisy = np.concatenate([tone(0.3), silence(0.2)]) + (
        0.3 * 10 ** (-20 / 20) * rng.standard_normal(SR // 2)
    ).astype(np.float32)
    # room noise within 35 dB of the voice: every frame is "loud", the end is where the audio ends
    assert speech_end(noisy, 0, 0, len(noisy), 35) == len(noisy) // FRAME * FRAME
    assert speech_end(silence(0.5), 0, 0, SR // 2, 35) is None  # digital silence
    assert speech_end(tone(0.3), 0, 0, 100, 35) is None  # no whole frame
    assert speech_end(tone(0.3), 1000, 1000, 5000 + len(tone(0.3)), 35) is None  # past the buffer


# -- the endpointer --------------------------------------------------------------------


def _feed(ep: Endpointer, probs: list[float], voice_end: int | None) -> list[tuple[str, int]]:
    edges = []
    for i, p in enumerate(probs):
        edges += [(e.kind, e.sample) for e in ep.feed((i + 1) * 512, p, 512, voice_end)]
    return edges


def test_a_pause_is_dated_back_to_the_voice_end_within_the_bound():
    probs = [1.0] * 10 + [0.0] * 30  # the VAD's first quiet window starts at 5120
    kw = {"threshold": 0.5, "off_threshold": 0.35, "min_speech": 1024, "end_silence": 8000}
    plain = _feed(Endpointer(**kw), probs, voice_end=4200)
    assert plain[1] == ("pause", 5120) and plain[2] == ("end", 5120)  # max_backdate 0: the VAD's window

    moved = _feed(Endpointer(**kw, max_backdate=1536), probs, voice_end=4200)
    assert moved[1] == ("pause", 4200) and moved[2] == ("end", 4200)
    assert [k for k, _ in moved] == ["start", "pause", "end"]

    bounded = _feed(Endpointer(**kw, max_backdate=1536), probs, voice_end=100)
    assert bounded[1] == ("pause", 5120 - 1536)  # never more than max_backdate, never before the start

    later = _feed(Endpointer(**kw, max_backdate=1536), probs, voice_end=9000)
    assert later[1] == ("pause", 5120)  # only ever earlier


def test_the_end_of_turn_counts_from_the_dated_pause():
    kw = {"threshold": 0.5, "off_threshold": 0.35, "min_speech": 1024, "end_silence": 3200}
    probs = [1.0] * 10 + [0.0] * 30
    ends = {}
    for backdate, voice_end in ((0, None), (1536, 5120 - 1024)):
        ep = Endpointer(**kw, max_backdate=backdate)
        for i, p in enumerate(probs):
            if any(e.kind == "end" for e in ep.feed((i + 1) * 512, p, 512, voice_end)):
                ends[backdate] = (i + 1) * 512
                break
    assert ends[0] - ends[1536] == 1024  # the hangover ran from the voice's end: two windows sooner


# -- the session core ------------------------------------------------------------------


@dataclass
class LaggingVadState:
    inner: EnergyVadState = field(default_factory=EnergyVadState)
    quiet: int = 0  # quiet windows in a row


class LaggingVad(SequentialBatchMixin[LaggingVadState, np.ndarray, list[tuple[int, float]]]):
    """EnergyVad whose P(speech) stays 1.0 for LAG_WINDOWS windows after the energy falls, as Silero's does."""

    kind = "vad"

    def __init__(self) -> None:
        self.inner = EnergyVad()

    def init_state(self) -> LaggingVadState:
        return LaggingVadState()

    def step(
        self, state: LaggingVadState, chunk: np.ndarray
    ) -> tuple[list[tuple[int, float]], LaggingVadState]:
        out, inner = self.inner.step(state.inner, chunk)
        quiet, lagged = state.quiet, []
        for end, p in out:
            quiet = 0 if p >= 0.5 else quiet + 1
            lagged.append((end, 1.0 if 0 < quiet <= LAG_WINDOWS else p))
        return lagged, LaggingVadState(inner, quiet)


class CountingAsr(ToneAsr):
    """ToneAsr that records when each final transcription was asked for (by audio length)."""

    def __init__(self) -> None:
        self.finals: list[float] = []

    def step(self, state: ToneAsrState, chunk: AsrChunk) -> tuple[AsrResult | None, ToneAsrState]:
        if chunk.final:
            self.finals.append((len(state.audio) + len(chunk.samples)) / SR)
        return super().step(state, chunk)


def sure_head(text: str) -> tuple[float, float, float]:
    return (0.02, 0.03, 0.95) if text.split()[-1] == "france" else (0.9, 0.05, 0.05)


def run(audio: np.ndarray, **options):
    profile = load_profile("cpu")
    asr = CountingAsr()
    stages = dataclasses.replace(
        fake_turn_stages(scripted_answer, turn_fn=sure_head, asr=asr),
        vad=LaggingVad(),
        policy=TurnPolicy(0.5, 0.7, 0.5, take_threshold=0.6, fast_take_threshold=0.9),
    )
    clock = FakeClock()
    core = SessionCore("s1", profile, stages, clock, options=dataclasses.replace(profile.session, **options))
    return replay(core, clock, audio, COSTS), asr


def test_the_turn_is_timed_from_the_words_end_not_the_vads_lag():
    speech = tones("what is the capital of france")
    voice_end = 0.5 + len(speech) / SR - 0.05  # tone_speech ends with a 50 ms gap
    audio = np.concatenate([silence(0.5), speech, silence(3.0)])
    new, _ = run(audio, speech_end_db=35)
    old, _ = run(audio, speech_end_db=0, early_final_ms=0)
    for r in (new, old):
        assert [e.text for e in r.events("transcript.final")] == ["what is the capital of france"]
        assert r.events("response.done")[0].text == "paris is the capital of france"
    stopped_new = new.events("speech.stopped")[0].audio_ms / 1000
    stopped_old = old.events("speech.stopped")[0].audio_ms / 1000
    assert abs(stopped_new - voice_end) <= 0.011  # the words' end, to the 10 ms frame
    assert stopped_old - voice_end > 0.06  # the VAD's first quiet window, after its lag
    # the 200 ms hangover counts from the words' end: the answer starts that much sooner
    first_new, first_old = new.audio_frames()[0].t, old.audio_frames()[0].t
    assert first_old - first_new >= 0.06
    assert first_new - voice_end < 0.35


def test_the_final_starts_before_the_vad_calls_the_pause_and_serves_at_it():
    speech = tones("what is the capital of france")
    voice_end = 0.5 + len(speech) / SR - 0.05
    audio = np.concatenate([silence(0.5), speech, silence(3.0)])
    result, asr = run(audio, speech_end_db=35, early_final_ms=40)
    vad_pause = voice_end + LAG_WINDOWS * 512 / SR
    early = [t for t in asr.finals if voice_end < t < vad_pause]
    assert early, f"no final before the VAD's pause: {asr.finals}"
    # ... and no second one for the same pause: the early one covers it
    assert not [t for t in asr.finals if t >= vad_pause - 0.001]
    assert [e.text for e in result.events("transcript.final")] == ["what is the capital of france"]


def test_quiet_gaps_inside_a_turn_cost_transcriptions_not_the_turn():
    # 60 ms and 80 ms of silence between words (a stop consonant's closure, a short breath) while the VAD
    # still hears speech: an early final may run, but the turn and its transcript are whole
    words = "what is the capital of france".split()
    parts = [silence(0.5)]
    for i, w in enumerate(words):
        parts += [tones(w), silence(0.06 if i % 2 else 0.08)]
    parts.append(silence(3.0))
    result, _ = run(np.concatenate(parts), speech_end_db=35, early_final_ms=40)
    assert [e.text for e in result.events("transcript.final")] == ["what is the capital of france"]
    assert len(result.events("response.started")) == 1
    assert [d.decision for d in result.events("turn.decision")][-1] == "speak"


def test_the_options_are_validated_and_settable_per_session():
    opts = load_profile("cpu").session
    assert opts.speech_end_db == 0 and opts.early_final_ms == 0
    assert opts.with_overrides({"speech_end_db": 0, "early_final_ms": 0}).speech_end_db == 0
    for bad in ({"speech_end_db": 61}, {"speech_end_db": -1}, {"speech_end_db": 3.5}, {"early_final_ms": -5}):
        try:
            opts.with_overrides(bad)
        except ConfigError:
            continue
        raise AssertionError(f"accepted {bad}")
