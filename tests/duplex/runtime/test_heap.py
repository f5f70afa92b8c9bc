"""The heap trimmer gives freed memory back, reports what it did, stops cleanly, and is off at 0."""

from __future__ import annotations

import time

import pytest

from duplex.base.config import load_profile
from duplex.base.limits import ServerLimits
from duplex.runtime.heap import HeapTrimmer, rss_mb
from duplex.runtime.metrics import sample
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.fakes import fake_stages, scripted_answer

pytestmark = pytest.mark.skipif(not HeapTrimmer(1).available, reason="needs glibc's malloc_trim")


def test_freed_small_blocks_go_back_to_the_os() -> None:
    trimmer = HeapTrimmer(0)
    trimmer.trim_once()
    # many small blocks (below glibc's mmap threshold) freed in the middle of the heap stay in the process
    keep = [bytearray(20_000) for _ in range(12_000)]  # ~240 MB
    pin = bytearray(20_000)  # allocated last: the heap top cannot simply shrink
    del keep
    before = rss_mb()
    took, released = trimmer.trim_once()
    assert released > 100 and rss_mb() < before - 100, (before, released)
    assert took < 2.0
    del pin


def test_the_service_trims_on_a_timer_and_counts_it() -> None:
    limits = ServiceLimits(max_sessions=1, heap_trim_s=0.05)
    service = DuplexService(load_profile("cpu"), fake_stages(scripted_answer), limits=limits)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not sample(
            service.metrics.render().decode(), "duplex_heap_trims_total"
        ):
            time.sleep(0.05)
        assert sample(service.metrics.render().decode(), "duplex_heap_trims_total") >= 1
    finally:
        service.close()
    assert service.heap._thread is None  # stopped with the service


def test_zero_turns_it_off() -> None:
    assert ServerLimits().with_overrides({"heap_trim_s": 0}).heap_trim_s == 0
    trimmer = HeapTrimmer(0)
    trimmer.start()
    assert trimmer._thread is None
