"""Log lines of `duplex serve` (duplex/runtime/logs.py): tagged with their session, in text or JSON."""

from __future__ import annotations

import asyncio
import json
import logging

from duplex.runtime.logs import JsonFormatter, SessionFilter, TextFormatter, bind_session


class _Core:
    session_id = "s-42"
    turn_id = 3


def _format(formatter: logging.Formatter, in_session: bool) -> str:
    core = _Core()  # the tag keeps only a weak reference to the core
    record = logging.LogRecord("duplex.test", logging.INFO, __file__, 1, "listen %d ms", (40,), None)

    async def log() -> str:
        if in_session:
            bind_session(core)
        SessionFilter().filter(record)
        return formatter.format(record)

    return asyncio.run(log())


def test_text_lines_name_their_session_and_lines_outside_one_carry_no_tag() -> None:
    assert _format(TextFormatter(), True).endswith(" INFO duplex.test [s-42]: listen 40 ms")
    outside = _format(TextFormatter(), False)
    assert outside.endswith(" INFO duplex.test: listen 40 ms") and "None" not in outside


def test_json_lines_carry_session_and_turn() -> None:
    row = json.loads(_format(JsonFormatter(), True))
    assert (row["session_id"], row["turn_id"], row["message"]) == ("s-42", 3, "listen 40 ms")
    assert json.loads(_format(JsonFormatter(), False))["session_id"] is None
