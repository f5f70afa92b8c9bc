"""Wire audio <-> the session core's audio, for every transport: sans-I/O, bytes in, arrays/bytes out.

Transports receive audio in their own encoding and rate (PCM16 at the client's rate, 8 kHz mu-law
from Twilio, 8-192 kHz slin from Asterisk, Realtime's pcm16 / G.711) and the core wants 16 kHz
float32; the core answers with 24 kHz PCM16 frames, which go back out in the wire's format.
"""

from __future__ import annotations

import numpy as np

from codec.g711 import alaw_to_float, float_to_alaw, float_to_ulaw, ulaw_to_float
from codec.pcm import float_to_pcm16, pcm16_to_float
from codec.resample import LowLatencyResampler
from duplex.base.audio import SAMPLE_RATE as SR

#: wire encodings: name -> bytes per sample
ENCODINGS = {"pcm16": 2, "ulaw": 1, "alaw": 1}


class AudioFormatError(ValueError):
    """Wire audio that cannot be decoded (e.g. an odd byte count for PCM16)."""


class AudioIn:
    """Wire audio (`encoding` at `rate`) -> 16 kHz float32 for the session core, as a stream.

    Resampling holds nothing back (`LowLatencyResampler`: ~1-2 ms group delay), so a transport
    adds no buffering latency of its own."""

    def __init__(self, rate: int, encoding: str = "pcm16") -> None:
        if encoding not in ENCODINGS:
            raise AudioFormatError(f"unknown audio encoding {encoding!r}; use one of {sorted(ENCODINGS)}")
        self.rate = rate
        self.encoding = encoding
        self._resampler = None if rate == SR else LowLatencyResampler(rate, SR)
        self._state = self._resampler.init_state() if self._resampler else None

    def decode(self, payload: bytes) -> np.ndarray:
        if self.encoding == "pcm16":
            if len(payload) % 2:
                raise AudioFormatError(f"audio of {len(payload)} bytes: PCM16 needs an even byte count")
            x = pcm16_to_float(payload)
        elif self.encoding == "ulaw":
            x = ulaw_to_float(payload)
        else:
            x = alaw_to_float(payload)
        if self._resampler is not None:
            x, self._state = self._resampler.step(self._state, x)
        return x


class AudioOut:
    """The core's PCM16 frames (at `source_rate`, 24 kHz) -> wire audio (`encoding` at `rate`)."""

    def __init__(self, source_rate: int, rate: int, encoding: str = "pcm16") -> None:
        if encoding not in ENCODINGS:
            raise AudioFormatError(f"unknown audio encoding {encoding!r}; use one of {sorted(ENCODINGS)}")
        self.rate = rate
        self.encoding = encoding
        self.bytes_per_sample = ENCODINGS[encoding]
        self._resampler = None if rate == source_rate else LowLatencyResampler(source_rate, rate)
        self._state = self._resampler.init_state() if self._resampler else None

    def encode(self, pcm16: bytes) -> bytes:
        x = pcm16_to_float(pcm16)
        if self._resampler is not None:
            x, self._state = self._resampler.step(self._state, x)
        if self.encoding == "pcm16":
            return float_to_pcm16(x)
        if self.encoding == "ulaw":
            return float_to_ulaw(x)
        return float_to_alaw(x)

    def reset(self) -> None:
        """Forget the filter history (after a barge-in the next answer starts clean)."""
        if self._resampler is not None:
            self._state = self._resampler.init_state()
