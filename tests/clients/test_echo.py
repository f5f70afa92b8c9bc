"""The echo canceller on synthetic rooms: a far end played through a seeded, exponentially decaying
random room response (delay, gain, 150 ms of reverberation) into the microphone."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from clients.echo import EchoCanceller, EchoChunk, EchoConfig, FarEndBuffer, erle_db
from duplex.testing.fakes import tone_speech

SR = 16000
WINDOW = 512  # the tone server's energy VAD: RMS over 512 samples > 0.02 ...
MIN_SPEECH_WINDOWS = 3  # ... for 96 ms in a row starts a turn (or interrupts the bot)


def babble(seconds: float, seed: int, level: float = 0.1) -> np.ndarray:
    """Noise-like speech: noise with a speech-like spectral tilt, in syllable-long bursts."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SR)
    freqs = np.fft.rfftfreq(n, 1 / SR)
    tilt = (freqs > 80) / np.sqrt(1 + (freqs / 500) ** 2)
    noise = np.fft.irfft(np.fft.rfft(rng.standard_normal(n)) * tilt, n)
    envelope = np.zeros(n)
    t = 0
    while t < n:
        dur, gap = int(rng.uniform(0.12, 0.3) * SR), int(rng.uniform(0.03, 0.25) * SR)
        envelope[t : t + dur] = (np.hanning(dur) ** 0.5 * rng.uniform(0.5, 1.0))[: n - t]
        t += dur + gap
    x = noise * envelope
    return (level * x / np.sqrt(np.mean(x[envelope > 0] ** 2))).astype(np.float32)


def room_response(
    rate: int = SR, delay_s: float = 0.04, tail_s: float = 0.15, gain: float = 0.5, seed: int = 3
) -> np.ndarray:
    """Loudspeaker -> microphone: `delay_s` of nothing, then `tail_s` of exponentially decaying
    (60 dB) random reflections with unit energy times `gain` (0.5: the echo at -6 dB)."""
    rng = np.random.default_rng(seed)
    n = int(rate * tail_s)
    h = rng.standard_normal(n) * np.exp(-np.arange(n) / (rate * tail_s / 6.9))
    return np.concatenate([np.zeros(int(rate * delay_s)), gain * h / np.sqrt((h**2).sum())])


def through(far: np.ndarray, h: np.ndarray) -> np.ndarray:
    return np.convolve(far, h)[: len(far)].astype(np.float32)


def windows(x: np.ndarray) -> np.ndarray:
    n = len(x) // WINDOW
    return np.sqrt((x[: n * WINDOW].reshape(n, WINDOW).astype(np.float64) ** 2).mean(axis=1))


def heard_as_speech(x: np.ndarray, threshold: float = 0.02) -> bool:
    """Would the energy VAD start a turn: 96 ms of windows above `threshold` in a row?"""
    run = 0
    for loud in windows(x) > threshold:
        run = run + 1 if loud else 0
        if run >= MIN_SPEECH_WINDOWS:
            return True
    return False


def tone_far(seconds: float) -> np.ndarray:
    """The tone TTS's answers: a new pure tone every 250 ms, the hardest case for an adaptive filter."""
    words = "paris is the capital of france once upon a time there was a cat and it very good"
    return np.resize(tone_speech(words, SR, 0.3), int(seconds * SR))


@pytest.mark.parametrize("mode", ["aec", "suppress"])
def test_streaming_in_any_chunking_equals_one_call(mode):
    far = babble(1.5, 1)
    mic = through(far, room_response())
    mic[SR : SR + 4000] += tone_speech("stop", SR, 0.2)
    canceller = EchoCanceller(EchoConfig.for_mode(mode))
    whole, _ = canceller.step(canceller.init_state(), EchoChunk(mic, far))
    assert len(whole) == len(mic) // canceller.n * canceller.n
    for sizes in ([1, 7, 160, 333], [320], [4001, 1, 159, 2]):
        state, parts, i = canceller.init_state(), [], 0
        for size in itertools.cycle(sizes):
            if i >= len(mic):
                break
            out, state = canceller.step(state, EchoChunk(mic[i : i + size], far[i : i + size]))
            parts.append(out)
            i += size
        assert np.array_equal(np.concatenate(parts), whole), sizes


@pytest.mark.parametrize(("delay_s", "seed"), [(0.02, 3), (0.05, 4), (0.08, 5)])
def test_aec_erle_after_convergence(delay_s, seed):
    far = babble(8.0, seed)
    echo = through(far, room_response(delay_s=delay_s, seed=seed))
    linear = EchoCanceller(EchoConfig.for_mode("aec", residual=False)).process(echo, far)
    full = EchoCanceller(EchoConfig.for_mode("aec")).process(echo, far)
    converged = slice(3 * SR, None)
    assert erle_db(echo[converged], linear[converged]) >= 18  # the adaptive filter alone
    assert erle_db(echo[converged], full[converged]) >= 35  # with the residual echo suppressor
    assert erle_db(echo[: 2 * SR], full[: 2 * SR]) >= 25  # also while it converges


@pytest.mark.parametrize("mode", ["aec", "suppress"])
@pytest.mark.parametrize("far_kind", ["babble", "tones"])
@pytest.mark.parametrize("gain", [0.5, 1.5])
def test_pure_echo_is_never_heard_as_speech(mode, far_kind, gain):
    far = babble(6.0, 2, level=0.15) if far_kind == "babble" else tone_far(6.0)
    echo = through(far, room_response(delay_s=0.05, gain=gain, seed=7))
    assert heard_as_speech(echo)  # unprocessed, the bot would interrupt itself at its first word
    out = EchoCanceller(EchoConfig.for_mode(mode)).process(echo, far)
    assert not heard_as_speech(out)
    assert windows(out).max() < 0.02


@pytest.mark.parametrize("near_kind", ["babble", "tones"])
def test_double_talk_keeps_the_near_end_and_the_filter(near_kind):
    """A user talks over the bot; the server stops the bot 300 ms later; the bot answers again."""
    far = babble(10.0, 1, level=0.15)
    far[int(5.3 * SR) : int(6.6 * SR)] = 0.0  # the barge-in silenced the bot
    near = (
        babble(1.5, 9, level=0.08)
        if near_kind == "babble"
        else tone_speech("stop what is two plus", SR, 0.12)
    )
    at = 5 * SR
    echo = through(far, room_response(delay_s=0.04))
    mic = echo.copy()
    mic[at : at + len(near)] += near
    canceller = EchoCanceller(EchoConfig.for_mode("aec"))
    out = canceller.process(mic, far)
    talk = slice(at, at + len(near))
    assert erle_db(near, out[talk]) < 2.0  # the user keeps most of their energy (< 2 dB lost) ...
    assert heard_as_speech(out[talk])  # ... and the VAD hears them
    assert (windows(out[talk]) > 0.02).sum() >= 0.8 * (windows(near) > 0.02).sum()
    after = slice(int(7.5 * SR), None)  # the bot talks again: the filter did not diverge
    assert erle_db(echo[after], out[after]) >= 35 and not heard_as_speech(out[int(6.6 * SR) :])


def test_suppress_lets_a_louder_user_through():
    far = babble(6.0, 1, level=0.1)
    far[int(4.3 * SR) :] = 0.0  # the server heard the user and stopped the bot
    echo = through(far, room_response(delay_s=0.04))  # the echo at about -6 dB: RMS 0.05
    near = tone_speech("stop what is two plus", SR, 0.2)  # RMS 0.14, 9 dB above it
    mic = echo.copy()
    mic[4 * SR : 4 * SR + len(near)] += near
    out = EchoCanceller(EchoConfig.for_mode("suppress")).process(mic, far)
    talk = slice(4 * SR, 4 * SR + len(near))
    assert heard_as_speech(out[talk]) and erle_db(near, out[talk]) < 3.0


def test_an_echo_path_change_is_caught_within_a_second():
    """The laptop moved and the volume went up 6 dB: the bot may be cut once, not answer after answer."""
    far = babble(12.0, 3, level=0.15)
    change = 6 * SR
    echo = np.concatenate(
        [
            through(far, room_response(gain=0.5, seed=3))[:change],
            through(far, room_response(delay_s=0.06, gain=1.0, seed=9))[change:],
        ]
    )
    out = EchoCanceller(EchoConfig.for_mode("aec")).process(echo, far)
    assert not heard_as_speech(out[:change])
    assert not heard_as_speech(out[change + SR :])
    assert erle_db(echo[change + 3 * SR :], out[change + 3 * SR :]) >= 30


def test_cost_per_block_is_small(capsys):
    far = babble(3.0, 5)
    mic = through(far, room_response())
    for mode, budget_ms in (("aec", 3.0), ("suppress", 1.5)):
        canceller = EchoCanceller(EchoConfig.for_mode(mode))
        state = canceller.init_state()
        costs = []
        for i in range(0, len(mic), 320):  # 20 ms chunks, as the client sends them
            t = time.perf_counter()
            _, state = canceller.step(state, EchoChunk(mic[i : i + 320], far[i : i + 320]))
            costs.append((time.perf_counter() - t) / 2)
        per_block = float(np.median(costs)) * 1000
        with capsys.disabled():
            print(f"\n{mode}: {per_block:.3f} ms per 10 ms block ({100 * per_block / 10:.1f} % of a core)")
        assert per_block < budget_ms


def test_far_end_buffer_reads_on_the_mic_clock():
    buf = FarEndBuffer(8)
    buf.append(np.arange(5, dtype=np.float32))
    assert buf.read(-2, 4).tolist() == [0, 0, 0, 1]  # before the first played sample: silence
    buf.append(np.arange(5, 11, dtype=np.float32))  # wraps around; samples 0..2 are forgotten
    assert buf.written == 11
    assert buf.read(1, 12).tolist() == [0, 0, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0]


def test_bad_input():
    canceller = EchoCanceller()
    with pytest.raises(ValueError, match="same length"):
        canceller.step(canceller.init_state(), EchoChunk(np.zeros(10), np.zeros(11)))
    with pytest.raises(ValueError, match="unknown echo mode"):
        EchoConfig.for_mode("loud")
