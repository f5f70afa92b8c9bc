"""The models.yaml `device` option ("cpu", "cuda", "cuda:N"): validated without a GPU, resolved at load.

Every stage that can run on a GPU (the LLMs, the flow voice) reads it through these two, so a GPU profile
fails the same clear way on a machine without CUDA, and never silently runs on the CPU."""

from __future__ import annotations

import re
from typing import Any

from duplex.base.config import ConfigError

_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(device: str, dtype: Any = None, what: str = "llm") -> None:
    """Validate a `device` option against `dtype`; ConfigError if not. Needs no GPU: whether CUDA is
    present is `require_device`'s question, asked at load."""
    if not isinstance(device, str) or not _DEVICE_RE.fullmatch(device):
        raise ConfigError(f"{what}: device {device!r} is not cpu, cuda or cuda:N")
    if device.startswith("cuda") and dtype == "int8-dynamic":
        # torch's dynamic int8 Linear (fbgemm/onednn) has CPU kernels only
        raise ConfigError(
            f"{what}: dtype int8-dynamic runs on the CPU only; with device {device} use dtype bfloat16 "
            "(or float16 on a GPU without bfloat16)"
        )


def require_device(device: str, what: str = "llm") -> Any:
    """The torch device of a validated `device` option; a clear ConfigError where CUDA is asked for but
    absent (a CPU-only torch, no driver, or fewer GPUs)."""
    import torch

    if device.startswith("cuda"):
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{what}: the profile's option `device: {device}` needs CUDA, but torch.cuda.is_available() "
                f"is False (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}). "
                f"Set `device: cpu` in the {what} options of models.yaml, or run the CPU profile: --profile cpu"
            )
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"{what}: the profile's option `device: {device}` names GPU {index}, but torch sees "
                f"{torch.cuda.device_count()}; use cuda:0..cuda:{torch.cuda.device_count() - 1} or --profile cpu"
            )
    return torch.device(device)
