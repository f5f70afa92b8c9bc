"""An acoustic end-of-turn cue: does the voice sound finished where it stopped?

A recogniser that hears "what is the capital of" cut off mid-sentence often writes "What is the
capital?": the text then looks finished and the turn head takes the turn at a pause. How the voice
stopped tells the two apart where the words cannot: a finished sentence falls in pitch and lengthens
its last syllable; a voice that breaks off mid-sentence does neither. This module turns the segment's
audio, up to where the voice stopped, into a small vector of prosodic features, normalised by the
same segment (so a high voice and a low one look alike), and a logistic model gives
P(the turn is complete). Numpy only, on the segment's last 4 s; the weights (a few hundred
floats) ship as JSON, trained by `asr.training.train_end_of_turn`.

Features (`features`):
- the last 200 ms's log-mel, 5 time x 8 band means, minus the segment's mean spectrum;
- pitch in semitones relative to the segment's median, and the share of voiced frames, in 5 bins over
  the last 200 ms; the pitch slope over the last 300 ms of voicing;
- energy relative to the segment's loud frames, in 5 bins; the length of the last voiced stretch
  relative to the segment's median stretch (final lengthening); the segment's length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SR = 16000
HOP = 160  # 10 ms
WIN = 400  # 25 ms
N_MELS = 40
TAIL = 20  # frames (200 ms) the tail features look at (50 and 30 separated held-out turns less well)
CONTEXT_S = 4.0  # the segment's last seconds the features (and their normalisation) read
PITCH_WIN = 640  # 40 ms: two periods of 50 Hz
F0_MIN, F0_MAX = 60.0, 400.0
VOICED = 0.45  # normalised autocorrelation peak above which a frame is voiced

WEIGHTS = Path(__file__).parent / "weights" / "end_of_turn.json"


def _frames(x: np.ndarray, win: int) -> np.ndarray:
    if len(x) < win:
        x = np.pad(x, (0, win - len(x)))
    n = 1 + (len(x) - win) // HOP
    return np.lib.stride_tricks.as_strided(x, (n, win), (x.strides[0] * HOP, x.strides[0]))


_BANKS: dict[int, np.ndarray] = {}


def mel_bank(sr: int = SR) -> np.ndarray:
    """(257, N_MELS) triangular mel filters for a 512-point FFT."""
    if sr in _BANKS:
        return _BANKS[sr]

    def mel(f: np.ndarray) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + f / 700.0)

    edges = 700.0 * (
        10 ** (np.linspace(mel(np.array(60.0)), mel(np.array(sr / 2 - 200)), N_MELS + 2) / 2595.0) - 1
    )
    freqs = np.fft.rfftfreq(512, 1.0 / sr)
    bank = np.zeros((len(freqs), N_MELS), np.float32)
    for m in range(N_MELS):
        lo, mid, hi = edges[m], edges[m + 1], edges[m + 2]
        bank[:, m] = np.clip(np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)), 0, None)
    _BANKS[sr] = bank
    return bank


def log_mel(audio: np.ndarray, sr: int = SR) -> np.ndarray:
    """(frames, N_MELS) log-mel spectrogram, 25 ms windows every 10 ms."""
    frames = _frames(np.ascontiguousarray(audio, np.float32), WIN)
    spec = np.abs(np.fft.rfft(frames * np.hanning(WIN).astype(np.float32), n=512)) ** 2
    out: np.ndarray = np.log(spec @ mel_bank(sr) + 1e-8)
    return out


def pitch(audio: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 10 ms frame: F0 in Hz (0 where unvoiced) and the normalised autocorrelation peak."""
    x = np.ascontiguousarray(audio, np.float32)
    frames = _frames(x, PITCH_WIN)
    frames = frames - frames.mean(axis=1, keepdims=True)
    spec = np.fft.rfft(frames, n=2 * PITCH_WIN)
    ac = np.fft.irfft(np.abs(spec) ** 2, n=2 * PITCH_WIN)[:, :PITCH_WIN]
    lo, hi = int(SR / F0_MAX), int(SR / F0_MIN)
    norm = ac[:, lo:hi] / (ac[:, :1] + 1e-9)
    # the shortest lag within 10 % of the best: a period's multiples correlate almost as well
    best = norm.max(axis=1, keepdims=True)
    lag = (norm >= 0.9 * best).argmax(axis=1)
    peak = norm[np.arange(len(norm)), lag]
    f0 = np.where(peak >= VOICED, SR / (lo + lag), 0.0)
    return f0.astype(np.float32), peak.astype(np.float32)


def trailing_silence_start(energy: np.ndarray, floor_db: float = 35.0, above_noise_db: float = 10.0) -> int:
    """The frame after the last one that is voice (where the voice stopped): within `floor_db` of the
    loudest frame and `above_noise_db` above the segment's noise floor (its 10th-percentile frame), so
    a noisy line's hiss after the last word is not taken for voice. `energy`: natural-log frame energy."""
    nats = np.log(10) / 10
    level = max(energy.max() - floor_db * nats, np.percentile(energy, 10) + above_noise_db * nats)
    loud = np.nonzero(energy > level)[0]
    return int(loud[-1] + 1) if len(loud) else len(energy)


def _bins(x: np.ndarray, n: int = 5) -> list[np.ndarray]:
    return np.array_split(x, n)


def features(audio: np.ndarray) -> np.ndarray:
    """The prosodic feature vector of a segment's audio (16 kHz float), up to where the voice stopped.
    Only the last `CONTEXT_S` seconds are read, so the cost does not grow with the segment."""
    audio = np.asarray(audio, np.float32)[-int(CONTEXT_S * SR) :]
    mel = log_mel(audio)
    energy = np.log(np.exp(mel).sum(axis=1))
    # floors relative to the loudest (~60 dB down), so gain does not move digital silence's share
    energy = np.maximum(energy, energy.max() - 14.0)
    mel = np.maximum(mel, mel.max() - 14.0)
    end = max(trailing_silence_start(energy), 1)
    mel, energy = mel[:end], energy[:end]
    f0, _ = pitch(audio)
    f0 = f0[:end]
    loud = energy > np.percentile(energy, 30)
    tail = slice(max(0, end - TAIL), end)

    # spectrum of the tail, relative to the segment's mean spectrum
    spec = mel - mel[loud].mean(axis=0) if loud.any() else mel - mel.mean(axis=0)
    t = spec[tail]
    if len(t) < TAIL:
        t = np.pad(t, ((TAIL - len(t), 0), (0, 0)), mode="edge")
    spec_feats = t.reshape(5, TAIL // 5, 8, N_MELS // 8).mean(axis=(1, 3)).ravel()

    voiced = f0 > 0
    st = np.zeros_like(f0)
    if voiced.any():
        st[voiced] = 12 * np.log2(f0[voiced] / np.median(f0[voiced]))
    f0_bins, v_bins, e_bins = [], [], []
    e_ref = float(energy[loud].mean()) if loud.any() else float(energy.mean())
    for sb, vb, eb in zip(_bins(st[tail]), _bins(voiced[tail]), _bins(energy[tail]), strict=True):
        f0_bins.append(float(sb[vb].mean()) if vb.any() else 0.0)
        v_bins.append(float(vb.mean()) if len(vb) else 0.0)
        e_bins.append(float(eb.mean()) - e_ref if len(eb) else 0.0)

    # pitch slope over the last 300 ms of voiced frames (semitones per second)
    idx = np.nonzero(voiced)[0]
    slope = 0.0
    if len(idx) >= 5:
        last = idx[idx >= idx[-1] - 30]
        if len(last) >= 5:
            slope = float(np.polyfit(last / 100.0, st[last], 1)[0])
    # voiced stretches: the last one against the segment's median (final lengthening)
    runs = _runs(voiced)
    last_run = runs[-1] if runs else 0
    med_run = float(np.median(runs)) if runs else 1.0
    ratio = np.log((last_run + 1) / (med_run + 1))
    dur = np.log(end / 100.0 + 0.1)
    extra = [np.clip(slope / 10.0, -5, 5), ratio, dur, float(st[voiced].std()) if voiced.any() else 0.0]
    return np.concatenate([spec_feats, f0_bins, v_bins, e_bins, extra]).astype(np.float32)


def _runs(mask: np.ndarray) -> list[int]:
    """Lengths of the runs of True in `mask`, in order."""
    out, n = [], 0
    for v in mask:
        if v:
            n += 1
        elif n:
            out.append(n)
            n = 0
    if n:
        out.append(n)
    return out


N_FEATURES = 5 * 8 + 5 + 5 + 5 + 4


@dataclass
class EndOfTurnModel:
    """A logistic model on standardised `features`: P(the turn is complete)."""

    mean: np.ndarray
    std: np.ndarray
    weight: np.ndarray
    bias: float
    meta: dict

    def p_complete(self, audio: np.ndarray) -> float:
        z = (features(audio) - self.mean) / self.std
        return float(1.0 / (1.0 + np.exp(-(z @ self.weight + self.bias))))

    def to_json(self, path: Path) -> None:
        path.write_text(
            json.dumps(
                {
                    "mean": self.mean.round(6).tolist(),
                    "std": self.std.round(6).tolist(),
                    "weight": self.weight.round(6).tolist(),
                    "bias": round(float(self.bias), 6),
                    "meta": self.meta,
                },
                indent=1,
            )
            + "\n"
        )

    @classmethod
    def load(cls, path: Path = WEIGHTS) -> EndOfTurnModel:
        d = json.loads(Path(path).read_text())
        model = cls(
            np.array(d["mean"], np.float32),
            np.array(d["std"], np.float32),
            np.array(d["weight"], np.float32),
            float(d["bias"]),
            dict(d.get("meta", {})),
        )
        if len(model.mean) != N_FEATURES or len(model.weight) != N_FEATURES:
            raise ValueError(f"{path}: {len(model.weight)} weights, the features have {N_FEATURES}")
        return model
