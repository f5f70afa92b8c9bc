"""`duplex talk`'s options and entry point: live mode, or file mode when --input-wav is given.

Exit codes: 0 done (Ctrl-C in live mode is a normal way to finish), 1 the conversation failed (no
answer came, a timeout, the connection dropped), 2 it could not start (no PortAudio, no device,
server unreachable or refusing, a bad argument), 130 a file run interrupted by Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from typing import Any

from clients.talk.devices import import_sounddevice, list_devices
from clients.talk.errors import TalkError
from clients.talk.file_mode import FileTalk
from clients.talk.live import ECHO_MODES, LiveTalk
from clients.talk.wav import load_wav, write_wav
from clients.talk.wire import DEFAULT_SERVER


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `duplex talk` (duplex/cli.py adds them to its `talk` command)."""
    p.add_argument(
        "--server",
        default=DEFAULT_SERVER,
        metavar="URL",
        help=f"native protocol URL (default {DEFAULT_SERVER})",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="session option for session.start, e.g. end_of_turn_silence_ms=700 (repeatable)",
    )
    live = p.add_argument_group("live mode (microphone and speaker)")
    live.add_argument(
        "--input-device", metavar="ID", help="microphone: index or part of the name (see --list-devices)"
    )
    live.add_argument("--output-device", metavar="ID", help="speaker: index or part of the name")
    live.add_argument("--list-devices", action="store_true", help="list the sound devices and exit")
    live.add_argument(
        "--echo",
        choices=ECHO_MODES,
        default="aec",
        help="aec: echo canceller + suppressor (default); suppress: duck the mic while the bot "
        "talks; off: no processing (headphones)",
    )
    live.add_argument(
        "--headphones", action="store_true", help="the speaker cannot reach the mic: same as --echo off"
    )
    files = p.add_argument_group("file mode (no sound card)")
    files.add_argument(
        "--input-wav", metavar="PATH", help="stream this wav (any rate and channels) instead of the mic"
    )
    files.add_argument("--output-wav", metavar="PATH", help="write what a listener would have heard")
    files.add_argument(
        "--output-rate",
        type=int,
        default=None,
        metavar="HZ",
        help="rate of --output-wav (default: the server's, 24000)",
    )
    files.add_argument(
        "--speed", type=float, default=1.0, help="stream the file this many times faster than real time"
    )
    files.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="give up after this long (default: file length + 30 s)",
    )


def run(args: argparse.Namespace) -> int:
    """`duplex talk`: live mode, or file mode when --input-wav is given. Returns the exit code."""
    try:
        options = parse_options(args.option)
        if args.list_devices:
            return list_devices(import_sounddevice())
        if args.input_wav or args.output_wav:
            return _run_files(args, options)
        echo = "off" if args.headphones else args.echo
        sd = import_sounddevice()
        talk = LiveTalk(
            sd,
            url=args.server,
            options=options,
            echo=echo,
            input_device=device_arg(args.input_device),
            output_device=device_arg(args.output_device),
        )
        return asyncio.run(_until_ctrl_c(talk))
    except TalkError as exc:
        print(f"duplex talk: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:  # where no signal handler could be installed (Windows)
        print(file=sys.stderr)
        return 0


def _run_files(args: argparse.Namespace, options: dict[str, Any]) -> int:
    if not args.input_wav:
        raise TalkError("--output-wav needs --input-wav (file mode reads the user's side from a wav)")
    if not args.speed > 0:
        raise TalkError(f"--speed must be > 0, got {args.speed}")
    if args.timeout is not None and not args.timeout > 0:
        raise TalkError(f"--timeout must be > 0, got {args.timeout}")
    if args.output_rate is not None and not 1000 <= args.output_rate <= 384000:
        raise TalkError(f"--output-rate must be a sample rate in Hz, got {args.output_rate}")
    audio = load_wav(args.input_wav)
    talk = FileTalk(
        audio, url=args.server, options=options, speed=args.speed, timeout=args.timeout, name=args.input_wav
    )
    try:
        result = asyncio.run(_until_ctrl_c(talk))
    except KeyboardInterrupt:  # where no signal handler could be installed (Windows)
        return 130
    if args.output_wav:
        rate = write_wav(args.output_wav, result.audio, result.rate, args.output_rate)
        print(f"wrote {args.output_wav} ({len(result.audio) / result.rate:.1f} s at {rate} Hz)")
    if result.error:
        print(f"duplex talk: {result.error}", file=sys.stderr)
    return result.exit_code


async def _until_ctrl_c(talk: Any) -> Any:
    """Run `talk` with Ctrl-C (SIGINT) asking it to stop cleanly instead of raising mid-send."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, talk.stop)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
        return await talk.run()
    try:
        return await talk.run()
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def parse_options(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings -> session.start options; values are JSON when they parse (700, 0.6, true)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise TalkError(f"--option wants KEY=VALUE, got {item!r}")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def device_arg(value: str | None) -> int | str | None:
    """A device given on the command line: an index when it is a number, else part of a name."""
    if value is None:
        return None
    return int(value) if value.strip().isdigit() else value
