"""The session core replays whole conversations on a fake clock with tiny deterministic stages."""

from __future__ import annotations

import time

import numpy as np
import pytest

from duplex.base.config import load_profile
from duplex.core.session import SR, SessionCore
from duplex.testing.fakes import decode_tones, fake_stages, tone_speech
from duplex.testing.replay import FakeClock, replay

COSTS = {"vad": 0.002, "asr.partial": 0.05, "asr.final": 0.08, "llm.first": 0.2, "llm.step": 0.1, "tts": 0.02}


def answer(history: list[dict[str, str]]) -> str:
    last = history[-1]["content"]
    if "capital" in last and "france" in last:
        return "paris is the capital of france"
    if "two plus two" in last:
        return "two plus two is four"
    if "story" in last:
        return "once upon a time there was a cat and it was very very good " * 3
    return "i am fine thanks"


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(SR * seconds), dtype=np.float32)


def make_core(**overrides):
    profile = load_profile("cpu")
    clock = FakeClock()
    stages = fake_stages(answer)
    core = SessionCore("s1", profile, stages, clock, options=profile.session.with_overrides(overrides))
    return core, clock, stages


def test_question_gets_spoken_answer_and_events_in_order():
    core, clock, _ = make_core()
    audio = np.concatenate([silence(0.5), tone_speech("what is the capital of france"), silence(3.0)])
    result = replay(core, clock, audio, COSTS)
    types = [e.type for e in result.events()]
    for expected in [
        "speech.started",
        "speech.stopped",
        "transcript.final",
        "response.started",
        "response.audio.started",
        "turn.latency",
        "response.done",
    ]:
        assert expected in types, (expected, types)
    assert types.index("speech.started") < types.index("speech.stopped") < types.index("response.started")
    final = result.events("transcript.final")[0]
    assert final.text == "what is the capital of france"
    done = result.events("response.done")[0]
    assert done.status == "completed" and done.text == "paris is the capital of france"
    # what the bot *said*, decoded from the audio frames it sent
    assert decode_tones(result.audio(), 24000) == "paris is the capital of france".split()
    # every event of the turn carries the session id and the same turn id
    turn = result.events("speech.started")[0].turn_id
    assert all(e.session_id == "s1" for e in result.events())
    assert {e.turn_id for e in result.events() if e.type != "transcript.partial"} == {turn}
    assert core.history == [
        {"role": "user", "content": "what is the capital of france"},
        {"role": "assistant", "content": "paris is the capital of france"},
    ]


def test_a_tts_that_owes_chunks_is_stepped_until_it_has_said_everything():
    """An incremental TTS (first chunk at once, the rest owed) speaks the whole answer, heard word for word,
    and a barge-in still cuts it with only the heard words kept."""
    from dataclasses import replace

    from duplex.testing.fakes import OwingToneTts

    profile = load_profile("cpu")
    clock = FakeClock()
    tts = OwingToneTts()
    stages = replace(fake_stages(answer), tts=tts)
    core = SessionCore("s1", profile, stages, clock)
    audio = np.concatenate([silence(0.5), tone_speech("what is the capital of france"), silence(3.0)])
    result = replay(core, clock, audio, COSTS)
    done = result.events("response.done")[0]
    assert done.status == "completed" and done.text == "paris is the capital of france"
    assert decode_tones(result.audio(), 24000) == "paris is the capital of france".split()
    assert tts.calls >= 6  # one word per call: the core came back for what was owed

    # what is owed is due when the queued audio runs out: a later deadline than a first chunk's
    clock = FakeClock()
    core = SessionCore("s3", profile, replace(fake_stages(answer), tts=OwingToneTts()), clock)
    budgets: list[float] = []
    take = core.take_jobs

    def taken() -> list:
        got = take()
        budgets.extend(round(j.deadline - clock.t, 3) for j in got if j.stage == "tts")
        return got

    core.take_jobs = taken  # type: ignore[method-assign]
    replay(core, clock, audio, COSTS)
    first = profile.component("tts").budget("chunk")
    assert budgets[0] == pytest.approx(first)  # the answer's first chunk: the plain budget
    assert max(budgets) > first + 0.1  # owed chunks wait behind the audio already queued

    clock = FakeClock()
    core = SessionCore("s2", profile, replace(fake_stages(answer), tts=OwingToneTts()), clock)
    question = tone_speech("tell me a story")
    t_barge = 0.3 + len(question) / SR + 2.5
    pre = np.concatenate([silence(0.3), question])
    audio = np.concatenate(
        [pre, silence(t_barge - len(pre) / SR), tone_speech("stop what is two plus two"), silence(4.0)]
    )
    result = replay(core, clock, audio, COSTS)
    interrupted = result.events("response.interrupted")[0]
    heard = interrupted.played_text
    assert (
        heard
        and decode_tones(result.audio(0, interrupted.t + 0.001), 24000)[: len(heard.split())] == heard.split()
    )
    assert result.events("response.done")[-1].text == "two plus two is four"


def test_an_answer_with_audio_queued_steps_its_llm_by_the_playout_not_the_budget():
    """EDF across sessions: a continuation step is due when the answer's queued audio runs out (less the
    voice's budget), so a long answer's steps yield to other callers' first steps and to answers about
    to run dry; the first step keeps its budget."""
    core, clock, _ = make_core()
    deadlines: dict[str, list[float]] = {"llm.first": [], "llm.step": []}
    take = core.take_jobs

    def taken() -> list:
        got = take()
        for j in got:
            if j.label in deadlines:
                deadlines[j.label].append(round(j.deadline - clock.t, 3))
        return got

    core.take_jobs = taken  # type: ignore[method-assign]
    audio = np.concatenate([silence(0.3), tone_speech("tell me a story"), silence(8.0)])
    result = replay(core, clock, audio, COSTS)
    assert result.events("response.done")[0].status == "completed"
    profile = load_profile("cpu")
    first, step = profile.component("llm").budget("first"), profile.component("llm").budget("step")
    assert deadlines["llm.first"] == [pytest.approx(first)]
    assert len(deadlines["llm.step"]) >= 3 and min(deadlines["llm.step"]) >= step - 1e-9
    assert max(deadlines["llm.step"]) > step + 0.2  # later steps wait behind the audio already queued


def test_answer_starts_right_after_the_hangover_thanks_to_speculation():
    core, clock, _ = make_core(end_of_turn_silence_ms=500)
    speech = tone_speech("what is the capital of france")
    audio = np.concatenate([silence(0.5), speech, silence(3.0)])
    result = replay(core, clock, audio, COSTS)
    latency = result.events("turn.latency")[0].stages
    # the LLM ran during the hangover: its first token came before the end of turn was decided
    assert latency["first_llm_token"] < latency["end_of_turn"]
    # first audio leaves within ~50 ms of the end-of-turn decision (TTS + one frame)
    assert latency["first_audio"] - latency["end_of_turn"] < 60
    first_audio_t = result.audio_frames()[0].t
    speech_end = 0.5 + len(speech) / SR - 0.05  # the last gap is silence
    assert 0.5 <= first_audio_t - speech_end <= 0.75


def test_mid_sentence_pause_shorter_than_hangover_does_not_take_the_turn():
    core, clock, stages = make_core(end_of_turn_silence_ms=600)
    audio = np.concatenate(
        [
            silence(0.3),
            tone_speech("what is the"),
            silence(0.4),
            tone_speech("capital of france"),
            silence(3.0),
        ]
    )
    result = replay(core, clock, audio, COSTS)
    finals = [e.text for e in result.events("transcript.final")]
    assert finals == ["what is the capital of france"]
    assert len(result.events("response.started")) == 1
    # no audio was sent before the user finished the whole question
    second_part_end = (
        0.3 + len(tone_speech("what is the")) / SR + 0.4 + len(tone_speech("capital of france")) / SR
    )
    assert result.audio_frames()[0].t > second_part_end
    # the speculation on the partial question was made and thrown away
    assert any(m[-1]["content"] == "what is the" for m in stages.llm.seen)


def test_barge_in_stops_audio_fast_and_keeps_only_heard_words():
    core, clock, _ = make_core()
    question = tone_speech("tell me a story")
    t_barge = 0.3 + len(question) / SR + 2.5  # well into the long answer
    pre = np.concatenate([silence(0.3), question])
    audio = np.concatenate(
        [pre, silence(t_barge - len(pre) / SR), tone_speech("stop what is two plus two"), silence(4.0)]
    )
    result = replay(core, clock, audio, COSTS)
    interrupted = result.events("response.interrupted")
    assert len(interrupted) == 1
    # audio of the story stops within 200 ms of the user starting to talk
    story_frames = [f for f in result.audio_frames() if f.t < interrupted[0].t + 0.001]
    assert story_frames[-1].t - t_barge < 0.2
    done = [e for e in result.events("response.done")]
    assert done[0].status == "interrupted"
    heard = interrupted[0].played_text
    full = done[0].text
    assert heard and full.startswith(heard) and len(heard) < len(full)
    # the context keeps only what was heard, then the new question and its answer
    assert core.history[1] == {"role": "assistant", "content": heard}
    assert core.history[2]["content"] == "stop what is two plus two"
    assert core.history[3]["content"] == "two plus two is four"
    assert done[1].status == "completed"
    # the words heard match the audio actually sent before the interruption (lead included)
    sent_words = decode_tones(result.audio(0, interrupted[0].t + 0.001), 24000)
    assert sent_words[: len(heard.split())] == heard.split()


def test_multi_turn_context_is_kept_and_passed_to_the_llm():
    core, clock, stages = make_core()
    audio = np.concatenate(
        [
            silence(0.3),
            tone_speech("hello how are you"),
            silence(3.0),
            tone_speech("what is the capital of france"),
            silence(3.0),
        ]
    )
    result = replay(core, clock, audio, COSTS)
    assert [e.status for e in result.events("response.done")] == ["completed", "completed"]
    last_prompt = stages.llm.seen[-1]
    assert [m["role"] for m in last_prompt] == ["user", "assistant", "user"]
    assert last_prompt[1]["content"] == "i am fine thanks"
    turn_ids = [e.turn_id for e in result.events("response.done")]
    assert turn_ids[1] == turn_ids[0] + 1


def test_cancel_and_noise_and_input_end():
    core, clock, _ = make_core()
    q = np.concatenate([silence(0.3), tone_speech("tell me a story")])
    # cancel one second after the answer starts; then a 60 ms click that must be ignored
    click = (0.3 * np.sin(np.arange(int(SR * 0.06)) * 0.3)).astype(np.float32)
    audio = np.concatenate([q, silence(2.0), click, silence(2.0)])
    result = replay(core, clock, audio, COSTS, controls=[(len(q) / SR + 1.6, {"type": "response.cancel"})])
    done = result.events("response.done")
    assert done[0].status == "cancelled"
    assert len(result.events("speech.started")) == 1  # the click is shorter than min_speech
    # input.end closes an open turn without waiting for silence
    core, clock, _ = make_core()
    speech = tone_speech("what is the capital of france")
    result = replay(core, clock, speech, COSTS, controls=[(len(speech) / SR + 0.01, {"type": "input.end"})])
    assert result.events("transcript.final")[0].text == "what is the capital of france"
    assert result.events("response.done")[0].status == "completed"


def test_stage_failure_is_reported_and_the_session_goes_on():
    calls = {"n": 0}

    def flaky(history):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return answer(history)

    core, clock, _ = make_core()
    audio = np.concatenate(
        [
            silence(0.3),
            tone_speech("hello how are you"),
            silence(2.0),
            tone_speech("what is the capital of france"),
            silence(3.0),
        ]
    )
    core.stages.llm.reply_fn = flaky
    result = replay(core, clock, audio, COSTS)
    errors = result.events("error")
    assert errors and errors[0].code == "stage_failed"
    assert result.events("response.done")[-1].text == "paris is the capital of france"


def test_replay_is_deterministic_and_faster_than_real_time():
    audio = np.concatenate([silence(0.3), tone_speech("tell me a story"), silence(8.0)])
    runs = []
    for _ in range(2):
        core, clock, _ = make_core()
        t0 = time.perf_counter()
        result = replay(core, clock, audio, COSTS)
        wall = time.perf_counter() - t0
        runs.append(
            [
                (round(o.t, 6), o.item if isinstance(o.item, bytes) else o.item.to_wire())
                for o in result.outputs
            ]
        )
    assert runs[0] == runs[1]
    assert wall < (len(audio) / SR + 3.0) / 3


@pytest.mark.parametrize("bad", [{"end_of_turn_silence_ms": -1}, {"vad_threshold": 2}, {"nope": 1}])
def test_bad_session_update_is_an_error_event(bad):
    core, clock, _ = make_core()
    core.receive_control({"type": "session.update", "options": bad})
    events = [e for e in core.take_outputs() if not isinstance(e, bytes)]
    assert events[0].type == "error" and events[0].code == "bad_option"


def test_final_transcription_does_not_wait_behind_a_slow_partial():
    core, clock, _ = make_core(partial_interval_ms=300)
    costs = dict(COSTS, **{"asr.partial": 0.45, "asr.final": 0.25, "llm.first": 0.18})
    audio = np.concatenate([silence(0.3), tone_speech("what is the capital of france"), silence(3.0)])
    result = replay(core, clock, audio, costs)
    latency = result.events("turn.latency")[0].stages
    # the final ran in its own slot the moment the user paused, while a partial was still running
    assert latency["final_transcript"] < 300
    assert latency["first_llm_token"] < latency["end_of_turn"]
    assert result.events("transcript.final")[0].text == "what is the capital of france"
    assert result.events("transcript.partial"), "partials were produced while speaking"


def test_speculation_continues_until_a_first_phrase_is_ready():
    core, clock, stages = make_core()
    stages.llm.reply_fn = lambda history: "two plus two is four"
    core.first_step_tokens = 2  # the first step alone is not a speakable phrase
    audio = np.concatenate([silence(0.3), tone_speech("what is two plus two"), silence(3.0)])
    result = replay(core, clock, audio, COSTS)
    t_commit = next(
        o.t for o in result.outputs if not isinstance(o.item, bytes) and o.item.type == "response.started"
    )
    held = "".join(
        o.item.delta
        for o in result.outputs
        if not isinstance(o.item, bytes) and o.item.type == "response.text.delta" and o.t == t_commit
    )
    # the LLM kept going during the hangover until it had a speakable phrase (3 complete words)
    assert held.split()[:3] == ["two", "plus", "two"]
    assert decode_tones(result.audio(), 24000) == "two plus two is four".split()


def test_an_endless_turn_is_cut_at_max_segment_length():
    core, clock, _ = make_core()
    core.options = core.options.__class__(**{**core.options.__dict__, "max_segment_ms": 3000})
    words = " ".join(["hello how are you"] * 8)  # ~7 s of speech without a pause
    result = replay(core, clock, np.concatenate([silence(0.3), tone_speech(words), silence(2.0)]), COSTS)
    stopped = result.events("speech.stopped")
    assert stopped and stopped[0].t < 0.3 + 3.5  # ended at the cap, not at the end of the speech
    assert result.events("transcript.final")[0].text.startswith("hello how are you")


def test_typed_turn_is_answered_and_joins_the_spoken_context():
    core, clock, stages = make_core()
    result = replay(
        core,
        clock,
        silence(0.5),
        COSTS,
        controls=[(0.1, {"type": "input.text", "text": "what is the capital of france"})],
    )
    assert result.events("transcript.final")[0].text == "what is the capital of france"
    done = result.events("response.done")[0]
    assert done.status == "completed" and done.text == "paris is the capital of france"
    assert decode_tones(result.audio(), 24000) == "paris is the capital of france".split()
    assert core.history[-2:] == [
        {"role": "user", "content": "what is the capital of france"},
        {"role": "assistant", "content": "paris is the capital of france"},
    ]
    for bad in ({"type": "input.text"}, {"type": "input.text", "text": "  "}):
        core.receive_control(bad)
    assert [e.code for e in core.take_outputs() if e.type == "error"] == ["bad_event", "bad_event"]


def test_truncate_after_playback_keeps_only_the_words_the_client_played():
    """A client that stops playback itself (OpenAI Realtime's conversation.item.truncate) tells the
    server how much it played; the history keeps those words, whether audio is still being sent or not."""
    core, clock, _ = make_core()
    q = np.concatenate([silence(0.3), tone_speech("what is the capital of france")])
    # after the answer has played out completely: 0.9 s of "paris is the capital of france" was heard
    result = replay(core, clock, np.concatenate([q, silence(4.0)]), COSTS)
    spoken = result.events("response.done")[0].text
    core.receive_control({"type": "response.truncate", "played_ms": 900})
    kept = core.history[-1]["content"]
    assert spoken.startswith(kept) and 0 < len(kept.split()) < len(spoken.split())
    # words per second of the tone voice: a word is 0.25 s + 0.05 s gap at most
    assert len(kept.split()) <= 900 / 250
    core.receive_control({"type": "response.truncate", "played_ms": 0})
    assert core.history[-1]["role"] == "user"  # nothing heard: the answer leaves the context
    # while it is still being sent: the audio stops and the same truncation applies
    core, clock, _ = make_core()
    q = np.concatenate([silence(0.3), tone_speech("tell me a story")])
    result = replay(
        core,
        clock,
        np.concatenate([q, silence(4.0)]),
        COSTS,
        controls=[(len(q) / SR + 2.0, {"type": "response.truncate", "played_ms": 600})],
    )
    interrupted = result.events("response.interrupted")[0]
    assert interrupted.played_ms <= 600 and interrupted.played_text
    assert result.events("response.done")[0].status == "interrupted"
    assert not [f for f in result.audio_frames() if f.t > interrupted.t + 0.001]
    assert core.history[-1] == {"role": "assistant", "content": interrupted.played_text}


def test_playout_reports_bound_what_counts_as_heard_at_barge_in():
    """A gateway whose audio plays later than the server's clock assumes (network, jitter buffer)
    reports its playout; at barge-in the context keeps no word the caller cannot have heard yet."""

    def heard_at_barge_in(report_ms):
        core, clock, _ = make_core()
        q = np.concatenate([silence(0.3), tone_speech("tell me a story")])
        t_barge = len(q) / SR + 3.0
        audio = np.concatenate([q, silence(t_barge - len(q) / SR), tone_speech("stop"), silence(2.0)])
        controls = (
            []
            if report_ms is None
            else [(t_barge - 0.05, {"type": "playout.position", "played_ms": report_ms})]
        )
        return replay(core, clock, audio, COSTS, controls=controls).events("response.interrupted")[0]

    free, bounded = heard_at_barge_in(None), heard_at_barge_in(500)
    assert bounded.played_ms < free.played_ms
    assert bounded.played_ms <= 500 + 50 + 250  # the report, plus the time since, plus VAD lag
    assert free.played_text.startswith(bounded.played_text) and len(bounded.played_text) < len(
        free.played_text
    )


def test_input_clear_drops_the_unfinished_turn():
    core, clock, _ = make_core()
    speech = tone_speech("what is the capital of france")
    audio = np.concatenate([silence(0.3), speech, silence(3.0)])
    # cleared during the end-of-turn hangover, while the answer is being prepared speculatively
    result = replay(
        core, clock, audio, COSTS, controls=[(0.3 + len(speech) / SR + 0.3, {"type": "input.clear"})]
    )
    assert len(result.events("speech.started")) == 1
    assert not result.events("response.started")
    assert not result.events("transcript.final")
    assert core.history == []


def test_a_restartable_asr_gets_the_partials_transcript_as_the_finals_draft():
    """The final re-reads the whole segment from a fresh state, but a stage that can restart a state (Moonshine's
    draft-verified decoding) keeps the last partial's transcript for it."""
    from dataclasses import dataclass, replace

    from duplex.base.messages import AsrChunk, AsrResult
    from duplex.base.stage import RestartableStage
    from duplex.testing.fakes import ToneAsr, ToneAsrState

    @dataclass
    class DraftState(ToneAsrState):
        draft: str = ""

    class DraftAsr(ToneAsr):
        def __init__(self) -> None:
            self.final_drafts: list[tuple[str, int]] = []

        def init_state(self) -> DraftState:
            return DraftState()

        def restart_state(self, state: DraftState) -> DraftState:
            return DraftState(draft=state.draft)

        def step(self, state: ToneAsrState, chunk: AsrChunk) -> tuple[AsrResult | None, DraftState]:
            assert isinstance(state, DraftState)
            out, new = super().step(state, chunk)
            if chunk.final:
                self.final_drafts.append((state.draft, state.audio.size))
            return out, DraftState(new.audio, draft=out.text if out is not None else state.draft)

    profile = load_profile("cpu")
    clock = FakeClock()
    asr = DraftAsr()
    assert isinstance(asr, RestartableStage)
    stages = replace(fake_stages(answer), asr=asr)
    core = SessionCore(
        "s1", profile, stages, clock, options=profile.session.with_overrides({"partial_interval_ms": 300})
    )
    audio = np.concatenate([silence(0.3), tone_speech("what is the capital of france"), silence(3.0)])
    result = replay(core, clock, audio, COSTS)
    partials = [e.text for e in result.events("transcript.partial")]
    assert len(partials) >= 2 and asr.final_drafts
    draft, samples = asr.final_drafts[0]
    assert samples == 0  # a fresh state: the final reads the whole segment itself
    assert draft in partials and "what is the capital of france".startswith(draft)
    assert result.events("transcript.final")[0].text == "what is the capital of france"
