"""Twilio Media Streams gateway, end to end over a real socket against the Twilio peer simulator.

The tiny tone stages (duplex.testing.fakes) stand in for the models: words are tones, so what the caller
*heard* (the peer's played audio, after mu-law and 8 kHz) can be decoded back into words.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from websockets.exceptions import InvalidStatus

import duplex.transports.twilio as tw
from codec.g711 import (
    alaw_to_pcm16,
    float_to_ulaw,
    pcm16_to_alaw,
    pcm16_to_ulaw,
    ulaw_to_float,
    ulaw_to_pcm16,
)
from codec.resample import resample
from duplex.base.config import load_profile
from duplex.core.events import (
    DtmfReceived,
    Interrupted,
    ResponseAudioStarted,
    ResponseDone,
    ServerEvent,
    SessionStarted,
    TranscriptFinal,
)
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.fakes import VOCAB, decode_tones, fake_stages, scripted_answer, tone_speech
from duplex.testing.twilio_sim import TwilioPeer
from duplex.transports.native import DuplexServer, ServerSettings
from duplex.transports.twilio import TwilioCall, TwilioSettings, mount_twilio
from duplex.transports.twilio_protocol import FRAME_BYTES, TWILIO_PATH

STORY = scripted_answer([{"role": "user", "content": "tell me a story"}]).split()
PARIS = "paris is the capital of france".split()


@dataclass
class Gateway:
    server: DuplexServer
    service: DuplexService
    url: str
    events: list[ServerEvent] = field(default_factory=list)
    calls: list[TwilioCall] = field(default_factory=list)  # from on_start

    def of(self, cls: type[Any]) -> list[Any]:
        return [e for e in self.events if isinstance(e, cls)]

    async def wait_sessions(self, n: int, limit_s: float = 3.0) -> None:
        async with asyncio.timeout(limit_s):
            while True:
                if len(self.service.sessions) == n:
                    return
                await asyncio.sleep(0.01)


@pytest.fixture
async def gateway():
    """A factory: `await gateway(**TwilioSettings fields)` -> a served Gateway with the tone stages."""
    made: list[Gateway] = []

    async def make(max_sessions: int = 4, **settings: Any) -> Gateway:
        service = DuplexService(
            load_profile("cpu"), fake_stages(scripted_answer), limits=ServiceLimits(max_sessions=max_sessions)
        )
        server = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
        gw = Gateway(server, service, "")
        mount_twilio(server, TwilioSettings(on_event=gw.events.append, on_start=gw.calls.append, **settings))
        await server.start()
        gw.url = f"ws://127.0.0.1:{server.port}{TWILIO_PATH}"
        made.append(gw)
        return gw

    yield make
    for gw in made:
        await gw.server.close()
        gw.service.close()


def now() -> float:
    return asyncio.get_running_loop().time()


# -- codec and building blocks ----------------------------------------------------------------


def test_g711_matches_audioop():
    """codec.g711 is bit-exact with CPython's audioop (Sun's reference g711.c) both ways, both laws."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop
    pcm = np.arange(-32768, 32768, dtype=np.int16)
    raw = pcm.astype("<i2").tobytes()
    assert pcm16_to_ulaw(pcm) == audioop.lin2ulaw(raw, 2)
    assert pcm16_to_alaw(pcm) == audioop.lin2alaw(raw, 2)
    codes = bytes(range(256))
    assert ulaw_to_pcm16(codes).astype("<i2").tobytes() == audioop.ulaw2lin(codes, 2)
    assert alaw_to_pcm16(codes).astype("<i2").tobytes() == audioop.alaw2lin(codes, 2)


def test_tone_vocabulary_survives_8k_mulaw():
    """Every tone word (300-1660 Hz) decodes after 16 kHz -> 8 kHz -> mu-law -> back: a phone line."""
    speech = tone_speech(" ".join(VOCAB))
    wire = float_to_ulaw(resample(speech, 16000, 8000))
    assert decode_tones(ulaw_to_float(wire), 8000) == list(VOCAB)


# -- calls ------------------------------------------------------------------------------------


async def test_spoken_question_gets_a_paced_mulaw_answer(gateway):
    gw = await gateway()
    async with TwilioPeer(gw.url, custom_parameters={"caller": "+15550100"}) as call:
        spoken = await call.say(tone_speech("what is the capital of france"))
        answer = await call.wait_for_answer(after=spoken.end)
        onset = call.first_played_after(spoken.end) - spoken.end
        await call.wait_for(lambda: len(gw.calls) == 1 and gw.calls[0].stats.marks_played == len(call.marks))
    assert decode_tones(answer, 8000) == PARIS
    assert 0.3 < onset < 1.5  # 500 ms end-of-turn hangover, then almost nothing (fake stages)
    # exact 20 ms media messages, paced in real time, not dumped
    assert {n for _, n in call.media} == {FRAME_BYTES}
    audio_s = len(call.media) * 0.02
    span = call.media[-1][0] - call.media[0][0]
    assert audio_s - 0.35 < span < audio_s + 0.3, (span, audio_s)  # sent ~120 ms ahead of playing
    # a mark after each batch, each echoed once played; the last one is at the end of the answer
    assert call.marks and not any(m.cleared for m in call.marks)
    assert all(m.echoed_at is not None and m.echoed_at >= m.due - 0.005 for m in call.marks)
    positions = [int(m.name.split(":")[1]) for m in call.marks]
    assert positions == sorted(positions) and positions[-1] == len(call.media) * 20
    assert call.protocol_errors == []
    # the application saw the call and its events
    twilio_call = gw.calls[0]
    assert twilio_call.call_sid == call.call_sid and twilio_call.custom_parameters == {"caller": "+15550100"}
    started = gw.of(SessionStarted)[0]
    assert started.session_id == twilio_call.session_id and started.input_sample_rate == 8000
    assert [e.text for e in gw.of(TranscriptFinal)] == ["what is the capital of france"]
    assert [(e.status, e.text) for e in gw.of(ResponseDone)] == [("completed", " ".join(PARIS))]
    await gw.wait_sessions(0)


async def test_talking_over_the_answer_clears_twilio_and_stops_audio(gateway):
    gw = await gateway()
    async with TwilioPeer(gw.url) as call:
        spoken = await call.say(tone_speech("tell me a story"))
        await call.wait_for(lambda: call.loud_seconds(spoken.end, now()) >= 1.0, limit_s=8)
        barge = call.say_nowait(tone_speech("what is the capital of france"))
        t_clear = await call.wait_for_clear(limit_s=3)
        answer = await call.wait_for_answer(after=barge.end)
    assert t_clear - barge.start < 0.4  # VAD needs ~100 ms of speech; then the clear goes out at once
    assert call.dropped_samples > 0.05 * 8000  # Twilio had audio queued, and dropped it
    # nothing of the story played after the clear (and the next answer waits for the end of the turn)
    assert call.loud_seconds(t_clear + 0.005, barge.end) == 0.0
    assert not [t for t, _ in call.media if t_clear + 0.02 < t < barge.end]  # and the server sent none
    assert len(call.clears) == 1 and decode_tones(answer, 8000) == PARIS
    # the core reported the interruption with the words that were heard
    (interrupted,) = gw.of(Interrupted)
    heard = interrupted.played_text.split()
    assert 3 <= len(heard) and heard == STORY[: len(heard)]
    assert [e.status for e in gw.of(ResponseDone)] == ["interrupted", "completed"]
    # the marks of the dropped audio came back at once and did not count as played
    cleared = [m for m in call.marks if m.cleared]
    assert cleared and all(m.echoed_at - t_clear < 0.05 for m in cleared)
    stats = gw.calls[0].stats
    assert stats.clears == 1 and stats.marks_dropped >= len(cleared)
    assert stats.marks_played + stats.marks_dropped == len([m for m in call.marks if m.echoed_at])
    assert call.protocol_errors == []


async def test_marks_bound_what_was_heard_when_twilio_plays_late(gateway):
    """A handset that plays 1 s late: the core's clock alone would count a second of unheard words;
    the echoed marks keep the history to what the caller actually heard."""
    gw = await gateway()
    async with TwilioPeer(gw.url, playback_delay_s=1.0) as call:
        spoken = await call.say(tone_speech("tell me a story"))
        await call.wait_for(lambda: call.loud_seconds(spoken.end, now()) >= 1.2, limit_s=10)
        call.say_nowait(tone_speech("stop"))
        t_clear = await call.wait_for_clear(limit_s=3)
        await call.wait_for(lambda: gw.of(ResponseDone), limit_s=2)  # the interrupted answer's
        history = list(gw.service.sessions[gw.calls[0].session_id].history)
    (interrupted,) = gw.of(Interrupted)
    (audio_started,) = [e for e in gw.of(ResponseAudioStarted) if e.turn_id == interrupted.turn_id]
    clock_s = interrupted.t - audio_started.t  # what the playout clock alone says was heard
    played_s = sum(len(c.audio) for c in call.played_chunks(t_clear)) / 8000
    assert abs(interrupted.played_ms / 1000 - played_s) < 0.1, (interrupted.played_ms, played_s)
    assert interrupted.played_ms / 1000 < clock_s - 0.8
    heard = decode_tones(call.played_audio(None, t_clear), 8000)  # a cut word counts here, not in played_text
    words = interrupted.played_text.split()
    assert words == STORY[: len(words)] and len(heard) - 1 <= len(words) <= len(heard)
    (done,) = [e for e in gw.of(ResponseDone) if e.turn_id == interrupted.turn_id]
    assert done.status == "interrupted" and done.played_text == interrupted.played_text
    assert history[-1] == {"role": "assistant", "content": interrupted.played_text}


@pytest.mark.parametrize("how", ["stop", "abort"])
async def test_hang_up_mid_answer_frees_the_session(gateway, how):
    gw = await gateway()
    call = TwilioPeer(gw.url)
    await call.__aenter__()
    try:
        spoken = await call.say(tone_speech("tell me a story"))
        await call.wait_for(lambda: call.first_played_after(spoken.end) is not None, limit_s=8)
        assert len(gw.service.sessions) == 1
        t = now()
        if how == "stop":
            await call.stop()
        else:
            call.abort()
        await gw.wait_sessions(0, limit_s=2)
        assert now() - t < 0.5
    finally:
        await call.close()
    if how == "stop":
        assert call.close_code == 1000
    async with TwilioPeer(gw.url) as again:  # and the server still takes calls
        await again.wait_for(lambda: len(gw.service.sessions) == 1)


async def test_bad_frames_are_logged_and_skipped_while_a_parallel_call_works(gateway, caplog):
    caplog.set_level(logging.INFO, logger="duplex.transports.twilio")
    gw = await gateway()

    async def good_call() -> list[str]:
        async with TwilioPeer(gw.url, seed=1) as call:
            spoken = await call.say(tone_speech("what is the capital of france"))
            return decode_tones(await call.wait_for_answer(after=spoken.end), 8000)

    async def bad_call() -> tuple[list[str], TwilioPeer]:
        async with TwilioPeer(
            gw.url,
            seed=2,
            auto_start=False,
            call_sid="CAbad",
            media_format={"encoding": "audio/x-l16", "sampleRate": 16000},
        ) as call:
            media = {"event": "media", "streamSid": call.stream_sid, "media": {"payload": "//8="}}
            for junk in [
                "{not json",
                "[1, 2]",
                '"media"',
                json.dumps({"event": 5}),
                json.dumps({"event": "teleport"}),
                json.dumps(media),
                b"\x00\x01binary",
                json.dumps({"event": "dtmf", "dtmf": {"digit": "1"}}),
            ]:
                await call.send_raw(junk)
            await call.start()  # with the wrong mediaFormat: warned about, then mu-law 8 kHz is assumed
            for payload in ["not base64!", "", base64.b64encode(bytes(9000)).decode(), 7]:
                await call.send_json({**media, "media": {"payload": payload}})
            for junk_event in [
                {"event": "media", "streamSid": call.stream_sid},
                {**media, "media": {"track": "outbound", "payload": "//8="}},
                {"event": "dtmf", "dtmf": {"digit": "Z"}},
                {"event": "mark", "mark": {"name": "t9:999:9"}},
                {"event": "start", "start": {"streamSid": "MZother"}},
            ]:
                await call.send_json(junk_event)
            spoken = await call.say(tone_speech("hello how are you"))
            return decode_tones(await call.wait_for_answer(after=spoken.end), 8000), call

    good, (bad, peer) = await asyncio.gather(good_call(), bad_call())
    assert good == PARIS
    assert bad == "i am fine thanks".split()  # the noisy call still works too
    assert peer.protocol_errors == []
    (bad_twilio,) = [c for c in gw.calls if c.call_sid == "CAbad"]
    assert bad_twilio.stats.bad_frames == 17
    sid = bad_twilio.session_id
    warned = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and sid in r.getMessage()
    ]
    for text in [
        "malformed JSON",
        'not a JSON object with a string "event"',
        "unknown event 'teleport'",
        "media before start",
        "binary frame",
        "dtmf before start",
        "mediaFormat",
        "not valid base64",
        "empty media payload",
        "base64 characters",
        "without a string payload",
        "without a 'media' object",
        "track 'outbound'",
        "dtmf digit 'Z'",
        "never sent",
        "a second start message",
    ]:
        assert any(text in w for w in warned), f"no warning with {text!r} in {warned}"
    assert all("skipped" in w for w in warned if "mediaFormat" not in w)
    await gw.wait_sessions(0)


async def test_too_many_bad_frames_in_a_row_close_the_call(gateway, monkeypatch):
    monkeypatch.setattr(tw, "MAX_BAD_FRAMES", 20)
    gw = await gateway()
    async with TwilioPeer(gw.url, stream_audio=False) as call:  # no media in between: they are good messages
        for _ in range(15):
            await call.send_raw("{junk")
        await call.send_json(
            {"event": "connected", "protocol": "Call", "version": "1.0.0"}
        )  # a good one resets
        for _ in range(15):
            await call.send_raw("{junk")
        await asyncio.sleep(0.2)
        assert not call.closed.is_set()
        for _ in range(10):
            await call.send_raw("{junk")
        await asyncio.wait_for(call.closed.wait(), 2)
    assert call.close_code == 1008
    assert gw.calls[0].stats.bad_frames == 35  # closed at the 20th in a row: 15 + 15 + 5
    await gw.wait_sessions(0)


async def test_no_start_message_closes_the_call(gateway, monkeypatch):
    monkeypatch.setattr(tw, "START_TIMEOUT_S", 0.3)
    gw = await gateway()
    async with TwilioPeer(gw.url, auto_start=False) as call:
        await gw.wait_sessions(1)
        await asyncio.wait_for(call.closed.wait(), 2)
    assert call.close_code == 1008
    await gw.wait_sessions(0)


async def test_server_at_capacity_closes_with_1013(gateway):
    gw = await gateway(max_sessions=1)
    async with TwilioPeer(gw.url) as first:
        await gw.wait_sessions(1)
        with pytest.raises(InvalidStatus) as refused:  # normally refused before the upgrade ...
            await TwilioPeer(gw.url).connect()
        assert refused.value.response.status_code == 503
        # ... and if a race lets one through (the check says "room", then the session cannot open),
        # it is closed with 1013
        answers = iter([False])
        gw.service.full = lambda: next(answers, True)
        async with TwilioPeer(gw.url, auto_start=False) as second:
            await asyncio.wait_for(second.closed.wait(), 2)
        assert second.close_code == 1013
        assert not first.closed.is_set()


async def test_signature_is_required_when_a_token_is_set(gateway):
    gw = await gateway(auth_token="s3cret", public_url="wss://voice.example.com")
    signed = "wss://voice.example.com/v1/twilio?tenant=7"
    async with TwilioPeer(gw.url + "?tenant=7", auth_token="s3cret", signature_url=signed) as call:
        await call.wait_for(lambda: len(gw.calls) == 1)
    async with TwilioPeer(gw.url, auth_token="s3cret", signature_url="wss://voice.example.com:443/v1/twilio"):
        await gw.wait_sessions(1)  # the default port written out is the same URL
    refusals = {
        "missing": TwilioPeer(gw.url),
        "wrong token": TwilioPeer(
            gw.url, auth_token="guess", signature_url="wss://voice.example.com/v1/twilio"
        ),
        "other URL": TwilioPeer(gw.url + "?tenant=8", auth_token="s3cret", signature_url=signed),
        "not base64": TwilioPeer(gw.url, signature="é" * 28),
    }
    for name, peer in refusals.items():
        with pytest.raises(InvalidStatus) as refused:
            await peer.connect()
        assert refused.value.response.status_code == 403, name
    assert gw.service.sessions_total == 2  # refused before the upgrade: no session was ever opened
    open_gw = await gateway()  # no token configured: anyone may connect
    async with TwilioPeer(open_gw.url):
        await open_gw.wait_sessions(1)


async def test_dtmf_reaches_on_event_with_the_session_id(gateway, caplog):
    caplog.set_level(logging.INFO, logger="duplex.transports.twilio")
    gw = await gateway()
    async with TwilioPeer(gw.url) as call:
        for digit in "5#a":
            await call.send_dtmf(digit)
        await call.wait_for(lambda: len(gw.of(DtmfReceived)) == 3, limit_s=2)
    sid = gw.calls[0].session_id
    assert [(e.digit, e.source, e.session_id) for e in gw.of(DtmfReceived)] == [
        ("5", "twilio", sid),
        ("#", "twilio", sid),
        ("A", "twilio", sid),
    ]
    assert gw.of(DtmfReceived)[0].to_wire()["type"] == "input.dtmf"
    assert any(f"session {sid}" in r.getMessage() and "DTMF 5" in r.getMessage() for r in caplog.records)


async def test_custom_parameters_set_session_options(gateway):
    gw = await gateway()
    params = {"end_of_turn_silence_ms": "700", "vad_threshold": "0.6", "caller": "+15550100"}
    async with TwilioPeer(gw.url, custom_parameters=params) as call:
        await call.wait_for(lambda: gw.of(SessionStarted))
        core = gw.service.sessions[gw.calls[0].session_id]
        assert core.endpointer.end_silence == 16000 * 700 // 1000 and core.endpointer.threshold == 0.6
    assert gw.of(SessionStarted)[0].options["end_of_turn_silence_ms"] == 700


async def test_jittery_bunched_input_still_gets_the_right_answer(gateway):
    gw = await gateway()
    async with TwilioPeer(gw.url, jitter_s=0.08, bunch_probability=0.3, max_bunch=5, seed=7) as call:
        spoken = await call.say(tone_speech("what is two plus two"))
        answer = await call.wait_for_answer(after=spoken.end)
    gaps = np.diff(call.send_times)
    assert (gaps < 0.002).sum() > 20 and gaps.max() > 0.06  # it did bunch and stall
    assert [e.text for e in gw.of(TranscriptFinal)] == ["what is two plus two"]
    assert decode_tones(answer, 8000) == "two plus two is four".split()
