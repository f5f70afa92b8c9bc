"""`duplex codec encode|decode|roundtrip`: a WAV file through the shipped FSQ speech codec.

encode: any WAV (any rate, channels averaged) -> 24 kHz -> integer codes, saved as .npz with what decoding
needs (levels, groups, frame rate, the codec file's sha256, the sample count); decode: .npz -> WAV; roundtrip:
both. Each reports the bitrate: the nominal one (frame rate x groups x log2(prod(levels))), the codes' entropy
(what an entropy coder would need) and the share of codes used per group."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from codec.resample import SUPPORTED_RATES, resample
from codec.speech_codec import SR, SpeechCodec, fits_codec, latent_sha256, load_codec

DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights" / "speech_codec.safetensors"


class CodecToolError(RuntimeError):
    """A file could not be read, written or matched to the codec."""


@dataclass(frozen=True)
class Report:
    seconds: float
    frames: int
    frame_rate: float
    nominal_bps: float
    entropy_bps: float
    used_share: list[float]

    def lines(self) -> list[str]:
        used = ", ".join(f"{100 * u:.0f} %" for u in self.used_share)
        return [
            f"{self.seconds:.2f} s of audio, {self.frames} code frames at {self.frame_rate:.2f} Hz",
            f"bitrate {self.nominal_bps:.1f} bps nominal, {self.entropy_bps:.1f} bps entropy of these codes",
            f"codes used per group (of {self.frames} frames): {used}",
        ]


def codec_file(path: Path | None) -> Path:
    p = Path(path or DEFAULT_WEIGHTS).expanduser()
    if not p.is_file():
        raise CodecToolError(f"codec weights not found: {p}")
    return p


def read_wav(path: Path) -> np.ndarray:
    """Any file soundfile reads -> mono float32 at the codec's 24 kHz."""
    import soundfile as sf

    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (OSError, RuntimeError, sf.LibsndfileError) as exc:
        raise CodecToolError(f"cannot read {path}: {exc}") from None
    if data.shape[0] == 0:
        raise CodecToolError(f"{path} holds no audio")
    mono = data.mean(axis=1).astype(np.float32)
    if int(rate) == SR:
        return mono
    if int(rate) in SUPPORTED_RATES:
        return resample(mono, int(rate), SR)
    import soxr

    return soxr.resample(mono, int(rate), SR, quality="HQ").astype(np.float32)


def write_wav(path: Path, audio: np.ndarray) -> None:
    import soundfile as sf

    try:
        sf.write(str(path), np.clip(audio, -1.0, 1.0), SR, subtype="PCM_16")
    except (OSError, RuntimeError, ValueError, sf.LibsndfileError) as exc:
        raise CodecToolError(f"cannot write {path}: {exc}") from None


def report(model: SpeechCodec, codes: np.ndarray, samples: int) -> Report:
    cfg = model.cfg
    size = math.prod(cfg.levels)
    used, entropy = [], 0.0
    for g in range(cfg.groups):
        counts = np.bincount(codes[:, g], minlength=size).astype(np.float64)
        used.append(float((counts > 0).sum() / size))
        p = counts[counts > 0] / max(counts.sum(), 1.0)
        entropy += float(-(p * np.log2(p)).sum())
    return Report(
        samples / SR, int(codes.shape[0]), cfg.frame_rate, cfg.bitrate, entropy * cfg.frame_rate, used
    )


@torch.no_grad()
def encode(model: SpeechCodec, audio: np.ndarray) -> np.ndarray:
    """audio (24 kHz) -> codes [N, G] int16; the tail is padded to a whole code frame."""
    hop = model.cfg.samples_per_code
    pad = (-len(audio)) % hop
    x = np.concatenate([audio, np.zeros(pad + hop, np.float32)])  # one more frame: the encoder's lookahead
    codes = model.encode(torch.from_numpy(x)[None])[0]
    return codes[: math.ceil(len(audio) / hop)].numpy().astype(np.int16)


@torch.no_grad()
def decode(model: SpeechCodec, codes: np.ndarray, samples: int | None = None) -> np.ndarray:
    audio = model.decode(torch.from_numpy(codes.astype(np.int64))[None])[0].numpy()
    delay = model.cfg.output_delay  # the decoder's output starts this late (overlap-add + envelope delay)
    audio = audio[delay:]
    return audio[:samples] if samples is not None else audio


def save_codes(path: Path, model: SpeechCodec, weights: Path, codes: np.ndarray, samples: int) -> None:
    cfg = model.cfg
    try:
        np.savez_compressed(
            path,
            codes=codes,
            levels=np.array(cfg.levels),
            groups=np.array(cfg.groups),
            frame_rate=np.array(cfg.frame_rate),
            sample_rate=np.array(SR),
            samples=np.array(samples),
            codec_sha256=np.array(hashlib.sha256(weights.read_bytes()).hexdigest()),
            codec_latent_sha256=np.array(latent_sha256(str(weights))),
        )
    except OSError as exc:
        raise CodecToolError(f"cannot write {path}: {exc}") from None


def load_codes(path: Path, model: SpeechCodec, weights: Path) -> tuple[np.ndarray, int]:
    try:
        z = np.load(path)
        codes, samples, sha = z["codes"], int(z["samples"]), str(z["codec_sha256"])
        latent = str(z["codec_latent_sha256"]) if "codec_latent_sha256" in z.files else None
        levels, groups = tuple(int(v) for v in z["levels"]), int(z["groups"])
    except (OSError, KeyError, ValueError) as exc:
        raise CodecToolError(f"{path} is not a codes file written by `duplex codec encode`: {exc}") from None
    if (levels, groups) != (tuple(model.cfg.levels), model.cfg.groups):
        raise CodecToolError(
            f"{path} was encoded with levels {levels} x {groups} groups; this codec has others"
        )
    if not fits_codec(str(weights), sha, latent):
        raise CodecToolError(
            f"{path} was encoded with codec {sha[:12]}, not {weights}: decode with that codec"
        )
    if codes.ndim != 2 or codes.shape[1] != groups or codes.min() < 0 or codes.max() >= math.prod(levels):
        raise CodecToolError(f"{path}: codes out of range for this codec")
    return codes, samples


def main(cmd: str, src: Path, out: Path, weights: Path | None = None) -> list[str]:
    """Run one command; returns the lines to print."""
    wpath = codec_file(weights)
    model = load_codec(str(wpath))
    if cmd in ("encode", "roundtrip"):
        audio = read_wav(src)
        codes = encode(model, audio)
        if cmd == "encode":
            save_codes(out, model, wpath, codes, len(audio))
            return [f"wrote {out} ({out.stat().st_size} bytes)", *report(model, codes, len(audio)).lines()]
        write_wav(out, decode(model, codes, len(audio)))
        return [f"wrote {out}", *report(model, codes, len(audio)).lines()]
    if cmd == "decode":
        codes, samples = load_codes(src, model, wpath)
        write_wav(out, decode(model, codes, samples))
        return [f"wrote {out}", *report(model, codes, samples).lines()]
    raise CodecToolError(f"unknown command {cmd!r} (encode, decode, roundtrip)")
