"""`duplex talk --input-wav q.wav --output-wav a.wav` on the real models: the answer in a.wav answers q."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from codec.resample import resample
from duplex.core.session import SR

pytestmark = pytest.mark.integration


def test_talk_from_files_writes_a_spoken_answer(live, tmp_path):
    from asr.moonshine import MoonshineModel
    from tests.speech import silence, synthesize

    question = np.concatenate(
        [silence(0.5, 24000), synthesize("What is the capital of France?", 24000), silence(0.5, 24000)]
    )
    q, a = tmp_path / "q.wav", tmp_path / "a.wav"
    sf.write(q, np.stack([question, question], axis=1), 24000)  # stereo 24 kHz, as a recorder would
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "duplex.cli",
            "talk",
            "--server",
            f"ws://127.0.0.1:{live.port}/v1/duplex",
            "--input-wav",
            str(q),
            "--output-wav",
            str(a),
            "--timeout",
            "90",
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "capital" in run.stdout.lower()  # the live transcript was printed
    answer, rate = sf.read(a, dtype="float32")
    assert answer.ndim == 1 and len(answer) > rate * 1.0
    lead = np.flatnonzero(np.abs(answer) > 0.01)
    # the answer starts after the question's last audible sample (hibari's clip ends in ~0.4 s of its
    # own silence, so the clip's end is not where the speech ends: with a 200 ms end of turn the answer
    # may start before it)
    speech_end = np.flatnonzero(np.abs(question) > 0.01)[-1] / 24000
    assert lead[0] / rate > speech_end
    heard = MoonshineModel().transcribe(resample(answer, rate, SR)).lower()
    assert "paris" in heard, (heard, run.stdout)
