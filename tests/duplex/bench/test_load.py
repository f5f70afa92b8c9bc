"""The load bench (`duplex bench --sessions 1,2` and `--soak`) against in-process tone servers (real
time), and its gap detector on synthetic arrival times."""

from __future__ import annotations

import json

import pytest

from duplex.base.config import load_profile
from duplex.bench.cli import tone_prompt
from duplex.bench.common import BenchError, InProcessServer, Rx, answer_audio, answer_gaps, playback_gaps
from duplex.bench.load import (
    memory_per_session,
    open_rss,
    parse_duration,
    parse_sessions,
    run_load,
    run_soak,
)
from duplex.bench.load_report import format_load_table, format_soak_table
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.fakes import fake_stages, scripted_answer
from duplex.transports.native import DuplexServer, ServerSettings

FRAME = 0.04  # the tone server's answer frames
LEAD = 0.12
PROMPTS = {
    "questions": ["What is the capital of France?", "Hello, how are you?"],
    "long_prompts": ["Tell me a long story about a dragon."],
    "interruptions": ["Stop. What is two plus two?"],
}


async def _server(max_sessions: int = 8):
    service = DuplexService(
        load_profile("cpu"), fake_stages(scripted_answer), limits=ServiceLimits(max_sessions=max_sessions)
    )
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0))
    await srv.start()
    return srv, service


# -- the gap detector ----------------------------------------------------------------------


def paced(n: int, t0: float = 10.0, late: dict[int, float] | None = None) -> list[tuple[float, float]]:
    """n frames as the server sends them: the first LEAD of audio at once, then each LEAD before its
    play time; `late` delays frame k (and every frame after it, as a stalled stream does) by s."""
    frames, shift = [], 0.0
    for k in range(n):
        shift += (late or {}).get(k, 0.0)
        frames.append((t0 + max(0.0, k * FRAME - LEAD) + shift, FRAME))
    return frames


def test_a_real_time_stream_has_no_gaps() -> None:
    assert playback_gaps(paced(100)) == []
    # frames bunched by jitter within the playout lead are absorbed
    frames = paced(100)
    frames[40:43] = [(frames[42][0], FRAME)] * 3
    assert playback_gaps(frames) == []


def test_a_delayed_stream_is_flagged_with_its_gap() -> None:
    frames = paced(100, late={50: 0.4})  # the TTS fell 400 ms behind at frame 50
    gaps = playback_gaps(frames)
    assert len(gaps) == 1
    t, gap = gaps[0]
    assert t == frames[50][0]
    assert gap == pytest.approx(0.4 - LEAD, abs=1e-6)  # the lead covered 120 ms of it
    # two stalls, two gaps; a stall shorter than the lead, none
    assert len(playback_gaps(paced(100, late={20: 0.3, 70: 0.5}))) == 2
    assert playback_gaps(paced(100, late={20: 0.1})) == []
    # a stream slower than real time throughout starves at every frame
    slow = [(10.0 + k * FRAME * 1.5, FRAME) for k in range(20)]
    assert len(playback_gaps(slow)) == 19


def test_answer_gaps_per_answer_and_cut_at_the_users_speech() -> None:
    def frames(t0: float, n: int, step: float = FRAME) -> list[Rx]:
        return [Rx(t0 + k * step, None, FRAME) for k in range(n)]

    log = [
        Rx(0.0, {"type": "response.audio.started", "turn_id": 1}),
        *frames(0.0, 10),
        *frames(1.0, 10),  # 0.6 s after the first 10 frames ran out: a gap
        Rx(1.5, {"type": "response.done", "turn_id": 1}),
        Rx(2.0, {"type": "response.audio.started", "turn_id": 2}),
        *frames(2.0, 5),
        Rx(2.3, {"type": "speech.started"}),  # the server holds the answer while the user talks: no gap
        *frames(4.0, 5),
        Rx(4.5, {"type": "response.interrupted", "turn_id": 2}),
    ]
    assert [(turn, len(f)) for turn, f in answer_audio(log)] == [(1, 20), (2, 5)]
    g = answer_gaps(log)
    assert g["answers"] == 2 and g["count"] == 1 and g["answers_with_gaps"] == 1
    assert g["worst_ms"] == pytest.approx(600.0, abs=0.5)


def test_options_parse() -> None:
    assert parse_sessions("1,2,4") == [1, 2, 4]
    assert parse_duration("90s") == 90 and parse_duration("10m") == 600 and parse_duration("45") == 45
    for bad in ("0", "a,b", ""):
        with pytest.raises(BenchError):
            parse_sessions(bad)
    for bad in ("10x", "-5s", "m"):
        with pytest.raises(BenchError):
            parse_duration(bad)


# -- against the tone server ------------------------------------------------------------------


async def test_load_levels_one_and_two_callers(tmp_path) -> None:
    srv, service = await _server()
    lines: list[str] = []
    try:
        result = await run_load(
            f"ws://127.0.0.1:{srv.port}/v1/duplex",
            [1, 2],
            turns=1,
            barge_ins=1,
            synth=tone_prompt,
            out_dir=tmp_path,
            stagger_s=0.3,
            settle_s=0.3,
            progress=lines.append,
            **PROMPTS,
        )
    finally:
        await srv.close()
        service.close()
    data = json.loads((tmp_path / "load.json").read_text())
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    one, two = data["levels"]
    assert [one["sessions"], two["sessions"]] == [1, 2]
    assert one["started"] == 1 and two["started"] == 2 and one["refused"] == two["refused"] == 0
    # each caller: the question, the long question, the answer to the interruption
    assert one["answers_by_caller"] == [3] and two["answers_by_caller"] == [3, 3]
    assert one["onset_s"]["n"] == 3 and two["onset_s"]["n"] == 6
    assert one["barge_in_reaction_s"]["n"] == 1 and two["barge_in_reaction_s"]["n"] == 2
    assert two["onset_s"]["p99"] is not None and two["barge_in_reaction_s"]["p90"] is not None
    assert two["leaked_frames"] == 0 and two["turns_failed"] == 0
    assert two["gaps"]["answers"] >= 6 and two["gaps"]["count"] == 0, two["gaps"]
    # the server's side, diffed per level
    assert {"vad", "asr", "llm", "tts"} <= set(two["stages"])
    assert two["stages"]["vad"]["jobs"] > one["stages"]["vad"]["jobs"] > 0
    assert all("batch_p50" in b and "batch_max" in b for b in two["batches"].values())
    assert two["server"]["cpu_s"] > 0 and two["server"]["rss_mb"] > 0 and two["server"]["threads"] > 0
    # RSS sampled while every caller of a level was connected, and its slope per extra caller
    assert one["server"]["rss_mb_open"] > 0 and two["server"]["rss_mb_open"] > 0
    assert data["memory_per_session_mb"] == pytest.approx(
        two["server"]["rss_mb_open"] - one["server"]["rss_mb_open"], abs=0.1
    )
    # /stats counts the LLM's tokens: tokens/s per level, and no "not measured" note
    assert one["llm_tokens_per_s"] > 0 and two["llm_tokens_per_s"] > 0 and data["llm_tokens_note"] is None
    assert data["settings"]["playout_lead_ms"] == 120
    assert any(line.startswith("[caller 2]") for line in lines)
    table = format_load_table(result)
    assert "refused" in table and "batch size" in table and "memory per extra session" in table


def test_memory_per_session_is_the_slope_of_rss_with_every_caller_connected() -> None:
    samples = [(0, 900.0), (1, 1000.0), (2, 1040.0), (2, 1060.0), (2, 1300.0), (1, 1100.0)]
    assert open_rss(samples, 2) == 1060.0  # the median of the samples with both callers on
    assert open_rss(samples, 3) is None
    levels = [
        {"sessions": n, "server": {"rss_mb_open": r}} for n, r in ((1, 1000.0), (2, 1040.0), (4, 1120.0))
    ]
    assert memory_per_session(levels) == pytest.approx(40.0)
    assert memory_per_session(levels[:1]) is None  # one N: no slope
    assert memory_per_session([*levels[:1], {"sessions": 2, "server": {"rss_mb_open": None}}]) is None


async def test_a_caller_refused_at_capacity_is_counted(tmp_path) -> None:
    srv, service = await _server(max_sessions=1)
    try:
        result = await run_load(
            f"ws://127.0.0.1:{srv.port}/v1/duplex",
            [2],
            turns=1,
            barge_ins=0,
            synth=tone_prompt,
            out_dir=None,
            stagger_s=0.3,
            progress=None,
            **PROMPTS,
        )
    finally:
        await srv.close()
        service.close()
    (level,) = result["levels"]
    assert level["started"] == 1 and level["refused"] == 1
    assert level["refusals"][0]["status"] == 503 and level["refusals"][0]["code"] == "at_capacity"
    assert level["answers_by_caller"] == [1]
    assert "sessions" in level["targets_missed"]


async def _soak_on_fakes(tmp_path, callers: int, duration_s: float, **kw):
    """run_soak against an in-process server on the fake stages, its task count probed."""
    service = DuplexService(load_profile("cpu"), fake_stages(scripted_answer))
    server = InProcessServer(service)
    url = server.start()
    try:
        return await run_soak(
            url,
            callers,
            duration_s,
            barge_ins=0,
            synth=tone_prompt,
            out_dir=tmp_path,
            settle_s=0.5,
            server_probe=lambda: {"server_tasks": server.task_count()},
            progress=None,
            **kw,
            **PROMPTS,
        )
    finally:
        server.stop()
        service.close()


async def test_soak_with_callers_who_hang_up_leaves_no_task_behind(tmp_path) -> None:
    """`--hangups`: callers who drop the connection (no close handshake) at the answer's first audio,
    while a regular caller talks; the server's task count is back to idle after them."""
    result = await _soak_on_fakes(tmp_path, 1, 6.0, turns=1, sample_every_s=2.0, stagger_s=0.2, hangups=1)
    h = result["totals"]["hangups"]
    assert h["calls"] >= 2 and h["at_first_audio"] == h["calls"], h
    assert result["verdict"]["server_tasks_grew"] is False
    assert result["samples"][-1]["sessions"] == 0
    assert "hang-ups:" in format_soak_table(result)


async def test_soak_samples_the_server_and_writes_its_outputs(tmp_path) -> None:
    result = await _soak_on_fakes(tmp_path, 2, 3.0, turns=2, sample_every_s=1.0, stagger_s=0.3)
    data = json.loads((tmp_path / "soak.json").read_text())
    assert (tmp_path / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = data["samples"]
    assert [s["phase"] for s in samples][0] == "idle" and samples[-1]["phase"] == "idle"
    assert sum(s["phase"] == "load" for s in samples) >= 2
    assert all(s["rss_mb"] > 0 and s["threads"] > 0 and isinstance(s["server_tasks"], int) for s in samples)
    assert max(s["sessions"] for s in samples) == 2 and samples[-1]["sessions"] == 0
    t, v = data["totals"], data["verdict"]
    assert t["sessions_started"] >= 2 and t["sessions_failed"] == 0
    assert v["rss_growth_pct"] is not None and v["server_tasks_grew"] is False
    assert isinstance(v["threads_grew"], bool)
    assert "RSS growth" in format_soak_table(result)


def test_calibrate_records_the_capacity(tmp_path, monkeypatch):
    """--calibrate stores what the load bench found, where `--max-sessions auto` reads it."""
    import argparse

    from duplex.bench.cli import _calibrate
    from duplex.runtime.capacity import resolve_max_sessions

    monkeypatch.setenv("DUPLEX_CACHE", str(tmp_path))
    result = {
        "settings": {"targets": {"onset_p90_s": 1.0}},
        "levels": [
            {
                "sessions": 1,
                "onset_s": {"p90": 0.6},
                "barge_in_reaction_s": {"p90": 0.1},
                "gaps": {"count": 0},
            },
            {
                "sessions": 2,
                "onset_s": {"p90": 0.9},
                "barge_in_reaction_s": {"p90": 0.15},
                "gaps": {"count": 0},
            },
        ],
        "max_sessions_within_targets": 2,
    }
    _calibrate(argparse.Namespace(profile="cpu", turns=3, barge_ins=1), result)
    n, source = resolve_max_sessions("cpu")
    assert n == 2 and source.startswith("calibrated")
