"""PCM16 conversion and the soxr resampler stage."""

from __future__ import annotations

import numpy as np
import pytest

from codec.pcm import float_to_pcm16, pcm16_to_float
from codec.resample import SUPPORTED_RATES, StreamingResampler, check_rate, resample


def test_pcm16_round_trip_is_exact() -> None:
    ints = np.array([-32768, -32767, -1, 0, 1, 12345, 32767], dtype="<i2")
    x = pcm16_to_float(ints.tobytes())
    assert x.dtype == np.float32 and x.min() == -1.0 and x.max() < 1.0
    assert float_to_pcm16(x) == ints.tobytes()


def test_pcm16_clips_instead_of_wrapping() -> None:
    x = np.array([1.0, 1.5, 100.0, -1.0, -7.0, np.nan, np.inf, -np.inf, 0.5], np.float32)
    got = np.frombuffer(float_to_pcm16(x), dtype="<i2")
    assert got.tolist() == [32767, 32767, 32767, -32768, -32768, 0, 32767, -32768, 16384]


def test_pcm16_little_endian_and_inputs() -> None:
    assert pcm16_to_float(b"\x00\x40").tolist() == [0.5]  # 0x4000 little-endian
    assert pcm16_to_float(bytearray(b"\x00\x40")).tolist() == [0.5]
    assert pcm16_to_float(memoryview(b"\x00\x40\x00\xc0")).tolist() == [0.5, -0.5]
    assert pcm16_to_float(b"").size == 0 and float_to_pcm16(np.zeros(0)) == b""


def test_pcm16_odd_byte_count() -> None:
    with pytest.raises(ValueError, match="even number of bytes"):
        pcm16_to_float(b"\x00\x01\x02")


def test_unsupported_rates() -> None:
    for bad in (0, 7999, 44000, 96000, 16000.0, True):
        with pytest.raises(ValueError, match="supported: 8000, 11025"):
            check_rate(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="48000"):
        StreamingResampler(16000, 96000)
    with pytest.raises(ValueError):
        resample(np.zeros(10, np.float32), 5000, 16000)
    assert all(check_rate(r) == r for r in SUPPORTED_RATES)


def _signal(sr: int, seconds: float = 1.3) -> np.ndarray:
    t = np.arange(round(sr * seconds)) / sr
    rng = np.random.default_rng(1)
    x = (
        0.4 * np.sin(2 * np.pi * 440 * t)
        + 0.1 * np.sin(2 * np.pi * 2900 * t)
        + 0.02 * rng.standard_normal(t.size)
    )
    return x.astype(np.float32)


@pytest.mark.parametrize(
    ("sr_in", "sr_out"),
    [(48000, 16000), (44100, 16000), (8000, 16000), (16000, 24000), (24000, 48000), (16000, 16000)],
)
@pytest.mark.parametrize("chunk", [1, 160, 441, 960, 4096])
def test_streaming_equals_offline(sr_in: int, sr_out: int, chunk: int) -> None:
    x = _signal(sr_in)
    offline = resample(x, sr_in, sr_out)
    assert offline.dtype == np.float32
    assert abs(offline.size - round(x.size * sr_out / sr_in)) <= 1
    stage = StreamingResampler(sr_in, sr_out)
    state = stage.init_state()
    parts = []
    for start in range(0, x.size, chunk):
        out, state = stage.step(state, x[start : start + chunk])
        assert out.dtype == np.float32
        parts.append(out)
    tail, state = stage.flush(state)
    streamed = np.concatenate([*parts, tail])
    assert streamed.size == offline.size
    np.testing.assert_allclose(streamed, offline, atol=1e-5)
    with pytest.raises(ValueError, match="flushed"):
        stage.step(state, x[:10])


def test_resampled_tone_keeps_its_frequency() -> None:
    sr_in, sr_out = 44100, 16000
    y = resample(_signal(sr_in), sr_in, sr_out)
    spectrum = np.abs(np.fft.rfft(y * np.hanning(y.size)))
    assert abs(np.argmax(spectrum) * sr_out / y.size - 440) < 2


def test_batch_steps_each_session() -> None:
    stage = StreamingResampler(48000, 16000)
    x = _signal(48000, 0.2)
    a, b = stage.init_state(), stage.init_state()
    (ya, a), (yb, b) = stage.step_batch([(a, x[:960]), (b, x[:480])])
    assert ya.ndim == yb.ndim == 1 and stage.kind == "resample"


# -- low-latency resampler -------------------------------------------------------------------

LOW_LATENCY_PAIRS = [
    (8000, 16000),
    (24000, 8000),
    (16000, 24000),
    (48000, 16000),
    (44100, 16000),
    (16000, 8000),
]


@pytest.mark.parametrize(("sr_in", "sr_out"), LOW_LATENCY_PAIRS)
def test_low_latency_resampler_streaming_equals_offline_for_any_split(sr_in, sr_out):
    from codec.resample import LowLatencyResampler

    rng = np.random.default_rng(sr_in + sr_out)
    r = LowLatencyResampler(sr_in, sr_out)
    x = (0.1 * rng.standard_normal(sr_in // 2)).astype(np.float32)
    offline = r(x)
    state, outs, i = r.init_state(), [], 0
    while i < len(x):
        n = int(rng.integers(1, sr_in // 25))
        y, state = r.step(state, x[i : i + n])
        outs.append(y)
        i += n
    assert np.array_equal(np.concatenate(outs), offline)
    assert len(offline) == len(x) * sr_out // sr_in  # nothing held back


@pytest.mark.parametrize(("sr_in", "sr_out"), LOW_LATENCY_PAIRS)
def test_low_latency_resampler_passes_speech_band_and_rejects_aliases(sr_in, sr_out):
    from codec.resample import LowLatencyResampler

    r = LowLatencyResampler(sr_in, sr_out)
    assert r.delay_s < 0.002  # the whole latency cost of the filter
    t = np.arange(sr_in) / sr_in

    def level_db(freq: float, at: int) -> float:
        y = r(np.sin(2 * np.pi * freq * t).astype(np.float32))[sr_out // 10 :]
        spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
        bins = np.fft.rfftfreq(len(y), 1 / sr_out)
        return 20 * np.log10(spectrum[np.argmin(np.abs(bins - at))] / (np.hanning(len(y)).sum() / 2) + 1e-12)

    assert abs(level_db(1000, 1000)) < 0.1  # unity gain in the speech band
    low = min(sr_in, sr_out)
    if sr_out < sr_in:  # a tone above the new Nyquist must not fold back into the band
        f = low / 2 + 600
        assert level_db(f, abs(sr_out - f) if f < sr_out else f - sr_out) < -60
    else:  # upsampling: the image of a 3 kHz tone above the old Nyquist is suppressed
        assert level_db(3000, sr_in - 3000) < -60
