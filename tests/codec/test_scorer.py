"""The WER scorer's worker: moonshine-cpp where its native library runs, the same model through onnxruntime
where it dies on this CPU (an illegal instruction on machines without AVX-512)."""

from __future__ import annotations

import numpy as np
import pytest

from codec.training import eval_codec
from codec.training.eval_codec import MoonshineScorer

# a stand-in worker that answers every clip with its length, as the real one answers with a transcript
_ECHO = r"""
import struct, sys
inp, out = sys.stdin.buffer, sys.stdout
while True:
    head = inp.read(8)
    if len(head) < 8:
        break
    (n,) = struct.unpack("<q", head)
    inp.read(4 * n)
    out.write(f"{n} samples\n")
    out.flush()
"""
_SIGILL = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"


class _Onnx:
    def __init__(self) -> None:
        self.calls = 0

    def transcribe(self, x: np.ndarray) -> str:
        self.calls += 1
        return f"onnx {x.size}"


def test_a_worker_that_runs_is_the_scorer(monkeypatch) -> None:
    monkeypatch.setattr(eval_codec, "_WORKER", _ECHO)
    onnx = _Onnx()
    s = MoonshineScorer(recycle=2, onnx_model=onnx)
    pad = 2 * int(eval_codec.PAD_S * 16000)
    try:
        assert [s.transcribe(np.zeros(100, np.float32), 16000) for _ in range(3)] == [
            f"{100 + pad} samples"
        ] * 3
    finally:
        s.close()
    assert s.backend == "cpp" and s.fallback_reason is None and onnx.calls == 0


def test_a_worker_that_cannot_run_here_falls_back_to_onnxruntime(monkeypatch) -> None:
    monkeypatch.setattr(eval_codec, "_WORKER", _SIGILL)
    onnx = _Onnx()
    s = MoonshineScorer(onnx_model=onnx)
    with pytest.warns(RuntimeWarning, match="illegal instruction"):
        first = s.transcribe(np.zeros(100, np.float32), 16000)
    assert first.startswith("onnx ") and s.backend == "onnx"
    assert "SIGILL" in str(s.fallback_reason)
    s.transcribe(np.zeros(100, np.float32), 16000)  # no new worker: straight to onnxruntime
    assert onnx.calls == 2 and s._proc is None


def test_asking_for_cpp_where_it_cannot_run_fails_clearly(monkeypatch) -> None:
    monkeypatch.setattr(eval_codec, "_WORKER", _SIGILL)
    s = MoonshineScorer(backend="cpp", onnx_model=_Onnx())
    with pytest.raises(RuntimeError, match="illegal instruction"):
        s.transcribe(np.zeros(100, np.float32), 16000)
    with pytest.raises(ValueError, match="backend"):
        MoonshineScorer(backend="gpu")
