"""Where a live server's memory goes: `DUPLEX_TRACEMALLOC=FRAMES duplex serve ...` starts tracemalloc with
that many frames per allocation; each SIGUSR2 writes a report to `DUPLEX_TRACEMALLOC_OUT` (default
memtrace.txt): RSS (and RSS after glibc's malloc_trim), what tracemalloc traces (Python objects and numpy buffers; not torch's or onnxruntime's
native allocations), and the top allocation sites grown since the first report. docs/operations.md."""

from __future__ import annotations

import gc
import os
import signal
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

from duplex.runtime.heap import malloc_trim, rss_mb


def live_tensors() -> dict[str, tuple[int, int]]:
    """Live torch tensors reachable by the garbage collector, by dtype and shape: (count, bytes of their
    distinct storages). tracemalloc does not see tensor storage; this does (when torch is loaded)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    seen: set[int] = set()
    out: dict[str, tuple[int, int]] = {}
    with warnings.catch_warnings():  # isinstance() on some torch module objects warns of deprecations
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            if obj.device.type != "cpu":
                continue
            storage = obj.untyped_storage()
            key = f"{str(obj.dtype).replace('torch.', '')}{list(obj.shape)}"
            ptr = storage.data_ptr()
            size = 0 if ptr in seen else storage.nbytes()
            seen.add(ptr)
        except Exception:  # a tensor subclass or a freed storage: not ours to judge
            continue
        n, b = out.get(key, (0, 0))
        out[key] = (n + 1, b + size)
    return out


class MemTrace:
    """Snapshots on demand; `report()` compares with the first one (the baseline)."""

    def __init__(self, frames: int = 8, out: Path | None = None, top: int = 30, trim: bool = True) -> None:
        self.frames, self.top, self.trim = max(1, frames), top, trim
        self.out = out or Path("memtrace.txt")
        self.base: tracemalloc.Snapshot | None = None
        self.base_tensors: dict[str, tuple[int, int]] = {}
        self.base_rss = 0.0
        self.t0 = time.time()

    def start(self) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)

    def report(self) -> str:
        gc.collect()
        snap = tracemalloc.take_snapshot().filter_traces(
            (
                tracemalloc.Filter(False, tracemalloc.__file__),
                tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
            )
        )
        traced, peak = tracemalloc.get_traced_memory()
        rss = rss_mb()
        trimmed = malloc_trim() if self.trim else None
        lines = [
            f"== {time.strftime('%H:%M:%S')} (+{time.time() - self.t0:.0f} s): RSS {rss:.1f} MB"
            + (f" ({trimmed:.1f} MB after malloc_trim)" if trimmed is not None else "")
            + f", traced {traced / 1e6:.1f} MB (peak {peak / 1e6:.1f} MB), gc objects {len(gc.get_objects())}"
        ]
        tensors = live_tensors()
        lines.append(
            f"live torch tensors: {sum(n for n, _ in tensors.values())}, "
            f"{sum(b for _, b in tensors.values()) / 1e6:.1f} MB of storage"
        )
        if self.base is None:
            self.base, self.base_rss, self.base_tensors = snap, rss, tensors
            lines.append("baseline taken; the next report shows what grew since")
        else:
            grown = sorted(
                (
                    (b - self.base_tensors.get(k, (0, 0))[1], n - self.base_tensors.get(k, (0, 0))[0], k)
                    for k, (n, b) in tensors.items()
                ),
                reverse=True,
            )
            lines.append("tensor storage grown since the baseline, by dtype and shape:")
            lines += [f"{db / 1e6:+9.3f} MB {dn:+6d} tensors  {k}" for db, dn, k in grown[:15] if db > 0]
            lines.append(f"since the baseline: RSS {rss - self.base_rss:+.1f} MB; top sites by growth:")
            for stat in snap.compare_to(self.base, "traceback")[: self.top]:
                if stat.size_diff <= 0:
                    continue
                lines.append(f"{stat.size_diff / 1e6:+9.3f} MB {stat.count_diff:+8d} blocks")
                lines += [f"      {fr.filename}:{fr.lineno}" for fr in stat.traceback[-self.frames :]]
        text = "\n".join(lines) + "\n"
        with open(self.out, "a") as f:
            f.write(text)
        return text


def install_from_env(env: dict[str, str] | None = None) -> MemTrace | None:
    """`DUPLEX_TRACEMALLOC=FRAMES`: start tracing and report on SIGUSR2. None when the variable is unset."""
    env = dict(os.environ if env is None else env)
    value = env.get("DUPLEX_TRACEMALLOC", "").strip()
    if not value:
        return None
    try:
        frames = int(value)
    except ValueError:
        raise ValueError(f"DUPLEX_TRACEMALLOC must be a number of frames, not {value!r}") from None
    trace = MemTrace(frames, Path(env.get("DUPLEX_TRACEMALLOC_OUT", "memtrace.txt")))
    trace.start()

    def on_signal(*_: Any) -> None:
        trace.report()

    signal.signal(signal.SIGUSR2, on_signal)
    return trace
