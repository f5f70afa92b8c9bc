"""The models.yaml `device` option ("cpu", "cuda", "cuda:N"): validated without a GPU, resolved at load.

Every stage that can run on a GPU (the LLMs, the flow voice) reads it through these two, so a GPU profile
fails the same clear way on a machine without CUDA, and never silently runs on the CPU."""

from __future__ import annotations

import contextlib
import os
import re
import time
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


#: a `threads` option that follows the machine: as many threads as cores are free when the work starts
AUTO = "auto"

Threads = int | str | None


def _runnable() -> int | None:
    """Tasks runnable on the whole machine right now, this one included (/proc/loadavg's 4th field);
    None where the file does not exist (not Linux)."""
    try:
        with open("/proc/loadavg", "rb") as fh:
            return int(fh.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


#: other processes of this service (a stage process's server): their work is the service's own, which
#: its budgets and scheduling already share the cores with, so `free_cores` does not count it
_SERVICE_PIDS: set[int] = set()


def count_as_own(pid: int) -> None:
    """Treat `pid`'s threads as this process's own in `free_cores` (a stage process registers its server)."""
    _SERVICE_PIDS.add(int(pid))


def _runnable_threads(pid: str) -> int:
    """Runnable threads of process `pid` ("self" or a number) right now; 0 if it cannot be read."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    n = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue  # a thread that ended meanwhile
        end = stat.rfind(b")")
        n += stat[end + 2 : end + 3] == b"R"
    return n


def _own_runnable(total: int | None = None) -> int:
    """This service's runnable threads right now, the reader included: this process's (its own OpenMP
    workers still spinning after a parallel region are not other work) and its registered siblings'.
    Given the machine's `total`, the siblings are not read when this process alone accounts for it (the
    usual case on a step's hot path: nothing else runs)."""
    own = _runnable_threads("self")
    if total is not None and total <= own:
        return max(1, own)
    return max(1, own + sum(_runnable_threads(str(p)) for p in _SERVICE_PIDS))


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def free_cores(samples: int = 2, gap_s: float = 0.001) -> int:
    """Cores not held by other work right now: usable cores minus the runnable tasks that are not this
    service's threads (the fewest of `samples` readings `gap_s` apart, so a brief job elsewhere is not
    counted), at least 1.
    Where the count cannot be read, every usable core."""
    cores = usable_cores()
    seen = []
    for i in range(max(1, samples)):
        if i:
            time.sleep(gap_s)
        n = _runnable()
        if n is None:
            return cores
        seen.append(n - _own_runnable(n))  # this process's threads, the reader among them, are not others
    return max(1, min(cores, cores - min(seen)))


def resolve_threads(n: Threads) -> int | None:
    """A `threads` option as a count: an int as it is, None unchanged, "auto" the cores free right now.

    Why "auto": with the OpenMP backend every parallel region waits for its slowest thread, so a step
    with two threads on a machine where another process holds one of two cores runs at that process's
    time slices: the `cpu` profile's 0.5B decoded 494 ms a token with two threads against 75 ms with one
    while a training run held a core, and 48 against 74 ms on an idle machine (docs/operations.md, "Sharing
    the CPU")."""
    if n == AUTO:
        return free_cores()
    return n if n is None else int(n)


@contextlib.contextmanager
def torch_threads(n: Threads) -> Iterator[None]:
    """torch's intra-op threads set to `n` around a block, then the previous count back (None: unchanged;
    "auto": the cores free when the block starts, `resolve_threads`).

    A stage sets its own count around its own work: with the OpenMP backend the setting belongs to the
    calling thread (an executor worker), and a stage with more threads than the cores left to it (the
    dialogue engine's process takes one of two) makes every parallel region wait on the other."""
    n = resolve_threads(n)
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


def check_threads(value: Any, what: str, name: str = "threads") -> Threads:
    """A `threads` option (named `name`): None (the process's setting), an int >= 1 or "auto" (the cores
    free when each call starts); ConfigError otherwise."""
    if value is None or value == AUTO:
        return value  # type: ignore[no-any-return]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f'{what}: {name} must be an integer >= 1, "auto" or null, not {value!r}')
    return value
