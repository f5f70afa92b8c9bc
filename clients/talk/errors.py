"""The one error `duplex talk` shows the user instead of a traceback."""

from __future__ import annotations


class TalkError(Exception):
    """Something the user must fix or know; the message is printed as is, without a traceback."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code
