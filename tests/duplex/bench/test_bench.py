"""`duplex bench` end to end against an in-process server with the tiny tone stages (real time)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from duplex.base.config import load_profile
from duplex.bench.common import BenchError, percentiles, trim_speech
from duplex.bench.report import format_table
from duplex.bench.serve import run_bench
from duplex.runtime.service import DuplexService
from duplex.testing.fakes import VOCAB, fake_stages, scripted_answer, tone_speech
from duplex.transports.native import DuplexServer, ServerSettings

answer = scripted_answer


def tone_synth(text: str) -> np.ndarray:
    """Speak the in-vocabulary words of `text` as tone speech (16 kHz)."""
    words = [w for w in re.findall(r"[a-z]+", text.lower()) if w in VOCAB]
    return tone_speech(" ".join(words) or "hello")


@pytest.fixture
async def server():
    service = DuplexService(load_profile("cpu"), fake_stages(answer))
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    await srv.start()
    yield srv
    await srv.close()
    service.close()


def test_percentiles_report_n() -> None:
    st = percentiles([1.0, 2.0, 3.0, 4.0])
    assert st["n"] == 4 and st["p50"] == 2.5 and st["max"] == 4.0
    assert percentiles([])["n"] == 0 and percentiles([])["p50"] is None


def test_trim_speech_cuts_silence() -> None:
    speech = tone_speech("hello")  # 0.2 s tone then a 0.05 s gap
    padded = np.concatenate([np.zeros(8000, np.float32), speech, np.zeros(8000, np.float32)])
    trimmed = trim_speech(padded)
    assert abs(len(trimmed) - 3200) <= 160


async def test_unreachable_server_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(BenchError, match="Is it running"):
        await run_bench("ws://127.0.0.1:9/v1/duplex", 1, 0, synth=tone_synth, out_dir=tmp_path, progress=None)


async def test_bench_against_tone_server(server, tmp_path) -> None:
    lines: list[str] = []
    result = await run_bench(
        f"ws://127.0.0.1:{server.port}/v1/duplex",
        turns=2,
        barge_ins=1,
        synth=tone_synth,
        out_dir=tmp_path,
        questions=["What is the capital of France?", "Hello, how are you?"],
        long_prompts=["Tell me a long story about a dragon."],
        interruptions=["Stop. What is two plus two?"],
        progress=lines.append,
    )
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["summary"] == json.loads(json.dumps(result["summary"]))
    s = data["summary"]
    turns = data["samples"]["turns"]
    # 2 questions + the long question + the answer to the interruption
    assert [t["kind"] for t in turns] == ["question", "question", "long", "interruption"]
    assert all(t["ok"] for t in turns), turns
    assert s["onset_s"]["n"] == 4
    assert all(0 < t["onset_s"] < 3.0 for t in turns)
    assert turns[0]["transcript"] == "what is the capital of france"
    assert turns[3]["transcript"] == "stop what is two plus two"
    for stage in ("end_of_turn", "final_transcript", "first_audio"):
        assert s["server_latency_ms"][stage]["n"] == 4
    (b,) = data["samples"]["barge_ins"]
    assert b["ok"] and b["played_text"]
    assert s["barge_in_reaction_s"]["n"] == 1 and 0 <= b["reaction_s"] < 0.5
    assert s["leaked_frames_total"] == 0
    for key in ("p50", "p90", "p99"):
        assert s["onset_s"][key] is not None
    # real-time factors from /stats: every stage ran, on a known amount of audio
    rtf = s["rtf"]
    assert {"vad", "asr", "llm", "tts"} <= set(rtf["stages"])
    assert rtf["input_audio_s"] > 5 and rtf["output_audio_s"] > 3
    assert rtf["labels"]["vad"]["jobs"] > 0 and rtf["labels"]["vad"]["rtf"] is not None
    assert rtf["process"]["peak_rss_mb"] > 0
    assert data["server_stats"]["after"]["executor"]
    # the server's own count of asyncio tasks (a soak against a separate server watches it for leaks)
    assert data["server_stats"]["after"]["process"]["asyncio_tasks"] >= 1
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(lines) >= 3  # a line per turn / trial
    table = format_table(result)
    assert "P50" in table and "barge-in" in table and "RTF" in table


def test_count_leaks_counts_frames_between_interrupt_and_next_answer() -> None:
    from duplex.bench.common import Rx, count_leaks

    log = [
        Rx(0.0, {"type": "response.audio.started"}),
        Rx(0.1, None, 0.04),
        Rx(0.2, {"type": "response.interrupted"}),
        Rx(0.3, None, 0.04),
        Rx(0.35, None, 0.04),
        Rx(0.4, {"type": "response.audio.started"}),
        Rx(0.5, None, 0.04),
    ]
    assert count_leaks(log) == 2


async def test_bench_without_barge_ins_reports_and_plots(server, tmp_path) -> None:
    result = await run_bench(
        f"ws://127.0.0.1:{server.port}/v1/duplex",
        turns=1,
        barge_ins=0,
        synth=tone_synth,
        out_dir=tmp_path,
        questions=["What is the capital of France?"],
        session_options={"relay": True},
        progress=None,
    )
    # a run with --barge-ins 0 used to crash while plotting; its barge-in target is not measured, not missed
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_table(result)
    assert "barge_in_p50_s not measured" in table and "MISSED" not in table
    assert json.loads((tmp_path / "bench.json").read_text())["settings"]["session_options"] == {"relay": True}
