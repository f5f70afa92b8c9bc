"""`duplex bench`: the serve bench (turns and barge-ins through the native protocol, and optionally
factual questions, mid-sentence pauses and multi-turn memory); with `--transport`, the same prompts
through every transport adapter; with `--sessions 1,2,4` (or `--soak 10m --sessions N`), N callers at
once (`duplex.bench.load`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from duplex.bench.common import QUESTIONS, VOICES, BenchError, InProcessServer, make_synth
from duplex.bench.report import format_table
from duplex.bench.serve import run_bench


def add_case_arguments(b: argparse.ArgumentParser) -> None:
    """`duplex bench` options for what a caller cares about beyond speed (issue 21); all off by default."""
    b.add_argument(
        "--voice",
        choices=VOICES,
        default="hibari",
        help="who speaks the prompts: hibari (the service's own voice) or heldout (flite slt and a Kokoro "
        "blend, never trained on; needs `make asr-voices`)",
    )
    b.add_argument(
        "--facts",
        type=int,
        default=0,
        metavar="N",
        help="ask N factual questions of data/dialogue/facts_eval.jsonl and score the answers by keywords "
        "(60 for a full run)",
    )
    b.add_argument(
        "--pauses",
        type=int,
        default=0,
        metavar="N",
        help="N sentences with a 1.0-1.5 s mid-sentence pause: how often the service takes the turn too early",
    )
    b.add_argument(
        "--pause-audio",
        choices=("whole", "alone"),
        default="whole",
        help="a pause case's parts cut from its whole sentence's audio (as a speaker who stops mid-flow; "
        "default) or each spoken alone (the first part then ends like a finished sentence)",
    )
    b.add_argument(
        "--memory",
        type=int,
        default=0,
        metavar="N",
        help="N two-turn cases ('My name is Anna.' ... 'What is my name?'; 30 in three sets): does the answer remember",
    )
    b.add_argument("--seed", type=int, default=0, help="seed of the pauses, barge-in waits and fact draw")


def main(args: argparse.Namespace) -> int:
    """`duplex bench`: see the module docstring."""
    if getattr(args, "soak", None) or getattr(args, "sessions", None):
        return _bench_load(args)
    cases: dict[str, Any] = {k: int(getattr(args, k, 0) or 0) for k in ("facts", "pauses", "memory")}
    voice = str(getattr(args, "voice", None) or "hibari")
    seed = int(getattr(args, "seed", 0) or 0)
    transports = _transports(getattr(args, "transport", None))
    if transports is None:
        print(
            "duplex bench: --transport takes 'all' or a comma list of native, twilio, audiosocket, realtime",
            file=sys.stderr,
        )
        return 2
    for kind in ("tts", "asr"):
        if getattr(args, f"compare_{kind}", None) and not args.serve:
            print(
                f"duplex bench: --compare-{kind} needs --serve (it swaps the {kind} stage of the service it loads)",
                file=sys.stderr,
            )
            return 2
    counts = [args.turns, args.barge_ins, *cases.values()]
    cases["cut_audio"] = str(getattr(args, "pause_audio", None) or "whole")
    if not transports and (min(counts) < 0 or sum(counts) == 0):
        print(
            "duplex bench: --turns, --barge-ins, --facts, --pauses and --memory must be >= 0 and not all 0",
            file=sys.stderr,
        )
        return 2
    options: dict[str, Any] = {}
    if getattr(args, "session", None):
        try:
            options = json.loads(args.session)
        except ValueError as exc:
            print(
                f"duplex bench: --session is not JSON ({exc}); e.g. --session '{{\"relay\": true}}'",
                file=sys.stderr,
            )
            return 2
        if not isinstance(options, dict):
            print("duplex bench: --session must be a JSON object of session options", file=sys.stderr)
            return 2
    tones = bool(getattr(args, "tones", False))
    if tones and not (args.serve and transports):
        print(
            "duplex bench: --tones needs --serve and --transport (it measures the adapters alone)",
            file=sys.stderr,
        )
        return 2
    url = args.url
    audiosocket = None
    if getattr(args, "audiosocket", None):
        from duplex.transports.gateway import parse_host_port

        try:
            audiosocket = parse_host_port(args.audiosocket)
        except ValueError as exc:
            print(f"duplex bench: --audiosocket: {exc}", file=sys.stderr)
            return 2
    synth = None  # hibari: run_bench loads it once the server answers
    if voice != "hibari" and not tones:
        try:  # before loading the service: a missing voice engine fails in a second, not minutes
            synth = make_synth(voice, seed)
        except BenchError as exc:
            print(f"duplex bench: {exc}", file=sys.stderr)
            return 2
    server: InProcessServer | None = None
    service: Any = None
    if args.serve:
        started = _serve_in_process(args, tones)
        if isinstance(started, int):
            return started
        server, service, url = started
        audiosocket = audiosocket or server.audiosocket
    try:
        if transports:
            return _bench_transports(url, transports, audiosocket, args, tones, synth)
        if getattr(args, "compare_relay", False):
            return _compare_sessions(
                url, args, synth, options, seed, voice, cases, "compare-relay", RELAY_VARIANTS
            )
        if getattr(args, "compare_early", False):
            return _compare_sessions(
                url, args, synth, options, seed, voice, cases, "compare-early", EARLY_VARIANTS
            )
        if getattr(args, "compare_acoustic_hold", False):
            return _compare_sessions(
                url, args, synth, options, seed, voice, cases, "compare-acoustic-hold", ACOUSTIC_HOLD_VARIANTS
            )
        if getattr(args, "compare_speech_end", False):
            return _compare_sessions(
                url, args, synth, options, seed, voice, cases, "compare-speech-end", SPEECH_END_VARIANTS
            )
        for kind in ("tts", "asr"):
            if getattr(args, f"compare_{kind}", None):
                return _compare_stage(kind, url, service, args, synth, options, seed, voice, cases)
        result = asyncio.run(
            run_bench(
                url,
                args.turns,
                args.barge_ins,
                synth,
                out_dir=args.out,
                session_options=options,
                seed=seed,
                voice=voice,
                **cases,
            )
        )
    except (BenchError, KeyboardInterrupt) as exc:
        return _failed(exc)
    finally:
        _stop_serving(server, service)
    print()
    print(format_table(result))
    print(f"\nwrote {Path(args.out) / 'bench.json'} and {Path(args.out) / 'bench.png'}")
    s = result["summary"]
    return 1 if (s["turns_failed"] or s["barge_ins_failed"] or s["leaked_frames_total"]) else 0


def _transports(value: str | None) -> list[str] | None:
    """--transport: None/'' -> [] (the classic bench); 'all' or a comma list; None when invalid."""
    from duplex.bench.transport import TRANSPORTS

    if not value:
        return []
    names = list(TRANSPORTS) if value == "all" else [v.strip() for v in value.split(",") if v.strip()]
    if not names or any(n not in TRANSPORTS for n in names):
        return None
    if len(names) > 1 and "native" not in names:
        names.insert(0, "native")  # the baseline the adapters are compared with
    return list(dict.fromkeys(names))


def _bench_transports(
    url: str,
    transports: list[str],
    audiosocket: tuple[str, int] | None,
    args: argparse.Namespace,
    tones: bool,
    synth: Any,
) -> int:
    from duplex.bench.transport import (
        format_transport_table,
        plot_transport_results,
        run_transport_bench,
        synthesise_prompts,
        write_transport_outputs,
    )

    base = url.split("/v1/", 1)[0]
    prompts = list(QUESTIONS[: max(1, args.turns)])
    if tones:
        from duplex.testing.fakes import tone_speech

        prompts = ["what is the capital of france", "what is two plus two", "hello how are you"]
        speech = {p: tone_speech(p) for p in prompts}
    else:
        print(f"synthesising the prompts ({getattr(args, 'voice', 'hibari')} voice) ...", flush=True)
        speech = synthesise_prompts(prompts, synth or make_synth("hibari"))
    rounds = max(1, args.rounds)
    result = asyncio.run(
        run_transport_bench(base, transports, prompts, speech, audiosocket=audiosocket, rounds=rounds)
    )
    result["settings"] = {
        "url": url,
        "transports": transports,
        "prompts": prompts,
        "rounds": rounds,
        "tones": tones,
        "audiosocket": audiosocket,
        "started_at": time.time(),
    }
    path = write_transport_outputs(result, args.out)
    png = plot_transport_results(result, Path(args.out) / "bench-transport.png")
    print()
    print(format_transport_table(result))
    print(f"\nwrote {path} and {png}")
    return 1 if any(row["failed"] for row in result["transports"].values()) else 0


def _serve_in_process(
    args: argparse.Namespace, tones: bool, limits: Any = None
) -> tuple[InProcessServer, Any, str] | int:
    """--serve: load the service (or the tone stages) and serve it from a thread of this process;
    (server, service, url), or the exit status when it cannot start."""
    from duplex.base.config import ConfigError, load_profile
    from duplex.base.limits import load_limits
    from duplex.runtime.service import DuplexService, ServiceLimits

    try:
        if limits is None:
            # how models.yaml shapes the runtime (as `duplex serve` has it); the session limits stay the defaults
            base = load_limits()
            limits = ServiceLimits(
                bulk_workers=base.bulk_workers,
                llm_process=base.llm_process,
                engine_lane=base.engine_lane,
                llm_gather_ms=base.llm_gather_ms,
                heap_trim_s=base.heap_trim_s,
            )
        if tones:
            from duplex.testing.fakes import fake_stages, scripted_answer

            print("duplex bench: tone stages in this process (--tones): the adapters' own cost, no models")
            service = DuplexService(load_profile(args.profile), fake_stages(scripted_answer), limits=limits)
        else:
            print("duplex bench: loading the service in this process (--serve) ...", flush=True)
            service = DuplexService.load(args.profile, limits=limits)
    except (ConfigError, RuntimeError, ValueError) as exc:
        print(f"duplex bench: cannot load models: {exc}", file=sys.stderr)
        print("hint: `duplex models` shows what is missing and how to fix it", file=sys.stderr)
        return 2
    server = InProcessServer(service)
    try:
        url = server.start()
    except BenchError as exc:
        print(f"duplex bench: {exc}", file=sys.stderr)
        service.close()
        return 2
    print(f"duplex bench: serving on {url} (in-process; for clean timings run `duplex serve` separately)")
    return server, service, url


def tone_prompt(text: str) -> Any:
    """--tones: a prompt's in-vocabulary words as tone speech (the tone ASR hears them back)."""
    import re

    from duplex.testing.fakes import VOCAB, tone_speech

    words = [w for w in re.findall(r"[a-z]+", text.lower()) if w in VOCAB]
    return tone_speech(" ".join(words) or "hello")


def _bench_load(args: argparse.Namespace) -> int:
    """`duplex bench --sessions 1,2,4` (a level per N) or `--soak DURATION --sessions N`."""
    from duplex.bench.load import parse_duration, parse_sessions, run_load, run_soak
    from duplex.bench.load_report import format_load_table, format_soak_table

    try:
        counts = parse_sessions(args.sessions or "1")
        soak_s = parse_duration(args.soak) if getattr(args, "soak", None) else None
    except BenchError as exc:
        print(f"duplex bench: {exc}", file=sys.stderr)
        return 2
    if soak_s is not None and len(counts) != 1:
        print("duplex bench: --soak takes one session count (--sessions N)", file=sys.stderr)
        return 2
    if getattr(args, "transport", None):
        print("duplex bench: --sessions/--soak and --transport do not combine", file=sys.stderr)
        return 2
    if args.turns < 0 or args.barge_ins < 0 or args.turns + args.barge_ins == 0:
        print("duplex bench: --turns and --barge-ins must be >= 0 and not both 0", file=sys.stderr)
        return 2
    if any(int(getattr(args, k, 0) or 0) for k in ("facts", "pauses", "memory")):
        print("duplex bench: the load bench asks --turns and --barge-ins only (no --facts/--pauses/--memory)")
    options: dict[str, Any] = {}
    if getattr(args, "session", None):
        try:
            options = dict(json.loads(args.session))
        except (ValueError, TypeError) as exc:
            print(
                f"duplex bench: --session must be a JSON object of session options ({exc})", file=sys.stderr
            )
            return 2
    tones = bool(getattr(args, "tones", False))
    if tones and not args.serve:
        print("duplex bench: --tones needs --serve", file=sys.stderr)
        return 2
    voice = str(getattr(args, "voice", None) or "hibari")
    synth: Any = tone_prompt if tones else None
    if voice != "hibari" and not tones:
        try:
            synth = make_synth(voice, int(getattr(args, "seed", 0) or 0))
        except BenchError as exc:
            print(f"duplex bench: {exc}", file=sys.stderr)
            return 2
    url = args.url
    server: InProcessServer | None = None
    service: Any = None
    if args.serve:
        from duplex.base.config import ConfigError
        from duplex.base.limits import load_limits
        from duplex.runtime.service import ServiceLimits

        try:
            # models.yaml's limits, as `duplex serve` has them (a 503 past max_sessions is a result),
            # but every caller comes from this one address: the per-address limit would refuse them
            base = load_limits()
            overrides: dict[str, Any] = {
                "max_connections_per_client": max(base.max_connections_per_client, max(counts) + 1)
            }
            if base.max_sessions_auto:  # measuring the capacity: `auto` must not cap it
                overrides["max_sessions"] = max(counts)
            limits = ServiceLimits(**vars(base)).with_overrides(overrides)
        except ConfigError as exc:
            print(f"duplex bench: limits: {exc}", file=sys.stderr)
            return 2
        started = _serve_in_process(args, tones, limits)
        if isinstance(started, int):
            return started
        server, service, url = started
    common: dict[str, Any] = {
        "stagger_s": float(args.stagger),
        "seed": int(getattr(args, "seed", 0) or 0),
        "session_options": options,
    }
    try:
        if soak_s is not None:
            probe = None
            if server is not None:
                in_process = server
                probe = lambda: {"server_tasks": in_process.task_count()}  # noqa: E731
            result = asyncio.run(
                run_soak(
                    url,
                    counts[0],
                    soak_s,
                    args.turns,
                    args.barge_ins,
                    synth,
                    args.out,
                    sample_every_s=float(args.sample_every),
                    server_probe=probe,
                    hangups=int(getattr(args, "hangups", 0) or 0),
                    **common,
                )
            )
            print()
            print(format_soak_table(result))
            print(f"\nwrote {Path(args.out) / 'soak.json'} and {Path(args.out) / 'soak.png'}")
            t = result["totals"]
            return 1 if (t["sessions_failed"] or t["leaked_frames"]) else 0
        result = asyncio.run(run_load(url, counts, args.turns, args.barge_ins, synth, args.out, **common))
    except (BenchError, KeyboardInterrupt) as exc:
        return _failed(exc)
    finally:
        _stop_serving(server, service)
    print()
    print(format_load_table(result))
    print(f"\nwrote {Path(args.out) / 'load.json'} and {Path(args.out) / 'load.png'}")
    if getattr(args, "calibrate", False):
        _calibrate(args, result)
    return 1 if any(lv["errors"] or lv["lost"] or lv["leaked_frames"] for lv in result["levels"]) else 0


def _failed(exc: BaseException) -> int:
    """The exit status (and message) of a bench run that could not finish."""
    if isinstance(exc, KeyboardInterrupt):
        print("duplex bench: interrupted", file=sys.stderr)
        return 130
    print(f"duplex bench: {exc}", file=sys.stderr)
    return 2


def _stop_serving(server: InProcessServer | None, service: Any) -> None:
    """Stop the in-process server (`--serve`) and close its service, if one was started."""
    if server is not None:
        server.stop()
    if service is not None:
        service.close()


def _calibrate(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """--calibrate: store the largest N that kept every target as this device's capacity for the
    profile (`duplex serve --max-sessions auto` reads it; duplex.runtime.capacity)."""
    from duplex.base.config import load_profile
    from duplex.runtime.capacity import capacity_file, record_capacity

    profile = load_profile(args.profile).name
    n = int(result["max_sessions_within_targets"])
    evidence = {
        "targets": result["settings"]["targets"],
        "levels": {
            str(lv["sessions"]): {
                "onset_p90_s": (lv.get("onset_s") or {}).get("p90"),
                "barge_in_p90_s": (lv.get("barge_in_reaction_s") or {}).get("p90"),
                "gaps": (lv.get("gaps") or {}).get("count"),
                "missed": lv.get("targets_missed"),
            }
            for lv in result["levels"]
        },
        "turns": args.turns,
        "barge_ins": args.barge_ins,
    }
    record_capacity(profile, n, evidence)
    print(f"capacity of profile {profile!r} on this device: {n} sessions (recorded in {capacity_file()})")


#: the relay variants `--compare-relay` runs on one server, one after another, with the same plan
RELAY_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("relay-off", {"relay": False}),
    ("relay-exact", {"relay": True, "relay_check": "exact"}),
    ("relay-verifier", {"relay": True, "relay_check": "verifier"}),
    ("relay-grounded", {"relay": True, "relay_check": "grounded"}),
)
#: `--compare-early`: answers prepared from the words heard while the user talks, off and on
EARLY_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("early-off", {"early_answer": False}),
    ("early-on", {"early_answer": True}),
)
#: `--compare-acoustic-hold`: the acoustic end-of-turn cue (asr.end_of_turn) off, its hold alone, then the
#: hold and its voice-confirmed short wait (the default)
ACOUSTIC_HOLD_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("cue-off", {"acoustic_hold_silence_ms": 0, "voice_fast_end": False}),
    ("hold-on", {"acoustic_hold_silence_ms": 1500, "voice_fast_end": False}),
    ("hold+fast", {"acoustic_hold_silence_ms": 1500, "voice_fast_end": True}),
)
#: `--compare-speech-end`: the pause where the VAD's window says, dated back to the voice's end, and that
#: plus the final transcript started at the voice's end (duplex.core.endpointing.speech_end)
SPEECH_END_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("vad-window", {"speech_end_db": 0, "early_final_ms": 0}),
    ("voice-end", {"speech_end_db": 35, "early_final_ms": 0}),
    ("voice-end-early-final", {"speech_end_db": 35, "early_final_ms": 40}),
)


def _compare_sessions(
    url: str,
    args: argparse.Namespace,
    synth: Any,
    options: dict[str, Any],
    seed: int,
    voice: str,
    cases: dict[str, Any],
    title: str,
    variants: tuple[tuple[str, dict[str, Any]], ...],
) -> int:
    """--compare-relay / --compare-early / --compare-acoustic-hold / --compare-speech-end: the same conversation once per variant of the session options, each
    in its own session on the same server; one results folder per variant (OUT/<variant>) and a table of what
    each buys: onset, facts right, wrong facts after a committed draft (of them, with a wrong keyword in the
    draft), pauses taken, memory, drafts kept, early answers, answers with a gap inside."""
    rows: list[tuple[str, dict[str, Any]]] = []
    w = max(16, 2 + max(len(name) for name, _ in variants))
    for name, variant in variants:
        print(f"\n== {name}: {variant}", flush=True)
        result = asyncio.run(
            run_bench(
                url,
                args.turns,
                args.barge_ins,
                synth,
                out_dir=Path(args.out) / name,
                session_options={**options, **variant},
                seed=seed,
                voice=voice,
                **cases,
            )
        )
        print(format_table(result))
        rows.append((name, result["summary"]))
    lines = [
        "",
        f"{'variant':<{w}}{'onset P50':>10}{'P90':>8}{'n':>5}{'facts':>9}{'draft (kw)':>12}"
        f"{'pauses taken':>14}{'memory':>9}{'drafts kept':>13}{'early':>7}{'gaps':>10}",
    ]
    for name, sm in rows:
        on = sm.get("onset_s") or {}
        facts = sm.get("facts") or {}
        pauses = sm.get("pause_takeover") or {}
        memory = sm.get("memory") or {}

        def rate(d: dict[str, Any], key: str = "rate") -> str:
            return "-" if not d or d.get(key) is None else f"{100 * d[key]:.0f} %"

        lines.append(
            f"{name:<{w}}{_ms(on.get('p50')):>10}{_ms(on.get('p90')):>8}{on.get('n', 0):>5}{rate(facts):>9}"
            f"{_from_draft(facts):>12}{rate(pauses):>14}{rate(memory):>9}"
            f"{sm.get('relay_committed', 0)!s:>6}/{sm.get('relay_drafted', 0)!s:<6}"
            f"{sm.get('early_answers', 0)!s:>7}{_gaps(sm.get('answer_gaps')):>10}"
        )
    return _save_comparison(Path(args.out), title, lines, rows)


def _from_draft(facts: dict[str, Any]) -> str:
    """Wrong facts after a committed draft, and (in brackets) of those the ones whose draft itself held a
    wrong keyword: "2 (0)"."""
    if not facts or facts.get("wrong_with_committed_draft") is None:
        return "-"
    return f"{facts['wrong_with_committed_draft']} ({facts.get('wrong_from_draft', 0)})"


def _gaps(g: dict[str, Any] | None) -> str:
    """Answers with a gap inside (a client playing them ran dry) of the answers played: "3/40"."""
    return "-" if not g else f"{g['answers_with_gaps']}/{g['answers']}"


def _compare_stage(
    kind: str,
    url: str,
    service: Any,
    args: argparse.Namespace,
    synth: Any,
    options: dict[str, Any],
    seed: int,
    voice: str,
    cases: dict[str, Any],
) -> int:
    """--compare-tts / --compare-asr PROFILE: the same conversation with the served profile's stage, then with
    PROFILE's (only that stage swapped, the other models shared), each on its own in-process server; one results
    folder per variant (OUT/tts-* or OUT/asr-*) and a table: onset, barge-in reaction, leaked frames, failures."""
    from dataclasses import replace

    from duplex.base.config import ConfigError, load_profile
    from duplex.base.errors import ModelError
    from duplex.base.messages import AsrChunk, TtsInput
    from duplex.runtime.service import DuplexService, load_asr
    from tts.loading import load_tts

    name_of = getattr(args, f"compare_{kind}")
    try:
        other = load_profile(name_of)
        stage = (load_tts if kind == "tts" else load_asr)(other.component(kind))
    except (ConfigError, ModelError) as exc:
        print(f"duplex bench: --compare-{kind} {name_of}: {exc}", file=sys.stderr)
        return 2
    # lazy initialisation, as warm_up does
    if kind == "tts":
        stage.step(stage.init_state(), TtsInput("Warm up, please.", True))
        stages = replace(service.stages, tts=stage)
    else:
        noise = (0.01 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32)
        stage.step(stage.init_state(), AsrChunk(noise, transcribe=True, final=True))
        stages = replace(service.stages, asr=stage, asr_streaming=bool(stage.streaming))
    variants = [
        (f"{kind}-{service.profile.component(kind).backend}", service, None),
        (f"{kind}-{other.component(kind).backend}", DuplexService(other, stages), True),
    ]
    rows: list[tuple[str, dict[str, Any]]] = []
    for name, svc, own in variants:
        print(f"\n== {name} ({svc.profile.name})", flush=True)
        server = InProcessServer(svc) if own else None
        try:
            result = asyncio.run(
                run_bench(
                    server.start() if server else url,
                    args.turns,
                    args.barge_ins,
                    synth,
                    out_dir=Path(args.out) / name,
                    session_options=options,
                    seed=seed,
                    voice=voice,
                    **cases,
                )
            )
        finally:
            if server is not None:
                server.stop()
                svc.close()
        print(format_table(result))
        rows.append((name, result["summary"]))
    lines = [
        "",
        f"{kind:<22}{'onset P50':>10}{'P90':>8}{'n':>5}{'barge-in P50':>14}{'leaked':>8}{'failed':>8}"
        f"{'heard exactly':>15}{'misheard':>10}",
    ]
    for name, sm in rows:
        on, bi = sm.get("onset_s") or {}, sm.get("barge_in_reaction_s") or {}
        h = sm.get("heard") or {}
        failed = sm.get("turns_failed", 0) + sm.get("barge_ins_failed", 0)
        lines.append(
            f"{name:<22}{_ms(on.get('p50')):>10}{_ms(on.get('p90')):>8}{on.get('n', 0):>5}{_ms(bi.get('p50')):>14}"
            f"{sm.get('leaked_frames_total', 0)!s:>8}{failed!s:>8}"
            f"{str(h.get('word_for_word', '-')) + '/' + str(h.get('n', '-')):>15}{len(h.get('misheard', [])):>10}"
        )
    for name, sm in rows:
        for m in (sm.get("heard") or {}).get("misheard", []):
            lines.append(f"  {name}: asked {m['text']!r}, heard {m['transcript']!r}")
    return _save_comparison(Path(args.out), f"compare-{kind}", lines, rows)


def _ms(x: Any) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _save_comparison(out: Path, stem: str, lines: list[str], rows: list[tuple[str, dict[str, Any]]]) -> int:
    """Print a comparison table and write it (OUT/STEM.txt) with each variant's summary (OUT/STEM.json) and a
    plot of them (OUT/STEM.png)."""
    from duplex.bench.report import plot_comparison

    table = "\n".join(lines)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.txt").write_text(table.strip() + "\n")
    (out / f"{stem}.json").write_text(json.dumps({n: sm for n, sm in rows}, indent=1, default=str))
    plot_comparison(rows, out / f"{stem}.png", stem)
    print(f"\nwrote {out / f'{stem}.txt'}, {out / f'{stem}.json'} and {out / f'{stem}.png'}")
    return 0
