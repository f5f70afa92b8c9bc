"""Logging set-up for `duplex serve`: text or JSON lines, each record tagged with its session and turn.

The session a log line belongs to is a context variable set when a session opens
(`bind_session`); asyncio tasks and the runner's callbacks inherit it, so a line logged anywhere
on a session's behalf carries `session_id` and the core's current `turn_id`.

The variable holds the session's id and only a weak reference to its core: every asyncio handle keeps
the context it was scheduled in, and a cancelled timer stays in the event loop's heap until its time
comes, so a strong reference let the timers of callers who hung up keep their whole session (dialogue
state, KV caches) alive while other calls went on: ~6 MB per hung-up caller (docs/operations.md).
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
import weakref
from typing import Any


class _SessionTag:
    """What a context knows of its session: the id, and the core while it lives (for the turn id)."""

    __slots__ = ("session_id", "_core")

    def __init__(self, core: Any) -> None:
        self.session_id = getattr(core, "session_id", None)
        try:
            self._core: Any = weakref.ref(core)
        except TypeError:  # an object without weak references: keep the id only
            self._core = lambda: None

    @property
    def turn_id(self) -> Any:
        return getattr(self._core(), "turn_id", None)


_SESSION: contextvars.ContextVar[_SessionTag | None] = contextvars.ContextVar("duplex_session", default=None)


def bind_session(core: Any) -> None:
    """Tag what this task (and the tasks and callbacks it starts) logs with `core`'s ids; the context
    keeps only a weak reference to `core`."""
    _SESSION.set(_SessionTag(core))


class SessionFilter(logging.Filter):
    """Adds `session_id` and `turn_id` (None outside a session) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        tag = _SESSION.get()
        if not hasattr(record, "session_id"):
            record.session_id = tag.session_id if tag is not None else None
        if not hasattr(record, "turn_id"):
            record.turn_id = tag.turn_id if tag is not None else None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, session_id, turn_id (and exc)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "session_id": getattr(record, "session_id", None),
            "turn_id": getattr(record, "turn_id", None),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """`time LEVEL logger [session]: message`; lines outside a session carry no tag (not `[None]`)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(session_tag)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        sid = getattr(record, "session_id", None)
        record.session_tag = "" if sid is None else f" [{sid}]"
        return super().format(record)


def setup_logging(level: int, fmt: str = "text") -> None:
    """Configure the root logger: `fmt` is "text" (human) or "json" (one object per line)."""
    handler = logging.StreamHandler()
    handler.addFilter(SessionFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
