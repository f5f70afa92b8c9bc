"""End to end with the real packaged models: speech synthesised at test time, over the WebSocket.

Uses the `live` fixture (tests/conftest.py): the embedded `cpu` profile loaded once per run (Silero VAD, Moonshine, Qwen2.5-0.5B, hibari).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import numpy as np
import pytest
from websockets.asyncio.client import connect

from codec.resample import resample
from duplex.core.session import SR

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def asr_model():
    from asr.moonshine import MoonshineModel

    return MoonshineModel()


@pytest.fixture(scope="module")
def say():
    from tests.speech import synthesize

    return lambda text: synthesize(text, sample_rate=SR)


def silence(s: float) -> np.ndarray:
    return np.zeros(int(SR * s), dtype=np.float32)


async def stream(ws, audio: np.ndarray) -> None:
    """Real-time 20 ms frames, like a microphone."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    frame = SR // 50
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
    for k, i in enumerate(range(0, len(pcm), frame)):
        await ws.send(pcm[i : i + frame].tobytes())
        delay = t0 + (k + 1) * 0.02 - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)


class Listener:
    """Collects events and audio with arrival times; runs as a task beside the sender."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.events: list[tuple[float, dict]] = []
        self.audio: list[tuple[float, np.ndarray]] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        async for msg in self.ws:
            now = loop.time()
            if isinstance(msg, bytes):
                self.audio.append((now, np.frombuffer(msg, dtype="<i2").astype(np.float32) / 32767))
            else:
                self.events.append((now, json.loads(msg)))

    async def wait_for(self, type_: str, count: int = 1, limit_s: float = 60.0, **match) -> dict:
        async with asyncio.timeout(limit_s):
            while True:
                hits = [
                    e
                    for _, e in self.events
                    if e["type"] == type_ and all(e.get(k) == v for k, v in match.items())
                ]
                if len(hits) >= count:
                    return hits[count - 1]
                await asyncio.sleep(0.02)

    def time_of(self, type_: str, count: int = 1) -> float:
        return [t for t, e in self.events if e["type"] == type_][count - 1]

    def audio_between(self, t0: float, t1: float) -> np.ndarray:
        parts = [a for t, a in self.audio if t0 <= t < t1]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


@contextlib.asynccontextmanager
async def session(live):
    """A native-protocol session at 16 kHz with a Listener running beside it."""
    async with connect(f"ws://127.0.0.1:{live.port}/v1/duplex") as ws:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": SR}))
        listener = Listener(ws)
        await listener.wait_for("session.started")
        try:
            yield ws, listener
        finally:
            listener.task.cancel()


async def test_spoken_question_gets_a_spoken_answer_that_mentions_paris(live, say, asr_model):
    async with session(live) as (ws, listener):
        await stream(ws, np.concatenate([silence(0.5), say("What is the capital of France?"), silence(1.0)]))
        final = await listener.wait_for("transcript.final")
        assert "capital" in final["text"].lower() and "france" in final["text"].lower()
        done = await listener.wait_for("response.done", limit_s=60)
        assert done["status"] == "completed"
        await stream(ws, silence(2.0))  # keep the microphone open while the answer plays out
        t_start = listener.time_of("response.audio.started")
        answer = listener.audio_between(t_start - 1.0, float("inf"))
        assert len(answer) > 24000 * 0.5, "less than half a second of answer audio"
        heard = asr_model.transcribe(resample(answer, 24000, SR))
        assert "paris" in heard.lower(), (heard, done["text"])
        latency = await listener.wait_for("turn.latency")
        assert {
            "end_of_turn",
            "final_transcript",
            "first_llm_token",
            "first_tts_chunk",
            "first_audio",
        } <= set(latency["stages"])


async def test_talking_over_an_answer_stops_it_and_the_new_question_is_answered(live, say):
    async with session(live) as (ws, listener):
        await stream(
            ws,
            np.concatenate(
                [silence(0.3), say("Tell me a long story about a dragon and a knight."), silence(0.8)]
            ),
        )
        await listener.wait_for("response.audio.started", limit_s=60)
        await stream(ws, silence(1.5))  # let it talk for a while
        # a comma, not a full stop: hibari pauses 0.7 s after "Stop." (longer than the 500 ms
        # hangover), and telling a pause from an end of turn by meaning is the dialogue engine's job
        interruption = say("Stop, what is two plus two?")
        lead_s = int(np.argmax(np.abs(interruption) > 0.02)) / SR  # the synthesiser's leading silence
        loop = asyncio.get_running_loop()
        t_speak = loop.time() + lead_s  # when the first speech sample is sent
        await stream(ws, np.concatenate([interruption, silence(1.2)]))
        interrupted = await listener.wait_for("response.interrupted", limit_s=30)
        t_int = listener.time_of("response.interrupted")
        story_audio_times = [t for t, _ in listener.audio if t < t_int]
        # the last frame of the story arrived within 300 ms of the user starting to speak (the
        # target is 200 ms; here client and server share one process and its GIL)
        assert story_audio_times[-1] - t_speak < 0.3
        # nothing of the story arrives after the interruption
        first_done = await listener.wait_for("response.done")
        assert first_done["status"] == "interrupted"
        assert interrupted["played_text"] and first_done["text"].startswith(interrupted["played_text"][:10])
        final = await listener.wait_for("transcript.final", count=2)
        assert "two" in final["text"].lower() or "2" in final["text"]
        second = await listener.wait_for("response.done", count=2, limit_s=60)
        assert second["status"] == "completed" and second["text"]


async def test_context_is_kept_across_turns(live, say):
    async with session(live) as (ws, listener):
        await stream(ws, np.concatenate([silence(0.3), say("Hello, my name is Anna."), silence(1.0)]))
        await listener.wait_for("response.done", limit_s=60)
        await stream(ws, silence(3.0))
        await stream(ws, np.concatenate([say("What is my name?"), silence(1.0)]))
        second = await listener.wait_for("response.done", count=2, limit_s=60)
        assert "anna" in second["text"].lower(), second["text"]


def test_the_dialogue_engine_runs_in_a_process_of_its_own(live) -> None:
    # limits.llm_process (default): the engine's steps do not wait for the event loop's GIL
    from duplex.runtime.stage_process import StageProcess

    llm = live.service.stages.llm
    assert isinstance(llm, StageProcess) and llm.alive() and llm.pid != os.getpid()
    assert live.service.stages.policy is not None  # its turn policy came across
    stats = live.service.stats()["process"]
    assert stats["model_process_rss_mb"] > 100  # the two LLMs' weights live there
    assert stats["rss_mb"] > stats["model_process_rss_mb"]
    # limits.engine_lane off (default): its steps share the bulk worker with ASR and TTS
    assert "remote" not in live.service.executor.queue_depth()
