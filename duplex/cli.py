"""The `duplex` command: serve, models, bench."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys


def _serve(args: argparse.Namespace) -> int:
    from duplex.config import ConfigError
    from duplex.server import ServerSettings, run_server
    from duplex.service import DuplexService, ServiceLimits

    try:
        service = DuplexService.load(
            args.profile, progress=True, limits=ServiceLimits(max_sessions=args.max_sessions, bulk_workers=args.workers)
        )
    except (ConfigError, RuntimeError, ValueError) as exc:
        print(f"duplex serve: cannot load models: {exc}", file=sys.stderr)
        print("hint: `duplex models` shows what is missing and how to fix it", file=sys.stderr)
        return 2
    settings = ServerSettings(host=args.host, port=args.port, origins=tuple(args.origin) if args.origin else None)
    try:
        asyncio.run(run_server(service, settings))
    except KeyboardInterrupt:
        pass
    finally:
        service.close()
    return 0


def _models(args: argparse.Namespace) -> int:
    from duplex.config import ConfigError, load_profile
    from duplex.models_cmd import check_profile, print_reports

    try:
        profile = load_profile(args.profile)
    except ConfigError as exc:
        print(f"duplex models: {exc}", file=sys.stderr)
        return 2
    ok = print_reports(profile, check_profile(profile, prepare=args.prepare, verify=args.verify))
    return 0 if ok else 1


def _bench(args: argparse.Namespace) -> int:
    from duplex.bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duplex", description="Full-duplex speech-to-speech dialogue service")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the WebSocket service with a model profile")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8765)
    s.add_argument("--profile", default=None, help="profile in models.yaml (default: its default_profile)")
    s.add_argument("--max-sessions", type=int, default=8)
    s.add_argument("--workers", type=int, default=1, help="bulk executor worker threads (ASR/LLM/TTS)")
    s.add_argument("--origin", action="append", help="allowed browser Origin (repeatable); default: any")
    s.set_defaults(func=_serve)

    m = sub.add_parser("models", help="list, verify and prepare the models of a profile")
    m.add_argument("--profile", default=None)
    m.add_argument("--prepare", action="store_true", help="build caches (LLM conversion) with a progress bar")
    m.add_argument("--verify", action="store_true", help="hash the weights against models.yaml")
    m.set_defaults(func=_models)

    b = sub.add_parser("bench", help="stream synthesised turns to a running server; P50/P90/P99 by stage")
    b.add_argument("--url", default="ws://127.0.0.1:8765/v1/duplex")
    b.add_argument("--turns", type=int, default=20, help="question turns to measure")
    b.add_argument("--barge-ins", type=int, default=10, help="barge-in trials to measure")
    b.add_argument("--out", default="bench-out", help="directory for bench.json and bench.png")
    b.add_argument("--serve", action="store_true", help="start a server in this process first")
    b.add_argument("--profile", default=None)
    b.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        logging.getLogger("websockets").setLevel(logging.WARNING)  # one line per HTTP request is noise
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
