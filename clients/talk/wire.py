"""The native protocol (docs/protocol.md) as this client speaks it: where it connects by default,
the audio it sends, and how it reads a server event. No I/O here."""

from __future__ import annotations

import json
from typing import Any

from duplex.base.audio import SAMPLE_RATE

DEFAULT_SERVER = "ws://127.0.0.1:8765/v1/duplex"
SEND_RATE = SAMPLE_RATE  # the client sends what the stages take: no resampling on the server
FRAME_S = 0.02  # microphone frame / device block


def parse_event(msg: str | bytes) -> dict[str, Any] | None:
    """A server event, or None for audio and for anything that is not a JSON object."""
    if isinstance(msg, bytes):
        return None
    try:
        ev = json.loads(msg)
    except ValueError:
        return None
    return ev if isinstance(ev, dict) else None
