"""`duplex bench`: the serve bench (turns and barge-ins through the native protocol, and optionally
factual questions, mid-sentence pauses and multi-turn memory) or, with `--transport`, the same
prompts through every transport adapter."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

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
        "--memory",
        type=int,
        default=0,
        metavar="N",
        help="N two-turn cases ('My name is Anna.' ... 'What is my name?'): does the answer remember",
    )
    b.add_argument("--seed", type=int, default=0, help="seed of the pauses, barge-in waits and fact draw")


def main(args: argparse.Namespace) -> int:
    """`duplex bench`: see the module docstring."""
    cases = {k: int(getattr(args, k, 0) or 0) for k in ("facts", "pauses", "memory")}
    voice = str(getattr(args, "voice", None) or "hibari")
    seed = int(getattr(args, "seed", 0) or 0)
    transports = _transports(getattr(args, "transport", None))
    if transports is None:
        print(
            "duplex bench: --transport takes 'all' or a comma list of native, twilio, audiosocket, realtime",
            file=sys.stderr,
        )
        return 2
    counts = [args.turns, args.barge_ins, *cases.values()]
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
        from duplex.base.config import ConfigError, load_profile
        from duplex.runtime.service import DuplexService

        try:
            if tones:
                from duplex.testing.fakes import fake_stages, scripted_answer

                print(
                    "duplex bench: tone stages in this process (--tones): the adapters' own cost, no models"
                )
                service = DuplexService(load_profile(args.profile), fake_stages(scripted_answer))
            else:
                print("duplex bench: loading the service in this process (--serve) ...", flush=True)
                service = DuplexService.load(args.profile)
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
        audiosocket = audiosocket or server.audiosocket
        print(f"duplex bench: serving on {url} (in-process; for clean timings run `duplex serve` separately)")
    try:
        if transports:
            return _bench_transports(url, transports, audiosocket, args, tones, synth)
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
    except BenchError as exc:
        print(f"duplex bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("duplex bench: interrupted", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()
        if service is not None:
            service.close()
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
