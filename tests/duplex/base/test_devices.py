"""`threads` options: validation, and "auto" following the cores other work leaves free."""

from __future__ import annotations

import pytest
import torch

from duplex.base import devices
from duplex.base.config import ConfigError
from duplex.base.devices import AUTO, check_threads, free_cores, resolve_threads, torch_threads


def test_auto_counts_the_cores_other_runnable_tasks_leave(monkeypatch):
    monkeypatch.setattr(devices, "usable_cores", lambda: 4)
    monkeypatch.setattr(devices, "_own_runnable", lambda total=None: 1)  # only the reader of this process
    readings = iter([3, 1])  # a brief job elsewhere in the first reading: the fewer counts
    monkeypatch.setattr(devices, "_runnable", lambda: next(readings))
    assert free_cores(samples=2, gap_s=0) == 4  # only this reader was runnable at the second reading
    monkeypatch.setattr(devices, "_runnable", lambda: 3)  # two others busy throughout
    assert free_cores(samples=2, gap_s=0) == 2
    monkeypatch.setattr(devices, "_runnable", lambda: 9)  # more work than cores: still one thread
    assert free_cores(samples=2, gap_s=0) == 1
    monkeypatch.setattr(devices, "_runnable", lambda: None)  # no /proc/loadavg: every usable core
    assert free_cores() == 4


def test_resolve_and_scoped_threads(monkeypatch):
    monkeypatch.setattr(devices, "free_cores", lambda: 1)
    assert resolve_threads(AUTO) == 1 and resolve_threads(3) == 3 and resolve_threads(None) is None
    before = torch.get_num_threads()
    with torch_threads(AUTO):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_the_real_count_is_within_the_usable_cores():
    n = free_cores()
    assert 1 <= n <= devices.usable_cores()
    assert devices._own_runnable() >= 1  # the reader itself


def test_this_processs_own_busy_threads_are_not_counted_as_other_work(monkeypatch):
    monkeypatch.setattr(devices, "usable_cores", lambda: 2)
    monkeypatch.setattr(devices, "_runnable", lambda: 2)  # the reader and one of its own pool's threads
    monkeypatch.setattr(devices, "_own_runnable", lambda total=None: 2)
    assert free_cores(samples=1) == 2


def test_threads_options_are_checked():
    assert (
        check_threads(None, "tts") is None
        and check_threads(AUTO, "tts") == AUTO
        and check_threads(2, "x") == 2
    )
    for bad in (0, -1, True, 1.5, "two"):
        with pytest.raises(ConfigError, match='threads must be an integer >= 1, "auto" or null'):
            check_threads(bad, "llm")


def test_a_registered_service_process_counts_as_own(monkeypatch):
    import os

    monkeypatch.setattr(devices, "_SERVICE_PIDS", set())
    alone = devices._own_runnable()
    devices.count_as_own(os.getpid())  # this very process, counted a second time: at least as many
    assert devices._own_runnable() >= alone
    monkeypatch.setattr(devices, "_SERVICE_PIDS", {2**22 + 7})  # a process that is gone: nothing to read
    assert devices._own_runnable() >= 1
