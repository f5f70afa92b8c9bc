"""The sound card through PortAudio (the `sounddevice` package): importing it, listing and choosing devices."""

from __future__ import annotations

from typing import Any

from clients.talk.errors import TalkError
from codec.resample import SUPPORTED_RATES

PORTAUDIO_MISSING = (
    "PortAudio is not installed (sudo apt install libportaudio2 / brew install portaudio); "
    "use --input-wav/--output-wav to run from files"
)


def import_sounddevice() -> Any:
    """`import sounddevice`, which fails with OSError when the PortAudio library is missing."""
    try:
        import sounddevice
    except OSError:
        raise TalkError(PORTAUDIO_MISSING) from None
    except ImportError:
        raise TalkError(
            "the sounddevice package is missing (pip install sounddevice); "
            "use --input-wav/--output-wav to run from files"
        ) from None
    return sounddevice


def list_devices(sd: Any) -> int:
    """`--list-devices`: PortAudio's table (`>` marks the default input, `<` the default output)."""
    devices = sd.query_devices()
    if not len(devices):
        raise TalkError(
            "PortAudio found no sound devices (no sound card, or no access to it); "
            "use --input-wav/--output-wav to run from files"
        )
    print(devices)
    return 0


def query_device(sd: Any, device: int | str | None, kind: str) -> tuple[Any, str, int]:
    """(device, name, sample rate) of the input or output device, or a TalkError naming it."""
    what = f"{kind} device {device!r}" if device is not None else f"default {kind} device"
    try:
        info = sd.query_devices(device, kind)
    except (ValueError, sd.PortAudioError) as exc:
        raise TalkError(
            f"no {what} ({exc}); see `duplex talk --list-devices` and pick one with "
            f"--{kind}-device, or run from files with --input-wav/--output-wav"
        ) from None
    if int(info.get(f"max_{kind}_channels", 0)) < 1:
        raise TalkError(
            f"the {what} ({info.get('name')}) has no {kind} channels; see `duplex talk --list-devices`"
        )
    rate = int(info.get("default_samplerate") or 48000)
    return device, str(info.get("name", device)), rate if rate in SUPPORTED_RATES else 48000
