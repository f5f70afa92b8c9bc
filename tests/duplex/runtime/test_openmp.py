"""Models load without leaving OpenMP pools on the loading threads (duplex/runtime/openmp.py).

What it buys is a speed (the engine's steps on a worker thread ~2x faster on a 2-core machine), measured
in docs/results, not here; these tests pin the mechanism."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from duplex.runtime.openmp import loaded_libgomp, loading_without_pools, release_idle_pools

torch = pytest.importorskip("torch")


def test_loading_runs_torch_at_one_thread_then_restores_the_count() -> None:
    before = torch.get_num_threads()
    with loading_without_pools():
        assert torch.get_num_threads() == 1
        # transformers converts weights on a helper pool: its threads see one thread too
        with ThreadPoolExecutor(2) as pool:
            assert pool.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == before


def test_the_count_is_restored_when_loading_fails() -> None:
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="no weights"), loading_without_pools():
        raise RuntimeError("no weights")
    assert torch.get_num_threads() == before


def test_the_loading_threads_idle_pool_can_be_freed() -> None:
    _ = torch.ones(300_000) + 1  # a parallel region: this thread now holds a pool
    if loaded_libgomp() is None:
        pytest.skip("torch here does not use GNU OpenMP")
    assert release_idle_pools()
    assert float((torch.ones(300_000) + 1).sum()) == 600_000  # a new pool when torch runs again


def test_the_service_loads_its_stages_inside_it(monkeypatch) -> None:
    import duplex.runtime.service as service

    seen: list[int] = []

    def fake_build(profile, progress=True, llm_process=None):
        seen.append(torch.get_num_threads())
        raise RuntimeError("stop after loading")

    monkeypatch.setattr(service, "build_stages", fake_build)
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="stop after loading"):
        service.DuplexService.load("cpu", progress=False, limits=service.ServiceLimits(llm_process=False))
    assert seen == [1] and torch.get_num_threads() == before


def test_a_failed_load_ends_the_llm_process_it_started(monkeypatch) -> None:
    import duplex.runtime.service as service

    class Started:
        closed = False

        def close(self) -> None:
            self.closed = True

    started = Started()
    given: list[object] = []

    def fake_build(profile, progress=True, llm_process=None):
        given.append(llm_process)
        raise RuntimeError("the voice is missing")

    monkeypatch.setattr(service, "start_llm_process", lambda profile, progress=True: started)
    monkeypatch.setattr(service, "build_stages", fake_build)
    with pytest.raises(RuntimeError, match="voice is missing"):
        service.DuplexService.load("cpu", progress=False)
    assert given == [started] and started.closed


BLAS_PROBE = """
import ctypes, numpy
from duplex.runtime.openmp import loaded_openblas, loading_without_pools
paths = loaded_openblas()
assert paths, "numpy here is not built on OpenBLAS"
lib = ctypes.CDLL(paths[0])
get = next(getattr(lib, n) for n in ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
           "openblas_get_num_threads64_", "openblas_get_num_threads") if hasattr(lib, n))
before = get()
with loading_without_pools(import_torch=False):
    pass
print(before, get())
"""


def test_numpys_blas_runs_at_one_thread_after_loading() -> None:
    """OpenBLAS's workers spin after each call and took a core from the engine's listen step (the
    acoustic end-of-turn cue's filterbank product, once per transcript); after loading it is held to one."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", BLAS_PROBE],
        capture_output=True,
        text=True,
        env={"OPENBLAS_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    if "not built on OpenBLAS" in out.stderr:
        pytest.skip("numpy here is not built on OpenBLAS")
    assert out.returncode == 0, out.stderr
    before, after = (int(x) for x in out.stdout.split())
    assert (before, after) == (2, 1)
