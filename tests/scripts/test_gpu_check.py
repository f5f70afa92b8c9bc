"""scripts/gpu_check.sh --dry-run: runs anywhere, names each GPU step, and runs their CPU stand-ins."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from duplex.base.paths import REPO_ROOT


def test_gpu_check_dry_run(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "step 1: decode-agreement" in out and "duplex.bench.gpu_check" in out and "--device cuda" in out
    assert "step 2: load-bench" in out and "--profile gpu --sessions 1,8,32,64 --turns 3 --barge-ins 1" in out
    assert "step 3: capacity" in out and "duplex.bench.gpu_capacity --device cuda" in out
    assert "dry run done" in out
    cap = json.loads((tmp_path / "capacity-cpu" / "capacity.json").read_text())
    # every part ran (no error entries) and reported each session count
    assert [r["sessions"] for r in cap["llm"]["slow"]] == [1, 2] == [r["sessions"] for r in cap["tts"]]
    assert [r["sessions"] for r in cap["onset"]] == [1, 2] and cap["onset"][0]["onset_ms_p50"] > 0
    # the A/B variants ran too: the other decode attention, the voice's front half on the device
    assert len(cap["llm"]["drafter[per_session]"]) == 2 == len(cap["llm"]["drafter[padded]"])
    assert len(cap["tts[front=device]"]) == 2 and len(cap["onset[per_session]"]) == 2
    assert cap["llm_variants"] == ["pool", "per_session", "padded"]
    assert (
        cap["llm_weights"] == "slow=random, drafter=random"
        and cap["tts_weights"]["front_end"] == "TableFrontEnd"
    )
    # on one device, batched == one by one and the same device agrees with itself
    for name in ("slow", "drafter"):
        assert cap["agreement"][name]["tokens_device_batched_vs_one_by_one"] == 1.0
    assert (
        cap["agreement"]["tts"]["words_equal"] and cap["agreement"]["tts"]["max_abs_diff_device_vs_cpu"] == 0
    )
    assert (tmp_path / "capacity-cpu" / "capacity.png").stat().st_size > 10_000
    record = json.loads((tmp_path / "decode-agreement-cpu.json").read_text())
    assert record["device"] == "cpu" and record["dtype"] == "bfloat16"
    assert set(record["token_agreement"]) >= {
        "device_batched_vs_device_one_by_one",
        "device_one_by_one_vs_cpu_float32",
    }


def test_gpu_check_rejects_unknown_options() -> None:
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--bogus"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2 and "unknown option --bogus" in proc.stderr
