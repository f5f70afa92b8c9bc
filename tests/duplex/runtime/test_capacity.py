"""`--max-sessions auto`: the measured capacity is recorded per profile and device, read back, and
the service admits exactly that many sessions and says where the figure came from."""

from __future__ import annotations

import json

import pytest

from duplex.base.config import ConfigError, load_profile
from duplex.base.limits import ServerLimits
from duplex.runtime.capacity import (
    FALLBACK_SESSIONS,
    calibrated_capacity,
    device_signature,
    record_capacity,
    resolve_max_sessions,
)
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.fakes import fake_stages, scripted_answer


def test_record_and_read_back_per_profile_and_device(tmp_path):
    path = tmp_path / "capacity.json"
    assert calibrated_capacity("cpu", device="cpu:x x2", path=path) is None
    record_capacity("cpu", 3, {"onset_p90_s": {"3": 0.9}}, device="cpu:x x2", path=path)
    record_capacity("cpu", 40, {}, device="cuda:H100 x1", path=path)
    assert calibrated_capacity("cpu", device="cpu:x x2", path=path)["sessions"] == 3
    assert calibrated_capacity("cpu-streaming", device="cpu:x x2", path=path) is None
    assert resolve_max_sessions("cpu", device="cuda:H100 x1", path=path)[0] == 40
    # a newer measurement replaces the older one
    record_capacity("cpu", 2, {}, device="cpu:x x2", path=path)
    assert resolve_max_sessions("cpu", device="cpu:x x2", path=path) == (
        2,
        f"calibrated {calibrated_capacity('cpu', device='cpu:x x2', path=path)['measured_at']}",
    )
    assert len(json.loads(path.read_text())) == 2


def test_uncalibrated_falls_back_and_says_how_to_measure(tmp_path, caplog):
    n, source = resolve_max_sessions("cpu", device="cpu:y x2", path=tmp_path / "none.json")
    assert n == FALLBACK_SESSIONS and "--calibrate" in source
    assert "never calibrated" in caplog.text


def test_zero_capacity_still_admits_one_and_a_broken_file_is_empty(tmp_path):
    path = tmp_path / "capacity.json"
    record_capacity("cpu", 0, {}, device="d", path=path)
    assert resolve_max_sessions("cpu", device="d", path=path)[0] == 1
    path.write_text("{not json")
    assert calibrated_capacity("cpu", device="d", path=path) is None
    with pytest.raises(ValueError):
        record_capacity("cpu", -1, {}, device="d", path=path)


def test_limits_accept_auto():
    limits = ServerLimits().with_overrides({"max_sessions": "auto"})
    assert limits.max_sessions_auto
    assert not limits.with_overrides({"max_sessions": 5}).max_sessions_auto
    with pytest.raises(ConfigError):
        ServerLimits().with_overrides({"max_sessions": "many"})
    with pytest.raises(ConfigError):
        ServerLimits().with_overrides({"max_sessions_auto": True})


def test_service_admits_the_calibrated_number_and_reports_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DUPLEX_CACHE", str(tmp_path))
    record_capacity("cpu", 3, {"rule": "test"}, device=device_signature())
    limits = ServiceLimits(**vars(ServerLimits().with_overrides({"max_sessions": "auto"})))
    service = DuplexService(load_profile("cpu"), fake_stages(scripted_answer), limits=limits)
    try:
        health = service.health()
        assert health["max_sessions"] == 3 and health["available"] == 3
        assert health["capacity_source"].startswith("calibrated")
        for i in range(3):
            assert not service.full()
            service.sessions[f"s{i}"] = object()  # type: ignore[assignment]
        assert service.full() and not service.ready() and service.health()["available"] == 0
        service.sessions.clear()
    finally:
        service.close()


def test_the_device_signature_does_not_import_torch_on_a_machine_without_cuda(tmp_path) -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "import duplex.runtime.capacity as c\n"
        f"c.NVIDIA_DRIVER = Path({str(tmp_path / 'no-driver')!r})\n"
        "sig = c.device_signature()\n"
        "print(sig.startswith('cpu:'), 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]
