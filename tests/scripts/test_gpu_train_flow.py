"""scripts/gpu_train_flow.sh --dry-run: starts from the shipped flow weights, trains a few steps, exports;
then tunes the codec's decoder on that flow and exports a codec with the shipped one's latent."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from duplex.base.paths import REPO_ROOT


@pytest.mark.integration
def test_gpu_train_flow_dry_run_continues_the_shipped_weights(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", "scripts/gpu_train_flow.sh", "--dry-run"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shipped = json.loads((REPO_ROOT / "tts" / "weights" / "flow_model.json").read_text())
    assert f"started from the exported weights in tts/weights at step {shipped['step']}" in proc.stdout
    out = json.loads((tmp_path / "tts-weights" / "flow_model.json").read_text())
    assert out["step"] > shipped["step"] and out["config"] == shipped["config"]
    assert out["codec_sha256"] == shipped["codec_sha256"]  # decodes with the shipped codec
    assert (tmp_path / "tts-weights" / "flow_model.safetensors").stat().st_size > 1_000_000
    from codec.speech_codec import latent_sha256

    tuned = tmp_path / "codec-weights" / "speech_codec.safetensors"
    assert latent_sha256(str(tuned)) == shipped["codec_latent_sha256"]  # the flow still fits the tuned codec
    assert "tts.training.tune_decoder" in json.loads(tuned.with_suffix(".json").read_text())["train_command"]


def test_gpu_train_flow_rejects_unknown_options() -> None:
    proc = subprocess.run(
        ["bash", "scripts/gpu_train_flow.sh", "--bogus"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "unknown option --bogus" in proc.stderr
