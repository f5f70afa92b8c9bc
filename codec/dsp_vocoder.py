"""A streaming harmonic-plus-noise vocoder in torch: F0 + two log-magnitude envelopes per 12.5 ms
frame -> 24 kHz audio, with explicit per-session state. Imports only torch and numpy.

Adapted from hibari's numpy DSP (hibari/dsp.py, hibari-tts 0.2.1, Apache-2.0: band-limited pulse train
from F0, shaped by a per-bin gain, plus shaped noise, one inverse STFT with n_fft 1200, hop 300, Hann).
Changes, measured through Moonshine before adopting them (docs/codec.md):
  * hibari's harmonic phase rotation (theta) is dropped and its noise branch and free-phase branch
    (ln, Z; lr, phi) are merged into one noise envelope with random phase: intelligibility is unchanged;
  * it is causal: frame k's spectrum is applied to the analysis/synthesis window that *ends* with
    pulse block k, so each step emits exactly 300 samples per input frame, delayed by 3 blocks
    (37.5 ms) of overlap-add, plus the envelope delay below; `flush` drains the rest;
  * the noise is a fixed seeded table of unit phasors indexed by the absolute frame number, so any
    chunking (and batching) of the frames gives the same samples;
  * `env_delay` (frames): frame k's envelopes shape the window that ends with pulse block k + env_delay.
    The pulses reach frame k's F0 at the end of block k, and a window ending there is centred 1.5 blocks
    earlier, so with no delay the envelope runs 2 blocks (25 ms) ahead of the pitch and voicing it belongs
    to (hibari's DSP: half a block). A delay of 2 aligns them: teacher features through this vocoder went
    from 5.48 to 4.24 % Moonshine WER with it, hibari 4.07 % (docs/codec.md). It adds 2 blocks of latency.

    S_k = exp(lh_{k-d}) * STFT_k(pulses(f0)) + exp(nz_{k-d}) * e^{i phi_noise[k mod T]}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch

N_FFT, HOP, SR = 1200, 300, 24000
N_BINS = N_FFT // 2 + 1
OVERLAP = N_FFT - HOP  # 900 samples of history / pending overlap-add
VOICED_HZ = 40.0
F_MAX = 11000.0
NOISE_TABLE_FRAMES = 1024
NOISE_SEED = 20251126
OLA_GAIN = 1.5  # sum of squared periodic Hann windows at hop n_fft/4
SILENT_LOG = -30.0  # log magnitude of the envelopes before the first frame (and of the flush's frames)


@dataclass
class VocoderState:
    """Per-session vocoder state (batched along dim 0)."""

    phase: torch.Tensor  # [B] float64, pulse-train phase in cycles, in [0, 1)
    prev_f0: torch.Tensor  # [B] F0 of the previous frame (Hz; < 40 = unvoiced)
    pulse_hist: torch.Tensor  # [B, 900] last pulse samples (the analysis window's left part)
    ola: torch.Tensor  # [B, 900] pending overlap-add tail
    frame: torch.Tensor  # [B] int64 absolute frame index (noise table position)
    env: torch.Tensor  # [B, env_delay, 2 * 601] the last frames' envelopes (lh | nz), not applied yet

    @staticmethod
    def stack(states: list[VocoderState]) -> VocoderState:
        return VocoderState(*(torch.cat([getattr(s, f.name) for s in states]) for f in fields(VocoderState)))

    def unbind(self) -> list[VocoderState]:
        b = self.phase.shape[0]
        return [
            VocoderState(*(getattr(self, f.name)[i : i + 1] for f in fields(VocoderState))) for i in range(b)
        ]


def output_delay(env_delay: int) -> int:
    """Samples between a frame's features and its audio: the overlap-add plus the envelope delay."""
    return OVERLAP + HOP * env_delay


def _window() -> torch.Tensor:
    n = torch.arange(N_FFT, dtype=torch.float64)
    return (0.5 - 0.5 * torch.cos(2 * math.pi * n / N_FFT)).to(torch.float32)


class HarmonicNoiseVocoder(torch.nn.Module):
    """Stateless module (buffers only); the state travels in `VocoderState`. `env_delay`: frames the
    envelopes wait for the pulses they belong to (module docstring)."""

    def __init__(self, env_delay: int = 0) -> None:
        super().__init__()
        if env_delay < 0:
            raise ValueError(f"env_delay must be >= 0, got {env_delay}")
        self.env_delay = int(env_delay)
        win = _window()
        self.register_buffer("win", win, persistent=False)
        self.register_buffer("win_src", win / (N_FFT / 4), persistent=False)
        u = (torch.arange(HOP, dtype=torch.float32) + 0.5) / HOP
        self.register_buffer("u", u, persistent=False)
        ph = np.random.default_rng(NOISE_SEED).uniform(-np.pi, np.pi, (NOISE_TABLE_FRAMES, N_BINS))
        self.register_buffer("noise_re", torch.from_numpy(np.cos(ph).astype(np.float32)), persistent=False)
        self.register_buffer("noise_im", torch.from_numpy(np.sin(ph).astype(np.float32)), persistent=False)

    def init_state(self, batch: int = 1, device: torch.device | str = "cpu") -> VocoderState:
        z = lambda *s: torch.zeros(*s, device=device)  # noqa: E731
        return VocoderState(
            torch.zeros(batch, dtype=torch.float64, device=device),
            z(batch),
            z(batch, OVERLAP),
            z(batch, OVERLAP),
            torch.zeros(batch, dtype=torch.long, device=device),
            torch.full((batch, self.env_delay, 2 * N_BINS), SILENT_LOG, device=device),
        )

    @property
    def output_delay(self) -> int:
        return output_delay(self.env_delay)

    def pulses(self, f0: torch.Tensor, state: VocoderState) -> tuple[torch.Tensor, torch.Tensor]:
        """f0 [B, n] -> band-limited pulse train [B, n*300] (F0 interpolated from the previous frame's),
        and the new phase."""
        prev = torch.cat([state.prev_f0[:, None], f0[:, :-1]], 1)
        f = prev[..., None] * (1 - self.u) + f0[..., None] * self.u  # [B, n, 300]
        f = f.reshape(f.shape[0], -1)
        voiced = f > VOICED_HZ
        f = f.clamp(min=VOICED_HZ)
        cyc = torch.cumsum(f.double() / SR, 1) + state.phase[:, None]
        new_phase = torch.frac(cyc[:, -1])
        t = (2 * math.pi * torch.frac(cyc)).float()
        h = torch.floor(F_MAX / f) + 0.5
        s = 2 * torch.sin(0.5 * t)
        bad = s.abs() <= 2e-3
        e = torch.where(bad, h, torch.sin(h * t) / torch.where(bad, torch.ones_like(s), s)) - 0.5
        return torch.where(voiced, e, torch.zeros_like(e)), new_phase

    def step(
        self, state: VocoderState, f0: torch.Tensor, lh: torch.Tensor, nz: torch.Tensor
    ) -> tuple[torch.Tensor, VocoderState]:
        """f0 [B, n] (Hz), lh / nz [B, n, 601] log magnitudes -> audio [B, n*300] and the new state."""
        b, n = f0.shape
        if n == 0:
            return f0.new_zeros(b, 0), state
        p, phase = self.pulses(f0, state)
        env = torch.cat([state.env, torch.cat([lh, nz], -1)], 1)  # [B, d + n, 1202]
        lh, nz = env[:, :n, :N_BINS], env[:, :n, N_BINS:]
        x = torch.cat([state.pulse_hist, p], 1)  # [B, 900 + 300n]
        frames = x.unfold(1, N_FFT, HOP) * self.win_src  # [B, n, 1200]
        spec = torch.fft.rfft(frames, dim=-1)
        idx = (state.frame[:, None] + torch.arange(n, device=f0.device)) % NOISE_TABLE_FRAMES
        gain_h = torch.exp(lh.clamp(max=7.0))
        gain_n = torch.exp(nz.clamp(max=7.0))
        re = spec.real * gain_h + self.noise_re[idx] * gain_n
        im = spec.imag * gain_h + self.noise_im[idx] * gain_n
        y = torch.fft.irfft(torch.complex(re, im), n=N_FFT, dim=-1) * self.win  # [B, n, 1200]
        # overlap-add: frame k covers output samples [300k, 300k + 1200) of the padded buffer
        k = N_FFT // HOP
        acc = torch.cat([state.ola, f0.new_zeros(b, HOP * n)], 1)
        blocks = y.reshape(b, n, k, HOP)
        acc = acc.reshape(b, n + k - 1, HOP)
        for j in range(k):
            acc[:, j : j + n] = acc[:, j : j + n] + blocks[:, :, j]
        acc = acc.reshape(b, -1)
        out = acc[:, : HOP * n] / OLA_GAIN
        new = VocoderState(
            phase,
            f0[:, -1].clone(),
            x[:, -OVERLAP:].clone(),
            acc[:, HOP * n :].clone(),
            state.frame + n,
            env[:, n:].clone(),
        )
        return out, new

    def flush(self, state: VocoderState) -> torch.Tensor:
        """The rest of a finished stream: the held envelopes' frames (unvoiced, `env_delay` x 300 samples),
        then the pending overlap-add tail (900 samples)."""
        b, d = state.env.shape[0], self.env_delay
        if d:
            silent = state.env.new_full((b, d, N_BINS), SILENT_LOG)
            out, state = self.step(state, state.env.new_zeros(b, d), silent, silent)
            return torch.cat([out, state.ola / OLA_GAIN], 1)
        return state.ola / OLA_GAIN

    def forward(
        self, f0: torch.Tensor, lh: torch.Tensor, nz: torch.Tensor, flush: bool = True
    ) -> torch.Tensor:
        """Offline synthesis: one step on a fresh state (+ the flushed tail)."""
        state = self.init_state(f0.shape[0], f0.device)
        out, state = self.step(state, f0, lh, nz)
        return torch.cat([out, self.flush(state)], 1) if flush else out
