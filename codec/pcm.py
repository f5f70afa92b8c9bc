"""PCM16 little-endian bytes <-> float32 samples in [-1, 1] (the wire format of most clients)."""

from __future__ import annotations

import numpy as np

_PCM16_LE = np.dtype("<i2")
_SCALE = 32768.0


def pcm16_to_float(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Decode signed 16-bit little-endian PCM to float32 in [-1, 1); raises ValueError on an odd byte count."""
    raw = memoryview(data).cast("B")
    if raw.nbytes % 2:
        raise ValueError(f"PCM16 data must have an even number of bytes, got {raw.nbytes}")
    return np.frombuffer(raw, dtype=_PCM16_LE).astype(np.float32) / np.float32(_SCALE)


def float_to_pcm16(samples: np.ndarray) -> bytes:
    """Encode float samples as signed 16-bit little-endian PCM, clipping instead of wrapping around."""
    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    # NaN/inf from a misbehaving model must not turn into full-scale clicks
    x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    # scale by 32768 and clip to the int16 range so decode(encode(decode(b))) == b exactly
    return bytes(np.clip(np.rint(x * _SCALE), -32768, 32767).astype(_PCM16_LE).tobytes())
