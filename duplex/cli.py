"""The `duplex` command: serve, talk, say, codec, models, bench, eval."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any


def _serve(args: argparse.Namespace) -> int:
    import os
    import uuid

    from duplex.base.config import ConfigError
    from duplex.base.limits import load_limits
    from duplex.runtime.service import DuplexService, ServiceLimits
    from duplex.transports.gateway import GatewaySettings, exposure_problem, parse_host_port, run_gateway
    from duplex.transports.native import ServerSettings

    audiosocket = None
    uuids: list[uuid.UUID] | None = None
    try:
        if args.audiosocket:
            audiosocket = parse_host_port(args.audiosocket)
        if args.audiosocket_uuid:
            uuids = [uuid.UUID(u) for u in args.audiosocket_uuid]
    except ValueError as exc:
        print(f"duplex serve: --audiosocket: {exc}", file=sys.stderr)
        return 2
    if uuids and audiosocket is None:
        print("duplex serve: --audiosocket-uuid needs --audiosocket HOST:PORT", file=sys.stderr)
        return 2
    keys = list(args.api_key or []) + [
        k.strip() for k in os.environ.get("DUPLEX_API_KEY", "").split(",") if k.strip()
    ]
    settings = GatewaySettings(
        http=ServerSettings(
            host=args.host,
            port=args.port,
            origins=tuple(args.origin) if args.origin else None,
            api_keys=tuple(keys),
        ),
        twilio_auth_token=args.twilio_auth_token or os.environ.get("TWILIO_AUTH_TOKEN") or None,
        public_url=args.public_url,
        audiosocket=audiosocket,
        audiosocket_uuids=uuids,
    )
    problem = exposure_problem(settings, insecure=args.insecure)
    if problem is not None:
        print(f"duplex serve: refusing to start: {problem}", file=sys.stderr)
        return 2
    try:
        base = load_limits()
        limits = ServiceLimits(**vars(base)).with_overrides(
            {
                "bulk_workers": args.workers,
                "llm_process": False if args.llm_in_process else None,
                "engine_lane": True if args.engine_lane else None,
                **{name: getattr(args, name, None) for name in LIMIT_FLAGS},
            }
        )
    except ConfigError as exc:
        print(f"duplex serve: limits: {exc}", file=sys.stderr)
        return 2
    try:
        if args.tones:
            import dataclasses

            from duplex.base.config import load_profile
            from duplex.testing.fakes import fake_stages, scripted_answer

            # the tone stages cost nothing: a capacity measured for the models does not apply
            limits = dataclasses.replace(limits, max_sessions_auto=False)
            service = DuplexService(load_profile(args.profile), fake_stages(scripted_answer), limits=limits)
        else:
            service = DuplexService.load(args.profile, progress=True, limits=limits)
    except (ConfigError, RuntimeError, ValueError) as exc:
        print(f"duplex serve: cannot load models: {exc}", file=sys.stderr)
        print("hint: `duplex models` shows what is missing and how to fix it", file=sys.stderr)
        return 2
    from duplex.runtime.memtrace import install_from_env

    try:
        trace = install_from_env()
    except ValueError as exc:
        print(f"duplex serve: {exc}", file=sys.stderr)
        service.close()
        return 2
    if trace is not None:
        print(f"duplex serve: tracemalloc on; `kill -USR2 {os.getpid()}` appends a report to {trace.out}")
    try:
        asyncio.run(run_gateway(service, settings))
    except KeyboardInterrupt:
        pass
    finally:
        service.close()
    return 0


#: `duplex serve` flags that override models.yaml's `limits:` (docs/operations.md)
LIMIT_FLAGS = {
    "max_sessions": "sessions at once, all transports (HTTP 503 / close 1013); 'auto': this device's "
    "measured capacity (duplex bench --serve --sessions 1,2,4,8 --calibrate)",
    "max_connections_per_client": "connections at once per client address (HTTP 429)",
    "max_session_s": "seconds a session may last (error session_expired, close 1000)",
    "idle_timeout_s": "seconds without a client message before a session is closed (idle_timeout, 1000)",
    "control_per_s": "control messages per second per session (rate_limited; a flood: 1008)",
    "control_burst": "control messages allowed in a burst",
    "max_text_chars": "characters of a typed user turn (text_too_long)",
    "audio_burst_s": "seconds of audio a client may run ahead of real time before it is throttled",
    "audio_close_s": "seconds ahead of real time that close the session (audio_too_fast, 1008)",
    "stage_timeout_s": "seconds a stage job may run before it is abandoned (stage_failed)",
    "max_stage_failures": "failed stage jobs before a session is closed (1011)",
    "drain_timeout_s": "seconds answers in progress may take to finish on SIGTERM",
}


def _models(args: argparse.Namespace) -> int:
    from duplex.base.config import ConfigError, load_profile
    from duplex.runtime.models_cmd import check_profile, print_reports

    try:
        profile = load_profile(args.profile)
    except ConfigError as exc:
        print(f"duplex models: {exc}", file=sys.stderr)
        return 2
    ok = print_reports(profile, check_profile(profile, prepare=args.prepare, verify=args.verify))
    return 0 if ok else 1


def _talk(args: argparse.Namespace) -> int:
    from clients.talk.cli import run

    return run(args)


def _say(args: argparse.Namespace) -> int:
    from duplex.base.config import ConfigError, load_profile
    from duplex.base.errors import ModelError
    from tts.say import SayError, render, write

    try:
        profile = load_profile(args.profile)
        text = " ".join(args.text)
        r = render(profile, text)
        write(args.out, r.audio, r.sample_rate)
    except (ConfigError, ModelError, SayError) as exc:
        print(f"duplex say: {exc}", file=sys.stderr)
        return 2
    backend = profile.component("tts").backend
    print(
        f"wrote {args.out}: {r.seconds:.2f} s at {r.sample_rate} Hz, {r.chunks} chunks ({backend}, profile "
        f"{profile.name}); first audio after {1000 * r.first_chunk_s:.0f} ms, {r.compute_s:.2f} s of compute "
        f"(RTF {r.compute_s / max(r.seconds, 1e-9):.2f})"
    )
    return 0


def _codec(args: argparse.Namespace) -> int:
    from codec.tool import CodecToolError, main

    try:
        for line in main(args.codec_command, args.input, args.out, args.weights):
            print(line)
    except CodecToolError as exc:
        print(f"duplex codec: {exc}", file=sys.stderr)
        return 2
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.asr:
        from duplex.bench.asr import run as bench_asr

        return bench_asr(args)
    from duplex.bench.cli import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duplex", description="Full-duplex speech-to-speech dialogue service")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the WebSocket service with a model profile")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8765)
    s.add_argument("--profile", default=None, help="profile in models.yaml (default: its default_profile)")
    s.add_argument(
        "--workers",
        type=int,
        default=None,
        help="bulk executor worker threads (ASR/LLM/TTS; models.yaml limits.bulk_workers)",
    )
    s.add_argument(
        "--llm-in-process",
        action="store_true",
        help="run the dialogue engine in the server's own process (models.yaml limits.llm_process: false); "
        "by default it has a process of its own, away from the event loop's GIL",
    )
    s.add_argument(
        "--engine-lane",
        action="store_true",
        help="give the engine in its own process an executor lane of its own, so ASR and TTS jobs never wait "
        "behind its steps (models.yaml limits.engine_lane: true); by default they share the bulk workers",
    )
    s.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="API key clients send as 'Authorization: Bearer KEY' (repeatable; also $DUPLEX_API_KEY, "
        "comma-separated); required unless the server listens on loopback only",
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="serve a non-loopback address without an API key (something in front must authenticate)",
    )
    s.add_argument(
        "--origin",
        action="append",
        help="browser Origin allowed besides the page's own (repeatable; '*': any)",
    )
    s.add_argument("--log-format", choices=("text", "json"), default="text", help="json: one object per line")
    s.add_argument("--tones", action="store_true", help="tiny tone stages instead of models (tests, demos)")
    for name, text in LIMIT_FLAGS.items():
        kind: Any = (
            _sessions_arg
            if name == "max_sessions"
            else int
            if name
            in (
                "max_connections_per_client",
                "control_burst",
                "max_text_chars",
                "max_stage_failures",
            )
            else float
        )
        s.add_argument(
            "--" + name.replace("_", "-"), type=kind, default=None, help=text + " (models.yaml limits:)"
        )
    s.add_argument(
        "--twilio-auth-token",
        default=None,
        help="validate X-Twilio-Signature on /v1/twilio (default: $TWILIO_AUTH_TOKEN; unset: not checked)",
    )
    s.add_argument(
        "--public-url",
        default=None,
        help="the wss:// base URL Twilio connects to, when behind a proxy (it is what Twilio signs)",
    )
    s.add_argument(
        "--audiosocket",
        metavar="HOST:PORT",
        default=None,
        help="also accept Asterisk AudioSocket calls on this TCP address (bind it privately)",
    )
    s.add_argument(
        "--audiosocket-uuid",
        action="append",
        metavar="UUID",
        help="accept only AudioSocket calls with this UUID (repeatable); default: any",
    )
    s.set_defaults(func=_serve)

    t = sub.add_parser(
        "talk", help="talk to a server from this terminal: microphone, speaker, live transcript"
    )
    from clients.talk.cli import add_arguments as add_talk_arguments

    add_talk_arguments(t)
    t.set_defaults(func=_talk)

    m = sub.add_parser("models", help="list, verify and prepare the models of a profile")
    m.add_argument("--profile", default=None)
    m.add_argument("--prepare", action="store_true", help="build caches (LLM conversion) with a progress bar")
    m.add_argument("--verify", action="store_true", help="hash the weights against models.yaml")
    m.set_defaults(func=_models)

    y = sub.add_parser("say", help="render text with a profile's voice to a WAV file")
    y.add_argument("text", nargs="+", help="what to say")
    y.add_argument("--out", type=Path, required=True, help="the WAV file to write")
    y.add_argument(
        "--profile", default=None, help="models.yaml profile (cpu: hibari; cpu-flow: the own voice)"
    )
    y.set_defaults(func=_say)

    c = sub.add_parser("codec", help="a WAV file through the FSQ speech codec: encode, decode, round trip")
    csub = c.add_subparsers(dest="codec_command", required=True)
    for name, what, src, out in (
        ("encode", "WAV -> codes (.npz)", "a WAV file (any rate)", "the .npz codes file to write"),
        ("decode", "codes (.npz) -> WAV", "a .npz file from `duplex codec encode`", "the WAV file to write"),
        ("roundtrip", "WAV -> codes -> WAV", "a WAV file (any rate)", "the WAV file to write"),
    ):
        cc = csub.add_parser(name, help=f"{what}; prints the bitrate and the codes used")
        cc.add_argument("input", type=Path, help=src)
        cc.add_argument("--out", type=Path, required=True, help=out)
        cc.add_argument("--weights", type=Path, default=None, help="codec file (default: codec/weights)")
        cc.set_defaults(func=_codec)

    b = sub.add_parser("bench", help="stream synthesised turns to a running server; P50/P90/P99 by stage")
    b.add_argument("--url", default="ws://127.0.0.1:8765/v1/duplex")
    b.add_argument("--turns", type=int, default=20, help="question turns to measure")
    b.add_argument("--barge-ins", type=int, default=10, help="barge-in trials to measure")
    b.add_argument("--out", default="bench-out", help="directory for bench.json and bench.png")
    b.add_argument("--serve", action="store_true", help="start a server in this process first")
    b.add_argument(
        "--session",
        default=None,
        metavar="JSON",
        help="session options for the benchmark session, e.g. '{\"relay\": true}' (docs/protocol.md)",
    )
    b.add_argument("--profile", default=None)
    b.add_argument(
        "--transport",
        default=None,
        metavar="NAMES",
        help="onset through transports instead: 'all' or a comma list of native,twilio,audiosocket,realtime"
        " (same prompts, interleaved; native is always included as the baseline)",
    )
    b.add_argument(
        "--rounds", type=int, default=1, help="with --transport: how many times to ask every prompt"
    )
    b.add_argument(
        "--audiosocket",
        metavar="HOST:PORT",
        default=None,
        help="with --transport audiosocket against a running server: its AudioSocket address",
    )
    b.add_argument(
        "--tones",
        action="store_true",
        help="with --serve --transport: tone stages instead of models, to measure the adapters alone",
    )
    b.add_argument(
        "--asr",
        action="store_true",
        help="benchmark the streaming ASR instead (no server): per-chunk compute per lookahead, RTF, "
        "streams served in real time at --sessions",
    )
    b.add_argument(
        "--model", default=None, help="with --asr: a .nemo file (default: asr/weights/fc_small.nemo)"
    )
    b.add_argument(
        "--sessions",
        default=None,
        metavar="N,N,...",
        help="without --asr: the load bench, N callers at once for each N (e.g. 1,2,4; with --soak one N); "
        "with --asr: concurrent ASR streams (default 1,4,16)",
    )
    b.add_argument(
        "--soak",
        default=None,
        metavar="DURATION",
        help="with --sessions N: N callers in a loop for DURATION (90s, 10m); server RSS, threads, tasks sampled",
    )
    b.add_argument(
        "--stagger", type=float, default=1.5, help="with --sessions: seconds between the callers' starts"
    )
    b.add_argument(
        "--sample-every", type=float, default=30.0, help="with --soak: seconds between the server's samples"
    )
    b.add_argument(
        "--hangups",
        type=int,
        default=0,
        metavar="N",
        help="with --soak: N more callers who ask a question and drop the connection (no close) at the "
        "answer's first audio, again and again",
    )
    b.add_argument(
        "--compare-relay",
        action="store_true",
        help="the same conversation four times on one server: relay off, checked exactly by the slow "
        "model, by the learned verifier, and by the verifier with only the draft's words that restate the "
        "caller's committed (OUT/relay-*/ and OUT/compare-relay.txt)",
    )
    b.add_argument(
        "--compare-early",
        action="store_true",
        help="the same conversation twice on one server: answers prepared from the words heard while the "
        "user talks off, then on (OUT/early-*/ and OUT/compare-early.txt)",
    )
    b.add_argument(
        "--compare-acoustic-hold",
        action="store_true",
        help="the same conversation three times on one server: the acoustic end-of-turn cue off, its hold "
        "alone, its hold and voice-confirmed short wait (OUT/<variant>/ and OUT/compare-acoustic-hold.txt)",
    )
    b.add_argument(
        "--compare-speech-end",
        action="store_true",
        help="the same conversation three times on one server: pauses where the VAD's window says, dated "
        "back to the voice's end, and that plus the final transcript started at the voice's end "
        "(OUT/vad-window/, OUT/voice-end*/ and OUT/compare-speech-end.txt)",
    )
    b.add_argument(
        "--compare-tts",
        default=None,
        metavar="PROFILE",
        help="with --serve: the same conversation spoken by the served profile's voice, then by PROFILE's "
        "(e.g. cpu-flow) on the same models (OUT/tts-*/ and OUT/compare-tts.txt)",
    )
    b.add_argument(
        "--compare-asr",
        default=None,
        metavar="PROFILE",
        help="with --serve: the same conversation heard by the served profile's recogniser, then by PROFILE's "
        "(e.g. cpu-streaming) on the same models (OUT/asr-*/ and OUT/compare-asr.txt)",
    )
    b.add_argument(
        "--calibrate",
        action="store_true",
        help="with --sessions: record the largest N within every target as this device's capacity "
        "for the profile (duplex serve --max-sessions auto reads it)",
    )
    b.add_argument("--seconds", type=float, default=12.0, help="with --asr: speech streamed per session")
    b.add_argument("--threads", type=int, default=0, help="with --asr: torch threads (0 = torch's default)")
    b.add_argument(
        "--budget-ms",
        type=float,
        default=None,
        help="with --asr: also report whether the P90 batch step fits this budget (30 on a GPU)",
    )
    b.add_argument("--cpu", action="store_true", help="with --asr: stay on the CPU even if CUDA is available")
    from duplex.bench.cli import add_case_arguments

    add_case_arguments(b)
    b.set_defaults(func=_bench)

    e = sub.add_parser("eval", help="evaluate a part of the service on held-out data")
    esub = e.add_subparsers(dest="what", required=True)
    ed = esub.add_parser("dialogue", help="turn-taking takeover rates, relay vs slow-only onset and quality")
    from duplex.eval.dialogue import add_arguments as add_eval_dialogue_arguments

    add_eval_dialogue_arguments(ed)
    ed.set_defaults(func=_eval_dialogue)
    ea = esub.add_parser(
        "asr", help="streaming ASR WER per lookahead beside Moonshine, on held-out voices or a folder"
    )
    from duplex.eval.asr import add_arguments as add_eval_asr_arguments

    add_eval_asr_arguments(ea)
    ea.set_defaults(func=_eval_asr)
    et = esub.add_parser(
        "tts", help="the own voice vs hibari: WER (Moonshine), codec ceiling, first-chunk cost, a plot"
    )
    from duplex.eval.tts import add_arguments as add_eval_tts_arguments

    add_eval_tts_arguments(et)
    et.set_defaults(func=_eval_tts)
    ee = esub.add_parser(
        "eot", help="predictive end of turn: wait vs takeover by the turn head's confidence (a curve)"
    )
    from duplex.eval.eot import add_arguments as add_eval_eot_arguments

    add_eval_eot_arguments(ee)
    ee.set_defaults(func=_eval_eot)
    return p


def _sessions_arg(value: str) -> int | str:
    """--max-sessions: a positive integer or 'auto'."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of sessions or 'auto', got {value!r}") from None


def _eval_eot(args: argparse.Namespace) -> int:
    from duplex.eval.eot import run

    return run(args)


def _eval_tts(args: argparse.Namespace) -> int:
    from duplex.eval.tts import run

    return run(args)


def _eval_asr(args: argparse.Namespace) -> int:
    from duplex.eval.asr import run

    return run(args)


def _eval_dialogue(args: argparse.Namespace) -> int:
    from duplex.eval.dialogue import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.INFO
    if args.command == "serve":
        from duplex.runtime.logs import setup_logging

        setup_logging(level, args.log_format)
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("websockets").setLevel(logging.WARNING)  # one line per HTTP request is noise
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
