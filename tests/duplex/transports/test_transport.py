"""The pieces every transport adapter shares: wire-audio conversion, a session per connection, addresses."""

from __future__ import annotations

import numpy as np
import pytest

from codec.g711 import float_to_ulaw, ulaw_to_float
from codec.pcm import float_to_pcm16, pcm16_to_float
from duplex.base.config import load_profile
from duplex.runtime.service import CapacityError, DuplexService, ServiceLimits
from duplex.testing.fakes import decode_tones, fake_stages, scripted_answer, tone_speech
from duplex.transports.common import open_session
from duplex.transports.gateway import parse_host_port
from duplex.transports.wire_audio import AudioFormatError, AudioIn, AudioOut


def _in_frames(audio: np.ndarray, step: int) -> list[np.ndarray]:
    return [audio[i : i + step] for i in range(0, len(audio), step)]


def test_audio_in_decodes_and_resamples_mulaw_8k_to_16k_as_a_stream():
    speech8k = tone_speech("what is two plus two", sr=8000)
    conv = AudioIn(8000, "ulaw")
    out = np.concatenate([conv.decode(float_to_ulaw(f)) for f in _in_frames(speech8k, 160)])
    # the resampler holds back a few ms of filter delay; everything else comes out at twice the rate
    assert abs(len(out) - 2 * len(speech8k)) < 0.01 * 16000
    assert decode_tones(out, 16000) == "what is two plus two".split()


def test_audio_in_refuses_odd_pcm16_and_unknown_encodings():
    with pytest.raises(AudioFormatError, match="even byte count"):
        AudioIn(16000).decode(b"\x00\x01\x02")
    with pytest.raises(AudioFormatError, match="unknown audio encoding"):
        AudioIn(16000, "opus")


def test_audio_in_at_16k_pcm16_is_exact():
    x = (np.random.default_rng(0).uniform(-0.5, 0.5, 1600)).astype(np.float32)
    wire = float_to_pcm16(x)
    assert np.array_equal(AudioIn(16000).decode(wire), pcm16_to_float(wire))


def test_audio_out_converts_24k_pcm16_to_8k_mulaw_and_resets_cleanly():
    answer = tone_speech("paris is the capital of france", sr=24000)
    conv = AudioOut(24000, 8000, "ulaw")
    assert conv.bytes_per_sample == 1
    wire = b"".join(conv.encode(float_to_pcm16(f)) for f in _in_frames(answer, 960))
    assert abs(len(wire) - len(answer) / 3) < 0.01 * 8000
    assert decode_tones(ulaw_to_float(wire), 8000) == "paris is the capital of france".split()
    conv.reset()  # after a barge-in: the next answer starts from an empty filter
    assert len(conv.encode(float_to_pcm16(np.zeros(960, np.float32)))) <= 320
    passthrough = AudioOut(24000, 24000, "pcm16")
    frame = float_to_pcm16(answer[:960])
    assert passthrough.encode(frame) == frame


async def test_open_session_frees_the_session_and_honours_capacity():
    service = DuplexService(
        load_profile("cpu"), fake_stages(scripted_answer), limits=ServiceLimits(max_sessions=1)
    )
    sent = []

    async def send(item):
        sent.append(item)

    try:
        async with open_session(service, send) as runner:
            assert runner.core.session_id in service.sessions
            with pytest.raises(CapacityError):
                async with open_session(service, send):
                    pass
        assert service.sessions == {}
    finally:
        service.close()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:9092", ("127.0.0.1", 9092)),
        (":9092", ("127.0.0.1", 9092)),
        ("9092", ("127.0.0.1", 9092)),
        ("[::1]:9000", ("::1", 9000)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
    ],
)
def test_parse_host_port(value, expected):
    assert parse_host_port(value) == expected


@pytest.mark.parametrize("bad", ["host:port", "1:99999", "localhost:"])
def test_parse_host_port_refuses_garbage(bad):
    with pytest.raises(ValueError):
        parse_host_port(bad)
