"""espeak-ng speech through ctypes (the library and data ship in the `espeakng-loader` wheel).

Used to synthesise training and held-out speech for the streaming ASR: espeak-ng has a hundred voice
variants (`en-US+m3`, `en-GB-scotland+klatt2`, ...) and runs ~100x faster than real time. The library
keeps global state, so one process owns one `EspeakVoice` and calls it from one thread.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from duplex.base.errors import ModelError

PIP_HINT = "pip install espeakng-loader==0.2.4"
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_RATE, _VOLUME, _PITCH, _RANGE, _WORDGAP = 1, 2, 3, 4, 7
_EVENT_LIST_TERMINATED, _EVENT_WORD, _EVENT_PHONEME = 0, 1, 7
_INITIALIZE_PHONEME_EVENTS = 0x0001


class _Event(ctypes.Structure):
    """espeak_EVENT (speak_lib.h): word events carry the word's character span and audio position."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", ctypes.c_char * 8),
    ]


_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event)
)

_lock = threading.Lock()
_instance: EspeakVoice | None = None


class EspeakVoice:
    """`synthesize(text, voice, rate=..., pitch=...)` -> float32 mono audio at `sample_rate` (22050)."""

    def __init__(self) -> None:
        try:
            import espeakng_loader
        except ImportError:
            raise ModelError(f"synthesising espeak-ng speech needs espeakng-loader: {PIP_HINT}") from None
        lib = ctypes.cdll.LoadLibrary(str(espeakng_loader.get_library_path()))
        data = str(espeakng_loader.get_data_path()).encode()
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, data, _INITIALIZE_PHONEME_EVENTS)
        if rate <= 0:
            raise ModelError(f"espeak-ng failed to initialise (data at {data.decode()})")
        self.sample_rate = rate
        self._lib = lib
        self._chunks: list[np.ndarray] = []
        self._words: list[tuple[int, int, int]] = []
        self._phonemes: list[tuple[str, int]] = []

        def on_audio(wav, n, events):  # noqa: ANN001 - ctypes callback
            if n > 0:
                self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).astype(np.float32) / 32768.0)
            i = 0
            while events and events[i].type != _EVENT_LIST_TERMINATED:
                event = events[i]
                if event.type == _EVENT_WORD:
                    self._words.append((event.text_position, event.length, event.audio_position))
                elif event.type == _EVENT_PHONEME:
                    self._phonemes.append((event.id.decode("ascii", "replace"), event.audio_position))
                i += 1
            return 0

        self._callback = _CALLBACK(on_audio)  # kept referenced: espeak calls it until the process ends
        lib.espeak_SetSynthCallback(self._callback)

    def synthesize(
        self,
        text: str,
        voice: str = "en-US",
        rate: int = 175,
        pitch: int = 50,
        pitch_range: int = 50,
        word_gap: int = 0,
    ) -> np.ndarray:
        """Speak `text` with `voice` (`lang[+variant]`); rate in words per minute, pitch/range 0..100."""
        return self.synthesize_timed(text, voice, rate, pitch, pitch_range, word_gap)[0]

    def synthesize_timed(
        self,
        text: str,
        voice: str = "en-US",
        rate: int = 175,
        pitch: int = 50,
        pitch_range: int = 50,
        word_gap: int = 0,
    ) -> tuple[np.ndarray, list[tuple[int, int, float]], list[tuple[str, float]]]:
        """`synthesize` plus espeak's events, in order: words as (first character index in `text` (0-based),
        length in characters, start time in seconds) and phonemes as (espeak mnemonic, start seconds)."""
        if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"espeak-ng has no voice {voice!r}")
        for param, value in ((_RATE, rate), (_PITCH, pitch), (_RANGE, pitch_range), (_WORDGAP, word_gap)):
            self._lib.espeak_SetParameter(param, int(value), 0)
        self._chunks, self._words, self._phonemes = [], [], []
        raw = text.encode("utf-8") + b"\0"
        err = self._lib.espeak_Synth(raw, len(raw), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        if err != 0:
            raise ModelError(f"espeak-ng failed to synthesise {text[:40]!r} (error {err})")
        out = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
        words = [(pos - 1, length, ms / 1000.0) for pos, length, ms in self._words]
        phonemes = [(name, ms / 1000.0) for name, ms in self._phonemes]
        self._chunks, self._words, self._phonemes = [], [], []
        return out, words, phonemes


def espeak_voice() -> EspeakVoice:
    """The process's espeak-ng (it has global state: one per process)."""
    global _instance
    with _lock:
        if _instance is None:
            _instance = EspeakVoice()
        return _instance


class SynthesisCrash(ModelError):
    """espeak-ng crashed (it segfaults on a few rare voice/pitch/text combinations, e.g. en-GB-scotland+rob
    at pitch 31, range 90 saying "support the"); the isolated synthesiser has restarted."""


def _serve() -> None:
    """The child's loop: pickled (text, voice, rate, pitch, range, word gap) in on stdin, pickled
    ("ok", result) or ("error", exception) out on stdout, one length-prefixed frame each."""
    import pickle
    import struct
    import sys

    voice = EspeakVoice()
    inp, out = sys.stdin.buffer, sys.stdout.buffer

    def send(obj) -> None:  # noqa: ANN001
        data = pickle.dumps(obj)
        out.write(struct.pack("<I", len(data)) + data)
        out.flush()

    send(voice.sample_rate)
    while True:
        head = inp.read(4)
        if len(head) < 4:
            return
        args = pickle.loads(inp.read(struct.unpack("<I", head)[0]))
        try:
            send(("ok", voice.synthesize_timed(*args)))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which re-raises it
            send(("error", exc))


class IsolatedEspeak:
    """espeak-ng in a child process (`python -m asr.training.espeak_voice`), so its rare segfaults cost one
    utterance, not the caller: a crash raises `SynthesisCrash` and the next call starts a fresh child.
    A subprocess rather than multiprocessing, so it also works inside daemonic DataLoader workers."""

    def __init__(self) -> None:
        self._proc = None
        self.sample_rate = 22050
        self._start()

    def _start(self) -> None:
        import os
        import subprocess
        import sys
        from pathlib import Path

        root = str(Path(__file__).resolve().parents[2])
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "asr.training.espeak_voice"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=root,
        )
        self.sample_rate = self._recv()

    def _recv(self):  # noqa: ANN202
        import pickle
        import struct

        head = self._proc.stdout.read(4)
        if len(head) < 4:
            raise EOFError
        return pickle.loads(self._proc.stdout.read(struct.unpack("<I", head)[0]))

    def synthesize_timed(
        self,
        text: str,
        voice: str = "en-US",
        rate: int = 175,
        pitch: int = 50,
        pitch_range: int = 50,
        word_gap: int = 0,
    ):  # noqa: ANN201 - as EspeakVoice's
        import pickle
        import struct

        try:
            data = pickle.dumps((text, voice, rate, pitch, pitch_range, word_gap))
            self._proc.stdin.write(struct.pack("<I", len(data)) + data)
            self._proc.stdin.flush()
            status, value = self._recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            code = self._proc.wait(timeout=5)
            self._start()
            raise SynthesisCrash(
                f"espeak-ng crashed (exit {code}) saying {text[:40]!r} as {voice} "
                f"(rate {rate}, pitch {pitch}, range {pitch_range}); restarted"
            ) from None
        if status == "error":
            raise value
        return value

    def synthesize(
        self,
        text: str,
        voice: str = "en-US",
        rate: int = 175,
        pitch: int = 50,
        pitch_range: int = 50,
        word_gap: int = 0,
    ) -> np.ndarray:
        return self.synthesize_timed(text, voice, rate, pitch, pitch_range, word_gap)[0]

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait(timeout=5)
            self._proc = None


if __name__ == "__main__":
    _serve()
