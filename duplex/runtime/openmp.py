"""Load the models without leaving OpenMP thread pools behind on the loading threads.

The models load and warm up on the main thread (transformers also converts weights on a helper thread
pool of its own), and every stage then runs on the executor's worker threads. libgomp keeps a thread
pool per thread that ever ran a parallel region; with more of its threads alive than cores it stops
spinning at its barriers ("throttled" waits), so every parallel region of torch on a worker (each
matmul of each decode step) pays a futex sleep and wake: ~100 µs instead of ~15 µs on this 2-core
machine, and the dialogue engine's steps ran twice as slowly in the server as in a script (the turn
head's listen step at a pause 54 vs 30 ms, the first draft 79 vs 38 ms, P50 of 12 turns;
docs/results/2026-11-27.md#tenth-session). Loading at one intra-op thread makes no pools;
`omp_pause_resource_all` (OpenMP 5.0) frees whatever the loading thread still holds.

numpy's OpenBLAS is held to one thread after loading for the same reason (`single_threaded_blas`): its
workers spin ~0.1 s after each call, and one small product per transcript (the acoustic end-of-turn
cue's mel filterbank, asr/end_of_turn.py) kept a core busy just when the engine's listen step needed it
(listen at a pause 23-40 → 117-179 ms, onset P50 349 → 471 ms; docs/results/2026-11-27.md#fifteenth-session).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
from collections.abc import Iterator

log = logging.getLogger("duplex.runtime.openmp")

OMP_PAUSE_SOFT = 1


def _loaded_libraries(name_part: str) -> list[str]:
    """Paths of the shared libraries this process has mapped whose file name holds `name_part`
    (case-insensitive), in the order of /proc/self/maps."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                name = path.rsplit("/", 1)[-1].lower()
                if path.startswith("/") and name_part in name and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def loaded_libgomp() -> str | None:
    """Path of the GNU OpenMP runtime this process has loaded (torch's own copy), if any."""
    return next(iter(_loaded_libraries("libgomp")), None)


def release_idle_pools() -> bool:
    """`omp_pause_resource_all(omp_pause_soft)`: free the calling thread's idle OpenMP pool. True if it
    ran and succeeded. Call it outside any parallel region."""
    path = loaded_libgomp()
    if path is None:
        return False
    try:
        fn = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0's pause API
        log.info("openmp: %s has no omp_pause_resource_all; the loading thread's pool stays", path)
        return False
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return bool(fn(OMP_PAUSE_SOFT) == 0)


#: the thread-count setters of the OpenBLAS builds numpy ships (scipy-openblas, 64-bit ints) or a system one
_OPENBLAS_SETTERS = (
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)


def loaded_openblas() -> list[str]:
    """Paths of the OpenBLAS libraries this process has loaded (numpy's, scipy's)."""
    return _loaded_libraries("openblas")


def single_threaded_blas() -> int:
    """Hold every loaded OpenBLAS to one thread; returns how many libraries were set. The stages run at
    their own thread counts (torch, onnxruntime); numpy's small products do not need a pool that spins
    on the cores they use."""
    done = 0
    for path in loaded_openblas():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _OPENBLAS_SETTERS:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int], None
                fn(1)
                done += 1
                break
    return done


@contextlib.contextmanager
def loading_without_pools(import_torch: bool = True) -> Iterator[None]:
    """torch at one intra-op thread inside (no OpenMP pool is made on this thread or on the helper
    threads that load weights); after it, the previous thread count back, this thread's pool freed, and
    numpy's OpenBLAS held to one thread (`single_threaded_blas`).

    `import_torch=False`: a process whose stages may not need torch (the dialogue engine in a process of its
    own) does not import it for this; if a stage imported it meanwhile, its idle pool is still freed."""
    with _torch_without_pools(import_torch):
        yield
    single_threaded_blas()


@contextlib.contextmanager
def _torch_without_pools(import_torch: bool) -> Iterator[None]:
    if not import_torch and "torch" not in sys.modules:
        yield
        if "torch" in sys.modules:
            release_idle_pools()
        return
    try:
        import torch
    except ImportError:  # no torch stage in this process
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        freed = release_idle_pools()
        log.info(
            "openmp: models loaded at 1 thread, %d threads from now on (idle pool freed: %s)", before, freed
        )
