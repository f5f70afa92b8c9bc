"""The microphone side of live mode: device blocks from PortAudio's thread into the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import numpy as np

from clients.talk.stream_clock import StreamClock, stream_time
from clients.talk.wire import FRAME_S


class Capture:
    """The microphone side (PortAudio's thread): mono blocks into an asyncio queue, timestamped.
    If the event loop falls more than `max_backlog_s` behind, blocks are dropped rather than
    queued without bound."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rate: int, max_backlog_s: float = 2.0) -> None:
        self.loop = loop
        self.rate = rate
        self.latency = 0.0  # the stream's input latency (s), once it is open
        self.clock = StreamClock(rate)
        self.queue: asyncio.Queue[np.ndarray | None] = asyncio.Queue()
        self._backlog = 0  # blocks handed to the loop and not yet taken
        self._max_backlog = max(1, int(max_backlog_s / FRAME_S))
        self._lock = threading.Lock()

    def callback(self, indata: np.ndarray, frames: int, time_info: Any, status: Any) -> None:
        now = time.monotonic()
        block = np.asarray(indata, np.float32)
        mono = block.mean(axis=1, dtype=np.float32) if block.ndim == 2 else block.copy()
        times = stream_time(time_info, "inputBufferAdcTime")
        first = now - (times[0] - times[1]) if times else now - self.latency - frames / self.rate
        self.clock.mark(first, frames)
        with self._lock:
            if self._backlog >= self._max_backlog:
                return
            self._backlog += 1
        with contextlib.suppress(RuntimeError):  # the loop is closing
            self.loop.call_soon_threadsafe(self.queue.put_nowait, mono)

    async def get(self) -> np.ndarray | None:
        """The next block, or None once `close` was called."""
        block = await self.queue.get()
        if block is not None:
            with self._lock:
                self._backlog -= 1
        return block

    def close(self) -> None:
        self.queue.put_nowait(None)
