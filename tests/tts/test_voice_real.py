"""The own voice as a user meets it: `duplex say` with the cpu-flow and cpu profiles, `duplex eval tts`, the
TTS backend chooser, and a spoken conversation through the service speaking with the flow voice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from duplex.base.config import ComponentConfig, ConfigError
from duplex.cli import main as duplex_main
from tts.loading import load_tts

TEXT = "Paris is the capital of France, and it sits on the Seine."


def test_an_unknown_tts_backend_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="unknown TTS backend 'piper'.*hibari, flow"):
        load_tts(ComponentConfig("tts", "piper"))


def test_say_refuses_empty_text(tmp_path: Path, capsys) -> None:
    assert duplex_main(["say", "  ", "--out", str(tmp_path / "a.wav"), "--profile", "cpu"]) == 2
    assert "nothing to say" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.parametrize("profile", ["cpu-flow", "cpu"])
def test_say_writes_the_sentence_as_speech(profile: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "a.wav"
    assert duplex_main(["say", TEXT, "--out", str(out), "--profile", profile]) == 0
    audio, rate = sf.read(str(out), dtype="float32")
    assert rate == 24000
    words = len(TEXT.split())
    assert 0.15 * words < len(audio) / rate < 0.6 * words  # speech at a speaking rate, not a click or a loop
    assert np.sqrt(np.mean(audio**2)) > 0.01
    assert re.search(r"first audio after \d+ ms", capsys.readouterr().out)


@pytest.mark.integration
def test_the_flow_stage_tags_every_word_once(tmp_path: Path) -> None:
    from duplex.base.config import load_profile
    from tts.say import render

    r = render(load_profile("cpu-flow"), TEXT)
    assert r.words == TEXT.split()  # what a barge-in reports as heard is exact to the chunk
    assert r.chunks >= 10  # ~225 ms chunks, not whole phrases


@pytest.mark.integration
def test_eval_tts_scores_the_own_voice_beside_hibari(tmp_path: Path, capsys) -> None:
    rc = duplex_main(
        [
            "eval",
            "tts",
            "-n",
            "2",
            "--steps",
            "2",
            "--timing-repeats",
            "5",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert rc == 0
    res = json.loads((tmp_path / "tts.json").read_text())
    assert set(res["wer"]) == {"hibari", "codec", "hibari_live", "flow_2"}
    assert all(0.0 <= w <= 2.0 for w in res["wer"].values())
    assert res["bitrate_bps"] < 1000
    assert res["timing_one_thread"]["2"]["first_chunk_n"] >= 5
    assert (tmp_path / "tts.png").stat().st_size > 10_000
    assert "own voice WER (2 steps" in capsys.readouterr().out


@pytest.mark.integration
def test_eval_tts_scores_a_candidate_codec_on_chosen_parts(tmp_path: Path, capsys) -> None:
    """A candidate codec (here a copy of the shipped one) replaces the profile's; only the chosen parts run."""
    import shutil

    codec = tmp_path / "candidate.safetensors"
    shutil.copyfile(Path(__file__).resolve().parents[2] / "codec/weights/speech_codec.safetensors", codec)
    argv = ["eval", "tts", "-n", "1", "--steps", "2", "--timing-repeats", "0", "--long-minutes", "0"]
    rc = duplex_main(
        [*argv, "--codec", str(codec), "--parts", "codec", "flow", "--out", str(tmp_path), "--no-progress"]
    )
    assert rc == 0
    res = json.loads((tmp_path / "tts.json").read_text())
    assert set(res["wer"]) == {"codec", "flow_2"} and res["timing_one_thread"] == {}
    assert res["weights"]["codec"] == str(codec) and res["gap_to_hibari"] == {}
    assert "own voice WER (2 steps" in capsys.readouterr().out


@pytest.mark.integration
async def test_a_spoken_question_is_answered_in_the_own_voice(live) -> None:
    """The live service's models with the flow voice in place of hibari: the answer is heard as its text."""
    from websockets.asyncio.client import connect

    from asr.moonshine import MoonshineModel
    from codec.resample import resample
    from duplex.base.config import load_profile
    from duplex.runtime.service import DuplexService, ServiceLimits
    from duplex.transports.native import DuplexServer, ServerSettings
    from tests.speech import synthesize
    from tests.test_e2e_real import Listener, silence, stream

    sr = 16000
    profile = load_profile("cpu-flow")
    stages = replace(live.service.stages, tts=load_tts(profile.component("tts")))
    service = DuplexService(profile, stages, limits=ServiceLimits(max_sessions=1))
    server = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    await server.start()
    try:
        async with connect(f"ws://127.0.0.1:{server.port}/v1/duplex") as ws:
            await ws.send(json.dumps({"type": "session.start", "sample_rate": sr}))
            listener = Listener(ws)
            try:
                await listener.wait_for("session.started")
                question = synthesize("What is the capital of France?", sample_rate=sr)
                await stream(ws, np.concatenate([silence(0.5), question, silence(1.0)]))
                done = await listener.wait_for("response.done", limit_s=60)
                assert done["status"] == "completed"
                await stream(ws, silence(2.0))
                answer = listener.audio_between(
                    listener.time_of("response.audio.started") - 1.0, float("inf")
                )
            finally:
                listener.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener.task
        said = set(re.findall(r"[a-z']+", done["text"].lower()))
        assert len(answer) > 24000 * 0.15 * len(said)
        heard = set(re.findall(r"[a-z']+", MoonshineModel().transcribe(resample(answer, 24000, sr)).lower()))
        assert len(said & heard) >= 0.5 * len(said), (done["text"], heard)
    finally:
        await server.close()
        service.close()
