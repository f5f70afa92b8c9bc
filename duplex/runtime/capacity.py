"""How many sessions this device serves within budget: `duplex serve --max-sessions auto`.

The figure is measured, not guessed: `duplex bench --serve --sessions 1,2,4,8 --calibrate` runs N
callers at once and records the largest N that kept every target (answer onset P90, barge-in stop
P90, no gap inside an answer's audio) in `$DUPLEX_CACHE/capacity.json` (default ~/.cache/duplex),
keyed by profile and device (CPU model and core count, or the CUDA device's name). `auto` reads it;
on a device/profile never calibrated it falls back to `FALLBACK_SESSIONS` and says how to calibrate.
The server then refuses the next session with HTTP 503 before the upgrade, and `/healthz` reports
the capacity and where it came from, so a load balancer routes around a full instance.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("duplex.capacity")

#: sessions `auto` allows on a device/profile with no calibration: one caller was measured to keep
#: the onset target on the 2-core CPU this project is built on, two nearly (issue 22)
FALLBACK_SESSIONS = 2
CALIBRATE_HINT = "duplex bench --serve --sessions 1,2,4,8 --calibrate"


def capacity_file() -> Path:
    """`$DUPLEX_CACHE/capacity.json` (default ~/.cache/duplex/capacity.json)."""
    root = os.environ.get("DUPLEX_CACHE") or str(Path.home() / ".cache" / "duplex")
    return Path(root) / "capacity.json"


#: where the NVIDIA driver shows itself; without it no CUDA device can be seen
NVIDIA_DRIVER = Path("/proc/driver/nvidia")


def device_signature() -> str:
    """The device the stages run on: the CUDA device when torch sees one, else CPU model x cores.

    torch is imported only where a CUDA device can exist (the NVIDIA driver is loaded) or it already is:
    a CPU server whose torch stages run in the engine's process never loads it (200 MB) for this."""
    if "torch" in sys.modules or NVIDIA_DRIVER.is_dir():
        try:
            import torch

            if torch.cuda.is_available():
                return f"cuda:{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
        except Exception:  # no torch, or a broken CUDA install: the CPU figure applies
            pass
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{model} x{os.cpu_count()}"


def _key(profile: str, device: str) -> str:
    return f"{profile} @ {device}"


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("capacity: cannot read %s (%s); treating it as empty", path, exc)
        return {}
    return doc if isinstance(doc, dict) else {}


def record_capacity(
    profile: str,
    sessions: int,
    evidence: dict[str, Any],
    *,
    device: str | None = None,
    path: Path | None = None,
) -> dict[str, Any]:
    """Store the measured capacity of `profile` on this device (replacing an older figure)."""
    if sessions < 0:
        raise ValueError(f"capacity must be >= 0 sessions, got {sessions}")
    path = path or capacity_file()
    device = device or device_signature()
    doc = _read(path)
    entry = {
        "profile": profile,
        "device": device,
        "sessions": int(sessions),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "evidence": evidence,
    }
    doc[_key(profile, device)] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return entry


def calibrated_capacity(
    profile: str, *, device: str | None = None, path: Path | None = None
) -> dict[str, Any] | None:
    """The recorded entry for `profile` on this device, or None."""
    entry = _read(path or capacity_file()).get(_key(profile, device or device_signature()))
    if not isinstance(entry, dict) or not isinstance(entry.get("sessions"), int):
        return None
    return entry


def resolve_max_sessions(
    profile: str, *, device: str | None = None, path: Path | None = None
) -> tuple[int, str]:
    """(sessions, where the figure comes from) for `--max-sessions auto`. A calibration that found
    no N within budget (0) still admits one session: the operator asked for a server."""
    entry = calibrated_capacity(profile, device=device, path=path)
    if entry is None:
        log.warning(
            "max_sessions auto: profile %r was never calibrated on this device (%s); admitting %d. "
            "Measure it: %s",
            profile,
            device or device_signature(),
            FALLBACK_SESSIONS,
            CALIBRATE_HINT,
        )
        return FALLBACK_SESSIONS, f"fallback (not calibrated: {CALIBRATE_HINT})"
    n = max(1, int(entry["sessions"]))
    log.info("max_sessions auto: %d (calibrated %s on %s)", n, entry.get("measured_at"), entry["device"])
    return n, f"calibrated {entry.get('measured_at')}"
