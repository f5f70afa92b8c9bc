"""Give freed heap memory back to the OS. The stages allocate and free large, varying buffers (LLM KV
windows, ASR segments, TTS audio) from several threads; glibc keeps freed pages for reuse, and a live
server's RSS grew ~40 MB a minute while tracemalloc saw ~0.3 MB: `malloc_trim(0)` released 550 MB of it
(docs/results/2026-11-26.md, "Soak"). `HeapTrimmer` calls it from a background thread every few seconds."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("duplex.runtime.heap")


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError, IndexError):
        return float("nan")


def _libc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _libc_trim()


def malloc_trim() -> float | None:
    """Release free heap pages; RSS in MB after it, or None where there is no glibc malloc_trim."""
    if _TRIM is None:
        return None
    _TRIM(0)
    return rss_mb()


class HeapTrimmer:
    """Every `interval_s`, from its own daemon thread: malloc_trim, then `on_trim(seconds, released_mb)`."""

    def __init__(self, interval_s: float, on_trim: Callable[[float, float], None] | None = None) -> None:
        self.interval_s = float(interval_s)
        self.on_trim = on_trim
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return _TRIM is not None

    def start(self) -> None:
        if self.interval_s <= 0 or not self.available or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="heap-trim", daemon=True)
        self._thread.start()

    def trim_once(self) -> tuple[float, float]:
        before = rss_mb()
        t0 = time.perf_counter()
        after = malloc_trim()
        took = time.perf_counter() - t0
        released = max(0.0, before - after) if after is not None else 0.0
        if self.on_trim is not None:
            self.on_trim(took, released)
        return took, released

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                took, released = self.trim_once()
            except Exception:  # never take the server down for housekeeping
                log.exception("heap trim failed; stopping the trimmer")
                return
            if released > 50:
                log.info("heap trim released %.0f MB in %.0f ms", released, 1000 * took)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
