"""G.711 mu-law and A-law (ITU-T G.711), vectorised with numpy.

Telephony carries 8 kHz audio as one byte per sample: mu-law (North America, Japan; Twilio's
`audio/x-mulaw`) or A-law (elsewhere). The functions take and return float32 samples in [-1, 1]
so they sit next to `codec.pcm`; the `*_to_pcm16` / `pcm16_to_*` variants work on int16 directly.
The tables follow the reference algorithm (Sun's g711.c, the one Asterisk and Python's `audioop`
use), so encoding is bit-exact with those implementations.
"""

from __future__ import annotations

import numpy as np

_BIAS = 0x84  # 132: mu-law bias (in 16-bit units)
_ULAW_CLIP = 8159  # 14-bit magnitude limit
_ULAW_SEG_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF], dtype=np.int32)
_ALAW_SEG_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF], dtype=np.int32)


def _pcm16_to_ulaw(pcm: np.ndarray) -> np.ndarray:
    x = pcm.astype(np.int32) >> 2  # mu-law works on 14-bit values
    mask = np.where(x < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(x), _ULAW_CLIP) + (_BIAS >> 2)
    seg = np.searchsorted(_ULAW_SEG_ENDS, mag, side="left").astype(np.int32)
    code = (seg << 4) | ((mag >> (seg + 1)) & 0x0F)
    code = np.where(seg >= 8, 0x7F, code)
    return (code ^ mask).astype(np.uint8)


def _ulaw_to_pcm16(codes: np.ndarray) -> np.ndarray:
    u = (~codes.astype(np.int32)) & 0xFF
    t = (((u & 0x0F) << 3) + _BIAS) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, _BIAS - t, t - _BIAS).astype(np.int16)


def _pcm16_to_alaw(pcm: np.ndarray) -> np.ndarray:
    x = pcm.astype(np.int32) >> 3  # A-law works on 13-bit magnitudes
    mask = np.where(x >= 0, 0xD5, 0x55)
    mag = np.where(x >= 0, x, -x - 1)
    seg = np.searchsorted(_ALAW_SEG_ENDS, mag, side="left").astype(np.int32)
    shift = np.where(seg < 2, 1, seg)
    code = (seg << 4) | ((mag >> shift) & 0x0F)
    code = np.where(seg >= 8, 0x7F, code)
    return (code ^ mask).astype(np.uint8)


def _alaw_to_pcm16(codes: np.ndarray) -> np.ndarray:
    a = codes.astype(np.int32) ^ 0x55
    t = (a & 0x0F) << 4
    seg = (a & 0x70) >> 4
    t = np.where(seg == 0, t + 8, np.where(seg == 1, t + 0x108, (t + 0x108) << np.maximum(seg - 1, 0)))
    return np.where(a & 0x80, t, -t).astype(np.int16)


def _as_pcm16(samples: np.ndarray) -> np.ndarray:
    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    return np.clip(np.rint(x * 32768.0), -32768, 32767).astype(np.int16)  # as codec.pcm does


def _bytes(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data.astype(np.uint8, copy=False).reshape(-1)
    return np.frombuffer(bytes(data), dtype=np.uint8)


def pcm16_to_ulaw(pcm: np.ndarray) -> bytes:
    """int16 samples -> mu-law bytes."""
    return _pcm16_to_ulaw(np.asarray(pcm, dtype=np.int16).reshape(-1)).tobytes()


def ulaw_to_pcm16(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """mu-law bytes -> int16 samples."""
    return _ulaw_to_pcm16(_bytes(data))


def pcm16_to_alaw(pcm: np.ndarray) -> bytes:
    """int16 samples -> A-law bytes."""
    return _pcm16_to_alaw(np.asarray(pcm, dtype=np.int16).reshape(-1)).tobytes()


def alaw_to_pcm16(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """A-law bytes -> int16 samples."""
    return _alaw_to_pcm16(_bytes(data))


def float_to_ulaw(samples: np.ndarray) -> bytes:
    """float32 samples in [-1, 1] -> mu-law bytes (one per sample)."""
    return pcm16_to_ulaw(_as_pcm16(samples))


def ulaw_to_float(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """mu-law bytes -> float32 samples in [-1, 1]."""
    return ulaw_to_pcm16(data).astype(np.float32) / 32768.0


def float_to_alaw(samples: np.ndarray) -> bytes:
    """float32 samples in [-1, 1] -> A-law bytes (one per sample)."""
    return pcm16_to_alaw(_as_pcm16(samples))


def alaw_to_float(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """A-law bytes -> float32 samples in [-1, 1]."""
    return alaw_to_pcm16(data).astype(np.float32) / 32768.0
