"""A stage in a process of its own: the dialogue engine away from the event loop's GIL.

In one process, the event loop (WebSocket frames, PCM decoding, the session cores, ~35 % of a core per
caller) and the executor's worker running the dialogue engine share one GIL. The engine's decoder
releases the GIL around every torch op and has to take it back after each; py-spy on a live server
found the worker waiting for it ~30 % of its listen and draft time, and the engine's steps ran about
twice as long as the same calls in a script (listen at a pause ~60 vs ~30 ms, the first draft ~90 vs
~40 ms; docs/results/2026-11-27.md). In a process of its own the stage has its own interpreter.

`StageProcess(factory, args, kwargs)` starts a child (`python -m duplex.runtime.stage_child`: a fresh
interpreter, nothing of the parent's threads or OpenMP pools inherited) that builds the stage with `factory(*args, **kwargs)` and serves
its steps over Unix-socket connections, one connection and one child thread per calling thread, so two
executor workers step it at once as they would in one process. The object itself is the stage the
executor and the session cores use:

- the per-session states stay in the child. `init_state()` returns a `RemoteState` handle; every step's
  new state comes back as a new handle (a stage that updates its state in place gives two handles to one
  object there, as in one process); a handle the parent drops is freed in the child with the next request;
- the attributes the parent reads (`kind`, `policy`, `listens`) are copied once, when the child is ready;
- an exception the stage raises is raised here (a `RuntimeError` with its text when it cannot be pickled),
  so the executor re-runs a failed batch job by job as for any stage;
- a child that dies (killed, out of memory, a crash in native code) fails the steps in flight with
  `StageProcessDied`; the next step starts a new child (at most `max_restarts` times). The states of
  the dead child are gone: a step on one of them fails with `StateLost`, and the session core reports it
  as a failed stage job for that session only;
- the child exits when the parent closes it or goes away (a lifeline pipe it reads).
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger("duplex.runtime.stage_process")

#: how often the child gives freed heap pages back to the OS (the server's `heap_trim_s` default)
HEAP_TRIM_S = 10.0

#: attributes of the stage the parent reads
DEFAULT_ATTRIBUTES = ("kind", "policy", "listens")


class StageProcessError(RuntimeError):
    """The stage could not be started in its process (it failed to load, or the child exited)."""


class StageProcessDied(RuntimeError):
    """The stage's process exited while a step was in flight (or could not be restarted)."""


class StateLost(RuntimeError):
    """A state handle whose state lived in a process that has since died."""


class RemoteState:
    """A session's state of a stage that lives in another process: an id there."""

    __slots__ = ("id", "generation", "fresh", "__weakref__")

    def __init__(self, state_id: int, generation: int, fresh: bool) -> None:
        self.id = state_id
        self.generation = generation
        self.fresh = fresh  # from init_state(): the child makes the state on first use

    def __repr__(self) -> str:
        return f"RemoteState(id={self.id}, generation={self.generation}{', fresh' if self.fresh else ''})"


class StageProcess:
    """A streaming stage served by a child process (see the module's docstring)."""

    def __init__(
        self,
        factory: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        name: str = "stage",
        attributes: Sequence[str] = DEFAULT_ATTRIBUTES,
        max_restarts: int = 3,
        start: bool = True,
    ) -> None:
        self.name = name
        self._factory = factory
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self._attributes = tuple(attributes)
        self.max_restarts = max_restarts
        self.restarts = 0
        self.generation = 0
        self._info: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._ids = itertools.count(1)
        self._freed: collections.deque[int] = collections.deque()
        self._process: Any = None
        self._address = ""
        self._authkey = b""
        self._dir: str | None = None
        self._ready = False
        self._closed = False
        self._broken = 0  # a generation whose connection broke: the next step starts a new child
        self._conns: list[Any] = []  # every connection made, so close() can close them all
        if start:
            self.start()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the child; it builds the stage while the caller goes on (`wait_ready` waits for it)."""
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        self.generation += 1
        self._ready = False
        self._dir = tempfile.mkdtemp(prefix=f"duplex-{self.name}-")
        self._address = os.path.join(self._dir, "sock")
        self._authkey = os.urandom(16)
        self._process = _Child.start(
            (
                self._factory,
                self._args,
                self._kwargs,
                self._attributes,
                self._address,
                self._authkey,
                logging.getLogger().getEffectiveLevel(),
                _log_format(),
            )
        )
        log.info("%s: process %d starting (generation %d)", self.name, self._process.pid, self.generation)

    def wait_ready(self, timeout_s: float | None = None) -> StageProcess:
        """Block until the child has built the stage; raise `StageProcessError` if it could not."""
        with self._lock:
            self._wait_ready_locked(timeout_s)
        return self

    def _wait_ready_locked(self, timeout_s: float | None) -> None:
        if self._ready:
            return
        if self._process is None:
            raise StageProcessError(f"{self.name}: the process was not started")
        t0 = time.perf_counter()
        message = self._process.read_message(timeout_s)
        if message is None:
            raise StageProcessError(f"{self.name}: the process did not load the stage within {timeout_s} s")
        if message == "exited":
            self._process.join(5.0)
            raise StageProcessError(
                f"{self.name}: the process exited while loading the stage (exit code {self._process.exitcode})"
            )
        kind, payload = message
        if kind != "ready":
            self._process.join(5.0)
            raise StageProcessError(f"{self.name}: the stage failed to load in its process:\n{payload}")
        self._info = dict(payload)
        self._ready = True
        log.info(
            "%s: process %d ready in %.1f s (waited)", self.name, self._process.pid, time.perf_counter() - t0
        )

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        """End the child (it exits when its lifeline closes; terminated if it does not) and clean up."""
        with self._lock:
            self._closed = True
            self._stop_locked(timeout_s)

    def _stop_locked(self, timeout_s: float) -> None:
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass
        self._conns = []
        if self._process is not None:
            self._process.close_lifeline()
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout_s)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -- the stage contract ------------------------------------------------------------------

    def __getattr__(self, attr: str) -> Any:
        # only called for attributes not found normally: the stage's, copied when the child was ready
        info = self.__dict__.get("_info")
        if info is not None and attr in info:
            return info[attr]
        raise AttributeError(attr)

    def init_state(self) -> RemoteState:
        return self._handle(fresh=True)

    def step(self, state: RemoteState, chunk: Any) -> tuple[Any, RemoteState]:
        return self.step_batch([(state, chunk)])[0]

    def step_batch(self, items: Sequence[tuple[RemoteState, Any]]) -> list[tuple[Any, RemoteState]]:
        conn, generation = self._connection()
        for state, _ in items:
            if not isinstance(state, RemoteState):
                raise TypeError(f"{self.name}: not a state of this stage: {type(state).__name__}")
            if state.generation != generation and not state.fresh:
                raise StateLost(
                    f"{self.name}: this session's state was lost when the stage's process restarted"
                )
        outs = [self._handle(fresh=False, generation=generation) for _ in items]
        request = [(s.id, s.fresh, o.id, chunk) for (s, chunk), o in zip(items, outs, strict=True)]
        kind, payload = self._exchange(conn, generation, "step", request)
        if kind == "raise":
            raise payload
        return [(out, handle) for out, handle in zip(payload, outs, strict=True)]

    def info(self) -> dict[str, Any]:
        """The child's count of live states (after freeing the dropped ones) and its pid."""
        conn, generation = self._connection()
        _, payload = self._exchange(conn, generation, "info", None)
        return dict(payload)

    def _exchange(self, conn: Any, generation: int, kind: str, request: Any) -> tuple[str, Any]:
        """Send one request (with the ids of the states dropped since the last) and take its reply; a
        broken connection marks this child for replacement and raises `StageProcessDied`."""
        try:
            conn.send((kind, request, self._drain_freed()))
            return conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError) as exc:
            self._forget_connection()
            self._broken = generation
            if self._process is not None:
                self._process.join(1.0)  # it is exiting: its exit code says why
            code = self._process.exitcode if self._process is not None else None
            raise StageProcessDied(
                f"{self.name}: its process (pid {self.pid}) exited during a {kind} request (exit code {code})"
            ) from exc

    def disconnect(self) -> None:
        """Close the calling thread's connection (its thread in the child ends and frees its OpenMP pool):
        for a thread that stepped the stage once (a warm-up) and will not again."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass
        self._forget_connection()

    # -- internals -----------------------------------------------------------------------------

    def _handle(self, *, fresh: bool, generation: int | None = None) -> RemoteState:
        handle = RemoteState(next(self._ids), self.generation if generation is None else generation, fresh)
        finalizer = weakref.finalize(handle, self._freed.append, handle.id)
        finalizer.atexit = False
        return handle

    def _drain_freed(self) -> list[int]:
        out: list[int] = []
        while True:
            try:
                out.append(self._freed.popleft())
            except IndexError:
                return out

    def _forget_connection(self) -> None:
        self._local.conn = None
        self._local.generation = 0

    def _connection(self) -> tuple[Any, int]:
        conn = getattr(self._local, "conn", None)
        if (
            conn is not None
            and self._local.generation == self.generation
            and self._broken != self.generation
            and not self._closed
            and self.alive()
        ):
            return conn, self.generation
        with self._lock:
            if self._closed:
                raise StageProcessDied(f"{self.name}: the stage's process was closed")
            if not self.alive() or self._broken == self.generation:
                self._restart_locked()
            self._wait_ready_locked(None)
            try:
                conn = mpc.Client(self._address, family="AF_UNIX", authkey=self._authkey)
            except (OSError, EOFError) as exc:
                self._broken = self.generation
                raise StageProcessDied(
                    f"{self.name}: cannot reach its process (pid {self.pid}): {exc!r}"
                ) from exc
            self._conns.append(conn)
            self._local.conn = conn
            self._local.generation = self.generation
            return conn, self.generation

    def _restart_locked(self) -> None:
        code = self._process.exitcode if self._process is not None else None
        if self.restarts >= self.max_restarts:
            raise StageProcessDied(
                f"{self.name}: its process exited (exit code {code}) and was restarted "
                f"{self.restarts} times already; not again"
            )
        self.restarts += 1
        log.error(
            "%s: its process exited (exit code %s); starting a new one (restart %d)",
            self.name,
            code,
            self.restarts,
        )
        self._stop_locked(1.0)
        self._freed.clear()  # ids of the dead child's states
        self._start_locked()


def _log_format() -> str:
    """ "json" when this process logs JSON lines (`duplex serve --log-format json`), else "text"."""
    from duplex.runtime.logs import JsonFormatter

    handlers = logging.getLogger().handlers
    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in handlers) else "text"


def by_name(target: str, *args: Any, **kwargs: Any) -> Any:
    """Call `module:function` with the arguments: a factory the parent can name without importing its
    module (the dialogue engine's brings torch and transformers, which the parent then never loads)."""
    import importlib

    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)(*args, **kwargs)


# -- the child -------------------------------------------------------------------------------------


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class _Served:
    """The child's side: the stage and every session's state, by id."""

    def __init__(self, stage: Any) -> None:
        self.stage = stage
        self.states: dict[int, Any] = {}

    def step(self, request: list[tuple[int, bool, int, Any]]) -> tuple[str, Any]:
        try:
            items = []
            for in_id, fresh, _, chunk in request:
                state = self.states.get(in_id)
                if state is None:
                    if not fresh:
                        raise StateLost(f"no state {in_id} in this process")
                    state = self.states[in_id] = self.stage.init_state()
                items.append((state, chunk))
            results = self.stage.step_batch(items)
            for (_, _, out_id, _), (_, new_state) in zip(request, results, strict=True):
                self.states[out_id] = new_state
            return "ok", [out for out, _ in results]
        except Exception as exc:
            log.debug("step failed: %r", exc)
            return "raise", _picklable(exc)

    def serve(self, conn: Any) -> None:
        from duplex.runtime.openmp import release_idle_pools

        try:
            while True:
                try:
                    kind, request, freed = conn.recv()
                except (EOFError, OSError):
                    return
                for state_id in freed:
                    self.states.pop(state_id, None)
                if kind == "info":
                    reply: tuple[str, Any] = ("ok", {"states": len(self.states), "pid": os.getpid()})
                elif kind == "step":
                    reply = self.step(request)
                else:
                    reply = ("raise", ValueError(f"unknown request {kind!r}"))
                try:
                    conn.send(reply)
                except OSError:
                    return
                except Exception as exc:  # an output that cannot be pickled
                    conn.send(("raise", RuntimeError(f"the stage's output could not be sent: {exc!r}")))
        finally:
            release_idle_pools()  # this thread's OpenMP pool must not outlive it as spinning threads
            conn.close()


class _Child:
    """The child process: `python -m duplex.runtime.stage_child`, its stdin the spec then the lifeline, its
    original stdout the one message saying it is ready (or why not). Not multiprocessing's "spawn": that
    re-runs the parent's main script in the child, which a script without a `__main__` guard cannot take."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    @classmethod
    def start(cls, spec: tuple[Any, ...]) -> _Child:
        env = dict(os.environ)
        # the child imports what this process can (a checkout, a test's package) by the same paths
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        popen = subprocess.Popen(
            [sys.executable, "-m", "duplex.runtime.stage_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        assert popen.stdin is not None
        popen.stdin.write(pickle.dumps(spec))
        popen.stdin.flush()  # kept open: the child exits when it closes
        return cls(popen)

    def read_message(self, timeout_s: float | None) -> Any:
        """The child's message, "exited" if it ended without one, None on timeout."""
        assert self.popen.stdout is not None
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout_s)
        if not ready:
            return None
        try:
            return pickle.load(self.popen.stdout)
        except (EOFError, pickle.UnpicklingError, OSError):
            return "exited"

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout_s: float | None) -> None:
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass

    def close_lifeline(self) -> None:
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()


def run_child() -> None:
    """The child's main (`python -m duplex.runtime.stage_child`)."""
    report = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the stage prints goes to stderr; fd 1 of old carries the one message
    factory, args, kwargs, attributes, address, authkey, log_level, log_format = pickle.load(sys.stdin.buffer)
    from duplex.runtime.logs import setup_logging

    setup_logging(log_level, log_format)  # as the parent logs (`duplex serve --log-format json`)
    from duplex.base.devices import count_as_own

    count_as_own(os.getppid())  # the server's jobs are the service's own, not other work (`threads: auto`)
    try:
        from duplex.runtime.openmp import loading_without_pools

        with loading_without_pools():
            stage = factory(*args, **kwargs)
        info = {name: getattr(stage, name) for name in attributes if hasattr(stage, name)}
        pickle.dumps(info)
        listener = mpc.Listener(address, family="AF_UNIX", authkey=authkey)
    except BaseException:
        pickle.dump(("error", traceback.format_exc()), report)
        report.close()
        return
    served = _Served(stage)
    # as the server's own process does: loading leaves freed heap pages and objects the collector need not walk
    from duplex.runtime.heap import HeapTrimmer, freeze_loaded

    freeze_loaded()
    trimmer = HeapTrimmer(HEAP_TRIM_S)
    _, released = trimmer.trim_once()
    log.info("loaded; heap trim released %.0f MB", released)
    trimmer.start()

    def accept() -> None:
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError, multiprocessing.AuthenticationError) as exc:
                log.warning("a connection was refused: %r", exc)
                time.sleep(0.01)
                continue
            threading.Thread(target=served.serve, args=(conn,), name="stage-serve", daemon=True).start()

    threading.Thread(target=accept, name="stage-accept", daemon=True).start()
    pickle.dump(("ready", info), report)
    report.flush()
    try:
        sys.stdin.buffer.read()  # nothing more is sent: this returns (EOF) when the parent closes it or exits
    except OSError:
        pass
    os._exit(0)
