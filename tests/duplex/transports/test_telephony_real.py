"""Phone calls on the real packaged models: the Twilio and Asterisk simulators hold a call.

A spoken question (hibari, synthesised at test time, sent as 8 kHz telephone audio with jitter)
gets a spoken answer in the call's codec whose Moonshine transcript answers it; talking over a long
answer stops it (Twilio: `clear`) and the new question is answered. Uses the `live` fixture.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from codec.resample import resample
from duplex.core.session import SR
from duplex.testing.audiosocket_sim import AudioSocketPeer
from duplex.testing.twilio_sim import TwilioPeer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def asr_model():
    from asr.moonshine import MoonshineModel

    return MoonshineModel()


@pytest.fixture(scope="module")
def say():
    from tests.speech import synthesize

    def speak(text: str) -> np.ndarray:
        audio = synthesize(text, sample_rate=SR)
        loud = np.flatnonzero(np.abs(audio) > 0.01)
        return audio[loud[0] : loud[-1] + 1]  # trimmed: `said.end` is then the end of speech

    return speak


def heard_text(asr_model, audio8k: np.ndarray) -> str:
    """Moonshine's transcript of what the caller heard, without the silence around it."""
    loud = np.flatnonzero(np.abs(audio8k) > 0.01)
    if loud.size == 0:
        return ""
    speech = audio8k[max(0, loud[0] - 800) : loud[-1] + 800]
    return asr_model.transcribe(resample(speech, 8000, SR)).lower()


async def test_twilio_call_question_answer_and_barge_in(live, say, asr_model):
    url = f"ws://127.0.0.1:{live.port}/v1/twilio"
    async with TwilioPeer(url, jitter_s=0.01, bunch_probability=0.05, seed=1) as call:
        await asyncio.sleep(0.5)
        said = await call.say(say("What is the capital of France?"))
        # a loaded machine may leave a pause between the relay's first words and the rest: wait it out
        answer = await call.wait_for_answer(after=said.end, quiet_s=1.5, limit_s=60)
        onset = call.first_played_after(said.end) - said.end
        assert 0.3 < onset < 5.0
        assert len(answer) > 0.5 * 8000
        assert "paris" in heard_text(asr_model, answer)
        assert {n for _, n in call.media} == {160}  # mu-law bytes: 20 ms per message

        said = await call.say(say("Tell me a long story about a dragon and a knight."))
        loop = asyncio.get_running_loop()
        await call.wait_for(lambda: call.loud_seconds(said.end, loop.time()) >= 1.5, limit_s=60)
        barge = call.say_nowait(say("Stop, what is two plus two?"))
        t_clear = await call.wait_for_clear(limit_s=5)
        # the story's audio is held as soon as Silero hears ~100 ms of speech (the caller's buffer of
        # ~120 ms plays out), and `clear` follows once the words are judged an interruption
        assert call.loud_seconds(barge.start + 0.6, t_clear) < 0.05
        assert t_clear - barge.start < 2.0
        # nothing of the story plays after the clear; the new question is answered
        await barge.sent.wait()
        second = await call.wait_for_answer(after=barge.end, limit_s=60)
        assert len(second) > 0.3 * 8000  # the new question got a spoken answer
        # the context: the story kept only what the caller heard, then the new question
        core = list(live.service.sessions.values())[
            -1
        ]  # the call (a previous test's session may still be closing)
        users = [m["content"].lower() for m in core.history if m["role"] == "user"]
        assert "two" in users[-1] or "2" in users[-1], core.history
        story = core.history[3]["content"] if len(core.history) > 3 else ""
        assert story and core.history[3]["role"] == "assistant" and len(story.split()) < 60
    await asyncio.sleep(0.5)
    assert live.service.sessions == {}  # the hang-up freed the session


async def test_audiosocket_call_question_answer_and_hangup(live, say, asr_model):
    async with AudioSocketPeer(
        "127.0.0.1", live.audiosocket_port, jitter_ms=10, bunching=0.05, seed=2
    ) as call:
        await asyncio.sleep(0.5)
        said = await call.say(say("What is the capital of France?"))
        # a loaded machine may leave a pause between the relay's first words and the rest: wait it out
        answer = await call.wait_for_answer(after=said.end, quiet_s=1.5, limit_s=60)
        onset = call.first_played_after(said.end) - said.end
        assert 0.3 < onset < 5.0
        core = list(live.service.sessions.values())[
            -1
        ]  # the call (a previous test's session may still be closing)
        heard = heard_text(asr_model, answer)
        assert "paris" in heard, (heard, float(np.abs(answer).max()), len(answer) / 8000, core.history)
        said = await call.say(say("Tell me a long story about a dragon."))
        await call.wait_audio(after=said.end, limit_s=60)
        await call.hangup()  # mid-answer
    for _ in range(20):
        if not live.service.sessions:
            break
        await asyncio.sleep(0.1)
    assert live.service.sessions == {}
