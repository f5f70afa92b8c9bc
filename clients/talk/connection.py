"""The WebSocket side: open a session on the native protocol, with what to do when that fails, and
say why a connection closed."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from clients.talk.errors import TalkError
from clients.talk.wire import DEFAULT_SERVER, SEND_RATE, parse_event

SERVE_HINT = "start one with `duplex serve` (or point --server at a running one)"


def api_key_from_env() -> str | None:
    """The first key of $DUPLEX_API_KEY (comma-separated, as `duplex serve` reads it), if set."""
    keys = [k.strip() for k in os.environ.get("DUPLEX_API_KEY", "").split(",") if k.strip()]
    return keys[0] if keys else None


async def open_session(
    url: str,
    options: dict[str, Any],
    sample_rate: int = SEND_RATE,
    wait_s: float = 10.0,
    api_key: str | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Connect and start a session; returns (websocket, the session.started event). Raises
    TalkError with what to do when the server is unreachable, refuses, or rejects the options.

    `api_key` (default: $DUPLEX_API_KEY) is sent as `Authorization: Bearer` for servers with keys."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

    key = api_key if api_key is not None else api_key_from_env()
    headers = {"Authorization": f"Bearer {key}"} if key else None
    try:
        ws = await connect(
            url,
            max_size=2**20,
            compression=None,
            open_timeout=wait_s,
            close_timeout=2,
            additional_headers=headers,
        )
    except InvalidURI:
        raise TalkError(f"{url!r} is not a WebSocket URL; expected e.g. {DEFAULT_SERVER}") from None
    except InvalidStatus as exc:
        status = exc.response.status_code
        why = {
            503: " (the server is at capacity or shutting down; try again later)",
            401: " (it needs an API key: set $DUPLEX_API_KEY)" if not key else " (the API key was refused)",
            429: " (too many connections from this address)",
        }.get(status, "")
        raise TalkError(f"the server at {url} refused the connection: HTTP {status}{why}") from None
    except (OSError, TimeoutError) as exc:
        raise TalkError(
            f"cannot reach the server at {url} ({exc or type(exc).__name__}); {SERVE_HINT}"
        ) from None
    except InvalidHandshake as exc:
        raise TalkError(f"{url} did not accept a WebSocket connection: {exc}") from None
    try:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": sample_rate, "options": options}))
        async with asyncio.timeout(wait_s):
            while True:
                ev = parse_event(await ws.recv())
                if ev is None:
                    continue
                if ev.get("type") == "session.started":
                    return ws, ev
                if ev.get("type") == "error":
                    raise TalkError(
                        f"the server refused session.start: {ev.get('code')}: {ev.get('message')}"
                    )
    except TimeoutError:
        await ws.close()
        raise TalkError(
            f"no session.started from {url} within {wait_s:.0f} s; is it a duplex server?"
        ) from None
    except ConnectionClosed as exc:
        raise TalkError(f"the server at {url} closed the connection at once: {exc}") from None
    except BaseException:
        await ws.close()
        raise


def closed_why(ws: Any) -> str:
    """The close code and reason of a closed connection, for the user."""
    code, reason = getattr(ws, "close_code", None), getattr(ws, "close_reason", "")
    if code is None:
        return "the connection dropped"
    return f"code {code}" + (f": {reason}" if reason else "")
