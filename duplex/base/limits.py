"""What one client may use of a server: limits from `models.yaml`'s `limits:` section, and the rate
rules that enforce them, with an injected clock (sans-I/O: no sockets, no event loop).

Every limit has a documented answer (docs/operations.md): an `error` event with the code below,
and, where the session ends, a WebSocket close code.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from duplex.base.config import ConfigError
from duplex.base.paths import REPO_ROOT

# error codes of the limits, as they appear in `error` events and HTTP refusals
SESSION_EXPIRED = "session_expired"
IDLE_TIMEOUT = "idle_timeout"
RATE_LIMITED = "rate_limited"
TEXT_TOO_LONG = "text_too_long"
AUDIO_TOO_FAST = "audio_too_fast"
STAGE_FAILED = "stage_failed"
SERVER_SHUTDOWN = "server_shutdown"

# WebSocket close codes (RFC 6455)
CLOSE_NORMAL = 1000  # the server ended the session by its rules: duration, idle
CLOSE_GOING_AWAY = 1001  # the server is shutting down (drain)
CLOSE_POLICY = 1008  # the client broke a rule: message flood, audio far faster than real time, not reading
CLOSE_INTERNAL = 1011  # the session's stages failed repeatedly
CLOSE_OVERLOAD = 1013  # at capacity, try again later


#: limits where 0 means "off" rather than "nothing allowed"
_MAY_BE_ZERO = frozenset({"llm_gather_ms", "heap_trim_s"})


@dataclass(frozen=True)
class ServerLimits:
    """Per-server and per-session limits; `models.yaml` `limits:` and `duplex serve` flags override."""

    max_sessions: int = 8  # sessions at once, all transports together (HTTP 503 / close 1013)
    #: `max_sessions: auto`: the service replaces max_sessions with this device's measured capacity
    #: (duplex.runtime.capacity)
    max_sessions_auto: bool = False
    max_connections_per_client: int = 4  # WebSocket/TCP connections at once per client address (HTTP 429)
    max_session_s: float = 3600.0  # a session is ended after this long (session_expired, 1000)
    idle_timeout_s: float = 300.0  # ... or after this long without a client message (idle_timeout, 1000)
    control_per_s: float = 20.0  # control (non-audio) messages per second, sustained
    control_burst: int = 40  # ... and in a burst; over it: rate_limited (message dropped), 2x over: 1008
    max_text_chars: int = 4000  # a typed user turn (text_too_long, message refused)
    audio_speed: float = 1.0  # audio accepted per second of wall time (1.0: real time)
    audio_burst_s: float = 10.0  # audio a client may be ahead of real time before it is throttled
    audio_close_s: float = (
        60.0  # ... and ahead by this much (one huge append) it is closed (audio_too_fast, 1008)
    )
    stage_timeout_s: float = 30.0  # a stage job running longer is abandoned: the turn fails (stage_failed)
    max_stage_failures: int = 3  # stage failures in one session before it is closed (1011)
    client_secret_ttl_s: float = 60.0  # default lifetime of a client secret
    drain_timeout_s: float = 30.0  # on SIGTERM, answers in progress may finish for this long
    # the executor waits up to this long to batch an LLM job with other sessions' (0: never waits)
    llm_gather_ms: float = 3.0
    # glibc keeps freed heap pages: give them back to the OS this often (seconds; 0: never)
    heap_trim_s: float = 10.0
    # executor worker threads for the bulk stages (ASR, LLM, TTS); with one, a caller's transcription waits
    # behind another's LLM step; 2 with the cpu-multi profile serve several callers better (docs/operations.md)
    bulk_workers: int = 1
    # the dialogue engine (both LLMs, the turn heads, the verifier) runs in a process of its own, so its steps
    # do not wait for the GIL the event loop holds (duplex/runtime/stage_process.py); false: in this process
    llm_process: bool = True
    # an engine in its own process gets an executor lane (and workers) of its own: while it computes there, ASR
    # and TTS jobs run here instead of waiting behind its step (duplex/runtime/executor.py). Off: on 2 cores the
    # overlap slowed the engine's steps more than it saved (docs/operations.md, "The engine's lane")
    engine_lane: bool = False

    def with_overrides(self, overrides: dict[str, Any]) -> ServerLimits:
        """These limits with some replaced; unknown names or non-positive values raise ConfigError."""
        names = {f.name: f for f in dataclasses.fields(self)}
        clean: dict[str, Any] = {}
        for key, value in overrides.items():
            if value is None:
                continue
            if key not in names or key == "max_sessions_auto":
                raise ConfigError(f"unknown limit {key!r}; known: {', '.join(names)}")
            if key == "max_sessions" and value == "auto":
                clean["max_sessions_auto"] = True
                continue
            if names[key].type in ("bool", bool):
                if not isinstance(value, bool):
                    raise ConfigError(f"limit {key} must be true or false, got {value!r}")
                clean[key] = value
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"limit {key} must be a positive number, got {value!r}")
            if value < 0 or (value == 0 and key not in _MAY_BE_ZERO):
                what = "a number >= 0" if key in _MAY_BE_ZERO else "a positive number"
                raise ConfigError(f"limit {key} must be {what}, got {value!r}")
            clean[key] = int(value) if names[key].type == "int" else float(value)
            if key == "max_sessions":
                clean["max_sessions_auto"] = False
        return dataclasses.replace(self, **clean)


def load_limits(path: str | os.PathLike[str] | None = None) -> ServerLimits:
    """The `limits:` section of models.yaml (default: the repository's, or $DUPLEX_MODELS_YAML)."""
    yaml_path = Path(path or os.environ.get("DUPLEX_MODELS_YAML") or REPO_ROOT / "models.yaml")
    try:
        doc = yaml.safe_load(yaml_path.read_text())
    except FileNotFoundError:
        return ServerLimits()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{yaml_path} is not valid YAML: {exc}") from None
    raw = doc.get("limits") if isinstance(doc, dict) else None
    if raw is None:
        return ServerLimits()
    if not isinstance(raw, dict):
        raise ConfigError(f"{yaml_path}: 'limits' must be a mapping")
    return ServerLimits().with_overrides(raw)


class TokenBucket:
    """`rate` tokens per second up to `burst`; `take()` is False when the bucket is empty."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._t = clock()

    def take(self, n: float = 1.0) -> bool:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
        self._t = now
        if self._tokens >= n:
            self._tokens -= n
            return True
        return False


class ControlLimiter:
    """Control messages per second: `check()` says accept, drop (rate_limited) or close (a flood)."""

    ACCEPT, DROP, CLOSE = "accept", "drop", "close"

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self._bucket = TokenBucket(rate, burst, clock)
        self._dropped = 0  # dropped since the last accepted message
        self._close_after = max(1, burst)

    def check(self) -> str:
        if self._bucket.take():
            self._dropped = 0
            return self.ACCEPT
        self._dropped += 1
        return self.CLOSE if self._dropped > self._close_after else self.DROP


class AudioPacer:
    """How far a client's audio runs ahead of real time, and how long to wait before reading more.

    A client may send up to `burst_s` seconds ahead of `speed` x real time; beyond that the
    reader waits (`delay`) so the socket's back-pressure slows the client down to real time.
    A single message that puts it more than `close_s` ahead is refused (`too_fast`).
    """

    def __init__(self, *, speed: float, burst_s: float, close_s: float, clock: Callable[[], float]) -> None:
        self.speed = speed
        self.burst_s = burst_s
        self.close_s = close_s
        self._clock = clock
        self._start: float | None = None
        self.received_s = 0.0
        self.throttled = 0  # times the reader had to wait

    def ahead(self) -> float:
        """Seconds of audio received beyond what real time allows so far."""
        if self._start is None:
            return 0.0
        return self.received_s - (self._clock() - self._start) * self.speed

    def add(self, seconds: float) -> float:
        """Account for `seconds` of audio just received; returns how long to wait before reading on."""
        if self._start is None:
            self._start = self._clock()
        self.received_s += max(0.0, seconds)
        over = self.ahead() - self.burst_s
        if over <= 0:
            return 0.0
        self.throttled += 1
        return over / self.speed

    def too_fast(self) -> bool:
        return self.ahead() > self.close_s


class ClientCounts:
    """Connections open per client address, bounded by `limit` each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}

    def acquire(self, client: str) -> bool:
        """Count a new connection from `client`; False (not counted) if it already has `limit`."""
        n = self._open.get(client, 0)
        if n >= self.limit:
            return False
        self._open[client] = n + 1
        return True

    def count(self, client: str) -> int:
        return self._open.get(client, 0)

    def release(self, client: str) -> None:
        n = self._open.get(client, 0) - 1
        if n > 0:
            self._open[client] = n
        else:
            self._open.pop(client, None)

    def __len__(self) -> int:
        return len(self._open)
