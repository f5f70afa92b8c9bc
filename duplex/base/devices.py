"""The models.yaml `device` option ("cpu", "cuda", "cuda:N"): validated without a GPU, resolved at load.

Every stage that can run on a GPU (the LLMs, the flow voice) reads it through these two, so a GPU profile
fails the same clear way on a machine without CUDA, and never silently runs on the CPU."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
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


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `n` around a block, then the previous count back (None: unchanged).

    A stage sets its own count around its own work: with the OpenMP backend the setting belongs to the
    calling thread (an executor worker), and a stage with more threads than the cores left to it (the
    dialogue engine's process takes one of two) makes every parallel region wait on the other."""
    if n is None:
        yield
        return
    import torch

    if torch.get_num_threads() == n:
        yield
        return
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def check_threads(value: Any, what: str) -> int | None:
    """A `threads` option: None (the process's setting) or an int >= 1; ConfigError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what}: threads must be an integer >= 1 or null, not {value!r}")
    return value
