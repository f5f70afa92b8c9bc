"""A stage served by a child process behaves as the same stage in this process (duplex/runtime/stage_process.py)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from duplex.core.jobs import Job
from duplex.runtime.executor import DeviceExecutor
from duplex.runtime.stage_process import (
    RemoteState,
    StageProcess,
    StageProcessDied,
    StageProcessError,
    StateLost,
)
from duplex.testing.fakes import counter_stage


def _run_script(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    """Run `source` as a script of its own (its own main module) and return what it did; it must succeed."""
    script = tmp_path / "script.py"
    script.write_text(source)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def remote() -> Iterator[StageProcess]:
    stage = StageProcess(counter_stage, (10,), name="counter").wait_ready(60)
    yield stage
    stage.close()


def test_it_steps_in_another_process_with_the_stages_attributes(remote: StageProcess) -> None:
    assert remote.kind == "counter" and remote.listens is True
    assert not hasattr(remote, "policy")  # the counter has none: absent here too
    pid, _ = remote.step(remote.init_state(), "pid")
    assert pid == remote.pid and pid != os.getpid()


def test_steps_equal_the_same_stage_in_this_process(remote: StageProcess) -> None:
    local = counter_stage(10)
    chunks = [3, 4, -2, 7]
    local_state, remote_state = local.init_state(), remote.init_state()
    local_outs, remote_outs = [], []
    for chunk in chunks:
        out, local_state = local.step(local_state, chunk)
        local_outs.append(out)
        out, remote_state = remote.step(remote_state, chunk)
        remote_outs.append(out)
    assert remote_outs == local_outs == [13, 17, 15, 22]
    assert isinstance(remote_state, RemoteState) and not remote_state.fresh


def test_a_batch_keeps_each_sessions_state_apart(remote: StageProcess) -> None:
    a, b = remote.init_state(), remote.init_state()
    (out_a, a), (out_b, b) = remote.step_batch([(a, 1), (b, 100)])
    assert (out_a, out_b) == (11, 110)
    (out_b, b), (out_a, a) = remote.step_batch([(b, 1), (a, 1)])
    assert (out_a, out_b) == (12, 111)


def test_a_state_stepped_twice_is_updated_in_place_as_in_this_process(remote: StageProcess) -> None:
    # the service's warm-up steps one state twice without taking the new one: the engine's caches are
    # updated in place, so both steps see one conversation
    state = remote.init_state()
    remote.step(state, 5)
    out, _ = remote.step(state, 5)
    assert out == 20


def test_dropped_states_are_freed_in_the_child(remote: StageProcess) -> None:
    gc.collect()
    before = remote.info()["states"]
    state = remote.init_state()
    for _ in range(50):
        _, state = remote.step(state, 1)
    assert remote.info()["states"] == before + 1  # only the last handle's state is alive there
    del state
    gc.collect()
    assert remote.info()["states"] == before


def test_an_exception_of_the_stage_is_raised_here(remote: StageProcess) -> None:
    with pytest.raises(ValueError, match="asked to fail"):
        remote.step(remote.init_state(), "raise")
    with pytest.raises(RuntimeError, match="_Unpicklable: holds a lambda"):
        remote.step(remote.init_state(), "unpicklable")
    out, _ = remote.step(remote.init_state(), 1)  # the process is still serving
    assert out == 11


def test_two_threads_step_at_once_on_their_own_connections(remote: StageProcess) -> None:
    results: dict[int, int] = {}

    def run(i: int) -> None:
        state = remote.init_state()
        for _ in range(20):
            out, state = remote.step(state, i)
        results[i] = out

    threads = [threading.Thread(target=run, args=(i,)) for i in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {1: 30, 2: 50, 3: 70}


def test_the_executor_runs_it_like_any_stage(remote: StageProcess) -> None:
    executor = DeviceExecutor(bulk_workers=1)
    executor.register(remote, name="llm")
    try:
        state = remote.init_state()
        job = Job("llm", "llm.step", "s1", 1, state, 2, deadline=executor.now() + 5)
        out, new_state = executor.submit(job).result(10)
        assert out == 12 and isinstance(new_state, RemoteState)
        bad = Job("llm", "llm.step", "s2", 1, remote.init_state(), "raise", deadline=executor.now() + 5)
        with pytest.raises(ValueError):
            executor.submit(bad).result(10)
    finally:
        executor.close()


def test_a_stage_that_fails_to_load_says_why() -> None:
    stage = StageProcess(counter_stage, (0,), {"fail_to_load": True}, name="counter")
    try:
        with pytest.raises(StageProcessError, match="weights are missing"):
            stage.wait_ready(60)
    finally:
        stage.close()


def test_a_dead_process_fails_the_step_and_the_next_step_gets_a_new_one() -> None:
    stage = StageProcess(counter_stage, (0,), name="counter", max_restarts=1).wait_ready(60)
    try:
        kept = stage.init_state()
        _, kept = stage.step(kept, 4)
        first_pid = stage.pid
        with pytest.raises(StageProcessDied, match="exit code"):
            stage.step(stage.init_state(), "exit")
        # the session whose state lived there gets a clear error; a new session works
        with pytest.raises(StateLost):
            stage.step(kept, 1)
        out, _ = stage.step(stage.init_state(), 2)
        assert out == 2 and stage.pid != first_pid and stage.restarts == 1
        with pytest.raises(StageProcessDied):
            stage.step(stage.init_state(), "exit")
        with pytest.raises(StageProcessDied, match="not again"):
            stage.step(stage.init_state(), 1)
    finally:
        stage.close()


def test_close_ends_the_child() -> None:
    stage = StageProcess(counter_stage, (0,), name="counter").wait_ready(60)
    process = stage._process
    stage.step(stage.init_state(), 1)
    stage.close()
    deadline = time.monotonic() + 10
    while process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process.is_alive()
    with pytest.raises(StageProcessDied, match="closed"):
        stage.step(stage.init_state(), 1)


def test_a_script_without_a_main_guard_can_start_one(tmp_path) -> None:
    # multiprocessing's "spawn" re-runs the parent's main script in the child: such a script would start
    # processes without end. The child here is `python -m duplex.runtime.stage_child` instead.
    done = _run_script(
        tmp_path,
        "from duplex.runtime.stage_process import StageProcess\n"
        "from duplex.testing.fakes import counter_stage\n"
        "stage = StageProcess(counter_stage, (5,)).wait_ready(60)\n"
        "print('total', stage.step(stage.init_state(), 2)[0])\n"
        "stage.close()\n",
    )
    assert done.stdout.strip() == "total 7"


def test_the_child_exits_when_its_parent_is_killed(tmp_path) -> None:
    # a server killed with SIGKILL runs no cleanup: the child must not stay behind holding its memory
    script = tmp_path / "parent.py"
    script.write_text(
        "import time\n"
        "from duplex.runtime.stage_process import StageProcess\n"
        "from duplex.testing.fakes import counter_stage\n"
        "stage = StageProcess(counter_stage, (0,)).wait_ready(60)\n"
        "print(stage.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            # reaped by init once it exits; until then it may linger as a zombie: check its state
            try:
                with open(f"/proc/{child}/stat") as f:
                    if f.read().split(")")[-1].split()[0] == "Z":
                        break
            except FileNotFoundError:
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the child outlived its killed parent by 10 s")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_the_child_logs_as_the_parent_does(tmp_path) -> None:
    done = _run_script(
        tmp_path,
        "import logging\n"
        "from duplex.runtime.logs import setup_logging\n"
        "from duplex.runtime.stage_process import StageProcess\n"
        "from duplex.testing.fakes import counter_stage\n"
        "setup_logging(logging.INFO, 'json')\n"
        "stage = StageProcess(counter_stage, (0,)).wait_ready(60)\n"
        "stage.close()\n",
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line, the child's too, is a JSON object
    assert any(r["logger"] == "duplex.runtime.openmp" for r in records)  # logged in the child


def test_the_server_process_does_not_import_torch_for_its_command_line() -> None:
    # with the engine in its own process, a CPU profile's server (ONNX VAD, ASR and voice) needs no
    # torch: 200 MB it would otherwise hold twice
    code = (
        "import sys\n"
        "import duplex.cli, duplex.runtime.service, duplex.transports.gateway\n"
        "duplex.cli.build_parser()\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_the_service_gives_an_engine_in_its_own_process_a_lane_of_its_own(remote: StageProcess) -> None:
    from duplex.base.config import load_profile
    from duplex.runtime.service import DuplexService, ServiceLimits
    from duplex.testing.fakes import fake_stages, scripted_answer

    def lanes(stages, limits=None) -> set[str]:
        service = DuplexService(load_profile("cpu"), stages, limits=limits)
        try:
            if stages.llm is remote:  # the llm stage's job runs on its lane
                job = Job(
                    stage="llm",
                    label="llm",
                    session_id="s",
                    turn_id=1,
                    state=remote.init_state(),
                    chunk=2,
                    deadline=0.0,
                )
                assert service.executor.submit(job).result(30)[0] == remote.step(remote.init_state(), 2)[0]
            return set(service.executor.queue_depth())
        finally:  # not service.close(): it would close the module's child process
            service.executor.close()
            service.heap.close()
            service.gc_pauses.remove()

    assert lanes(fake_stages(scripted_answer)) == {"realtime", "bulk"}  # an engine in this process: no lane
    in_child = dataclasses.replace(fake_stages(scripted_answer), llm=remote)
    assert lanes(in_child, ServiceLimits(engine_lane=True)) == {"realtime", "bulk", "remote"}
    assert lanes(in_child) == {"realtime", "bulk"}  # limits.engine_lane off (default): one bulk lane for all
