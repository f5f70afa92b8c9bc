"""Give freed heap memory back to the OS. The stages allocate and free large, varying buffers (LLM KV
windows, ASR segments, TTS audio) from several threads and glibc keeps freed pages for reuse: after
warm-up `malloc_trim(0)` released 550 MB (docs/results/2026-11-26.md, "Soak"). `HeapTrimmer` calls it from
a background thread every few seconds. (The soak's steady ~40 MB a minute was something else: a reference
cycle per stage job, fixed in the session runner; see below for the collector.)

Python's cycle collector is the other half: memory in reference cycles waits for a full collection, which
starts only once new long-lived objects pass a quarter of all of them; with the models' millions of
objects loaded that is minutes. `freeze_loaded()` takes what is alive after loading out of its reach (full
passes get short and frequent), and `GcPauses` reports each pass's length, which stalls every thread."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
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


def freeze_loaded() -> int:
    """Collect, then move every object alive now (models, libraries, config) to the collector's permanent
    generation (`gc.freeze`): later full passes walk only what sessions create. Returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Times the cycle collector's passes through `gc.callbacks`: `on_pause(generation, seconds, collected)`
    after each one. `install()` once; `remove()` when the service closes."""

    def __init__(self, on_pause: Callable[[int, float, int], None]) -> None:
        self.on_pause = on_pause
        self._t0 = 0.0
        self._installed = False

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        try:
            self.on_pause(
                int(info.get("generation", 0)), time.perf_counter() - self._t0, int(info.get("collected", 0))
            )
        except Exception:  # a metrics hook must never break a collection
            log.exception("gc pause observer failed")

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def remove(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False
