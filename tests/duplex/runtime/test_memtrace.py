"""DUPLEX_TRACEMALLOC: off by default, a clear error for a bad value, and reports that name what grew."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from duplex.runtime.memtrace import MemTrace, install_from_env


def test_off_unless_asked() -> None:
    assert install_from_env({}) is None


def test_a_bad_value_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="number of frames"):
        install_from_env({"DUPLEX_TRACEMALLOC": "yes"})


def test_the_second_report_names_the_site_that_grew(tmp_path: Path) -> None:
    was = tracemalloc.is_tracing()
    trace = MemTrace(4, tmp_path / "mem.txt")
    trace.start()
    try:
        assert "baseline taken" in trace.report()
        hoard = [bytearray(1000) for _ in range(2000)]  # ~2 MB from this line
        text = trace.report()
        assert "since the baseline" in text and "test_memtrace.py" in text
        assert (tmp_path / "mem.txt").read_text().count("==") == 2
        del hoard
    finally:
        if not was:
            tracemalloc.stop()
