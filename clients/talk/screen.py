"""The terminal: the live transcript, and the words of an interrupted answer that were never heard."""

from __future__ import annotations

import sys
from typing import TextIO


class Screen:
    """The live transcript. On a terminal the user's partial transcript is redrawn in place with
    `\\r`; the bot's answer streams on its own line; notes (latency) wait until that line ends."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._line: str | None = None  # "you" (a partial on screen) or "bot" (an answer streaming)
        self._bot_printed = False  # some of the current answer is on screen
        self._deferred: list[str] = []

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _end_line(self) -> None:
        if self._line == "you":
            self._write("\r\x1b[K")
        elif self._line == "bot":
            self._write("\n")
        self._line = None
        for note in self._deferred:
            self._write(note + "\n")
        self._deferred.clear()

    def user_partial(self, text: str) -> None:
        if not self.tty or not text:
            return
        if self._line == "bot":
            self._end_line()
        self._write(f"\r\x1b[K you: {text} ...")
        self._line = "you"

    def user_final(self, text: str) -> None:
        self._end_line()
        if text:
            self._write(f" you: {text}\n")

    def bot_delta(self, delta: str) -> None:
        if self._line != "bot":
            self._end_line()
            self._write(" bot:" + ("" if delta.startswith(" ") else " "))
            self._line = "bot"
        self._write(delta)
        self._bot_printed = True

    def bot_done(self, status: str, text: str, heard: str | None) -> None:
        """The answer ended; an interrupted one shows the words that were never heard struck out."""
        if not self._bot_printed and text:
            self.bot_delta(text)
        self._bot_printed = False
        lost = unheard(text, heard) if status == "interrupted" else ""
        if self._line == "bot":
            self._write("\n")
            self._line = None
        if status == "interrupted":
            self.note(
                f"      (interrupted; not heard: {self.strike(lost)})" if lost else "      (interrupted)"
            )
        elif status not in ("completed", ""):
            self.note(f"      (answer {status})")
        self._end_line()

    def cut(self, text: str, heard: str) -> None:
        """A finished answer was cut while it was still playing."""
        lost = unheard(text, heard)
        self.note(
            f"      (interrupted while playing; not heard: {self.strike(lost)})"
            if lost
            else "      (interrupted)"
        )

    def strike(self, text: str) -> str:
        return f"\x1b[9m{text}\x1b[0m" if self.tty else f"~~{text}~~"

    def note(self, text: str) -> None:
        """A line of its own; while an answer streams it waits for the end of that answer."""
        if self._line == "bot":
            self._deferred.append(text)
            return
        self._end_line()
        self._write(text + "\n")


def unheard(text: str, heard: str | None) -> str:
    """The words of `text` after the `heard` ones (the server says which words were played)."""
    words, got = text.split(), (heard or "").split()
    return " ".join(words[len(got) :]) if words[: len(got)] == got else (text if not got else "")
