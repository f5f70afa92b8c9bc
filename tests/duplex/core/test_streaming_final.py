"""A streaming recogniser's partial transcribes only the chunks it has encoded (the rest of the audio
waits for a full chunk or the final's flush). Such a partial that returns after the user paused must not
serve as the turn's final transcript: it would drop the last word ("what is the opposite of?"), and the
turn head would then wait for the rest of a question that was complete.

Replayed on a fake clock with tone speech; the tone streaming ASR's partials see whole 480 ms chunks only,
as the streamed Moonshine encoder's do.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from duplex.base.config import load_profile
from duplex.base.messages import AsrChunk
from duplex.core.session import SR, SessionCore
from duplex.testing.fakes import ToneStreamingAsr, fake_turn_stages, scripted_answer, tone_speech
from duplex.testing.replay import FakeClock, replay
from tests.duplex.core.test_decoder_eou import COSTS

QUESTION = "what is the capital of france"


def run(lead_s: float, partial_cost: float):
    profile = load_profile("cpu")
    clock = FakeClock()
    stages = fake_turn_stages(scripted_answer, asr=ToneStreamingAsr(chunk_ms=480))
    options = dataclasses.replace(profile.session, partial_interval_ms=160)
    core = SessionCore("s1", profile, stages, clock, options=options)
    costs = {**COSTS, "asr.partial": partial_cost}
    silence = np.zeros(int(SR * lead_s), np.float32)
    audio = np.concatenate([silence, tone_speech(QUESTION), np.zeros(3 * SR, np.float32)])
    return replay(core, clock, audio, costs, tail_seconds=3.0)


@pytest.mark.parametrize("lead_s", [0.3, 0.4, 0.45, 0.55])
@pytest.mark.parametrize("partial_cost", [0.02, 0.15])
def test_a_lagging_partial_is_not_the_final_transcript(lead_s, partial_cost):
    result = run(lead_s, partial_cost)
    assert [e.text for e in result.events("transcript.final")] == [QUESTION]
    decision = result.events("turn.decision")[-1]
    assert decision.decision == "speak" and decision.text == QUESTION
    assert [d.text for d in result.events("response.done")] == ["paris is the capital of france"]


def test_the_partials_report_what_they_heard():
    asr = ToneStreamingAsr(chunk_ms=480)
    out, state = asr.step(asr.init_state(), AsrChunk(np.zeros(int(SR * 1.2), np.float32), transcribe=True))
    assert out.heard_seconds == pytest.approx(0.96)  # two whole chunks of 1.2 s
    out, _ = asr.step(state, AsrChunk(np.zeros(0, np.float32), transcribe=True, final=True))
    assert out.heard_seconds == pytest.approx(1.2)
