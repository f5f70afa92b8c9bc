"""Acoustic echo cancellation for the desktop client (`duplex talk`): numpy only, streaming.

With loudspeakers the microphone hears the bot. The server takes speech during its answer for a
barge-in, so an unprocessed echo makes the bot interrupt itself. Two processors run on 10 ms blocks
of the near end (the microphone) and the far end (what was played, aligned to the microphone):

1. **Linear echo canceller** (`aec` mode only): a partitioned-block frequency-domain adaptive filter
   (PBFDAF, also known as MDF: overlap-save, FFT size 2N, P partitions of N samples covering
   `tail_ms`) models the loudspeaker -> room -> microphone path and subtracts the predicted echo.
   The update is a per-frequency NLMS, normalised by the far-end power in the filter's memory,
   proportionate (partitions that hold more of the path adapt faster: a room's response decays)
   and constrained (the gradient's wrapped half is zeroed, so the filter stays a linear rather
   than circular convolution). Double talk makes any adaptive filter diverge, so there are two
   (the "two-path" scheme): a background filter adapts on every block; the foreground filter,
   whose output is used, takes the background's coefficients only when the background's error
   has been clearly smaller for a while, and the background is reset from the foreground when it
   has clearly diverged. Near-end speech makes the background's error larger, never smaller, so a
   filter disturbed by double talk is never copied.
2. **Residual echo suppressor** (both modes; alone in `suppress` mode): the linear filter leaves
   echo behind (20-40 dB down once converged, much more while it converges, and at frequencies it
   has not heard yet, e.g. each new pure tone), and a few percent of echo is enough for a VAD. On a
   sqrt-Hann STFT of the canceller's output the residual echo of each frequency bin is predicted as
   `over * gain(f) * far_envelope(f)`: the far-end power held at its peak over the echo tail, times
   a per-bin residual echo gain. The gain starts pessimistic (`initial_echo_db`: echo louder than
   what is played, so nothing that could be echo passes before the echo was measured) and then
   follows a high quantile (90 %) of the observed residual-to-far ratio with sign steps: a burst of
   double talk moves it by at most a few steps, and a bin loud enough to pass the suppressor is
   taken for the user and hardly trains it. Bins where the microphone is louder than the predicted
   echo pass unchanged, which is how a user who talks over the bot gets through (barge-in);
   bins that hold only echo are attenuated by up to `floor_db`. One exception to "loud means the
   user": a user who talks over the bot is heard by the server, which stops the bot within a few
   hundred ms. Sound that keeps passing for longer (`double_talk_ms`) while the far end keeps
   playing is echo after all (the laptop moved, the volume went up), and the gain catches up with
   it at once instead of letting the bot interrupt itself answer after answer.

`suppress` mode is the suppressor alone: far-end-gated ducking per frequency with a barge-in
threshold (`over_db` above the echo level it has measured). It needs no convergence and tolerates
any misalignment within the echo tail, but while the bot talks a user only gets through where they
are louder than the bot's echo: in effect half duplex when both voices share the same frequencies.

The state is explicit (`init_state` / `step`, like the stages of the service) and processing is
block-exact: the same signals fed in any chunking give the same output as one call. Output lags
input by one block (`EchoCanceller.latency` samples), the suppressor's overlap-add.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from duplex.base.stage import SequentialBatchMixin

#: the processing modes; `off` (no processing) is the caller's business
MODES = ("aec", "suppress")

_TINY = 1e-12


def _db_to_log(db: float) -> float:
    """A power ratio in dB as a natural logarithm (the tracker's unit)."""
    return db / 10 * math.log(10)


@dataclass(frozen=True)
class EchoConfig:
    """Tuning of the canceller. The defaults suit 16 kHz speech from loudspeakers near the mic."""

    sample_rate: int = 16000
    block_ms: float = 10.0
    tail_ms: float = 300.0  # echo path the linear filter models: alignment margin + delay + reverberation
    linear: bool = True  # the adaptive filter (off in `suppress` mode)
    residual: bool = True  # the residual echo suppressor
    # linear filter
    mu: float = 0.5  # NLMS step of the background filter (0 < mu < 1: faster vs. less misadjustment)
    regularization: float = 0.05  # NLMS normaliser floor, relative to the mean far-end power per bin
    copy_ratio: float = 0.5  # background error below this times the foreground's: copy it (3 dB)
    reset_ratio: float = 4.0  # background error above this times the foreground's: reset it (6 dB)
    two_path_smoothing: float = 0.7  # per-block smoothing of the two filters' error energies
    # residual suppressor
    initial_echo_db: float = 10.0  # echo assumed (re. far end) before it is measured: pessimistic
    over_db: float = 8.0  # the mic must exceed the predicted echo by this much to pass unchanged
    floor_db: float = -40.0  # attenuation of a bin that holds only echo
    quantile: float = 0.9  # the echo gain follows this quantile of the residual-to-far ratio ...
    tracker_step: float = 0.1  # ... with sign steps of this size (natural log units) per block
    warmup_step: float = 1.0  # larger steps while a bin has few updates: leave the pessimistic start fast
    warmup_blocks: float = 50.0  # the step decays as warmup_step / (1 + updates / warmup_blocks)
    far_floor_db: float = -75.0  # far-end power below this (dBFS, per bin) counts as silence
    double_talk_ms: float = 400.0  # near-end sound passing longer than this while the far end plays is echo

    @property
    def block(self) -> int:
        return int(round(self.sample_rate * self.block_ms / 1000))

    @property
    def partitions(self) -> int:
        return max(1, math.ceil(self.tail_ms / self.block_ms))

    @classmethod
    def for_mode(cls, mode: str, sample_rate: int = 16000, **overrides: float | bool) -> EchoConfig:
        """`aec`: adaptive filter + suppressor; `suppress`: the suppressor alone (ducking)."""
        if mode not in MODES:
            raise ValueError(f"unknown echo mode {mode!r}; use one of {', '.join(MODES)}")
        config = cls(sample_rate=sample_rate)
        if mode == "suppress":
            # without a filter the "residual" is the whole echo, which fluctuates more: a wider margin
            config = replace(config, linear=False, over_db=10.0)
        return replace(config, **overrides)  # type: ignore[arg-type]


@dataclass(frozen=True)
class EchoChunk:
    """One step's input: microphone and far-end samples of equal length, time-aligned.

    `far[i]` is what the loudspeaker played when `near[i]` was captured, or a little earlier: the
    echo must come after its reference and within `tail_ms` of it."""

    near: np.ndarray
    far: np.ndarray


@dataclass
class EchoState:
    """Everything the canceller remembers. `step` updates it in place and returns it
    (`copy.deepcopy` forks a stream)."""

    near_pending: np.ndarray  # samples not yet filling a block
    far_pending: np.ndarray
    far_prev: np.ndarray  # the previous far block: the first half of each FFT frame
    # linear filter
    x_hist: np.ndarray  # (P, N+1) complex: far-end frame spectra, newest first
    x_pow: np.ndarray  # (P, N+1): their powers
    w_fg: np.ndarray  # (P, N+1) complex: foreground filter (its output is used)
    w_bg: np.ndarray  # background filter (adapts on every block)
    err_fg: float  # smoothed block error energies of the two filters
    err_bg: float
    # residual suppressor
    e_prev: np.ndarray  # the previous block of the filter's output: the first half of each STFT frame
    ola: np.ndarray  # overlap-add tail
    far_spec: np.ndarray  # (H, N+1) far-end STFT powers of the last H blocks, a ring
    far_pos: int
    log_gain: np.ndarray  # (N+1,) residual echo gain per bin, natural log
    updates: np.ndarray  # (N+1,) tracker updates per bin so far
    excess: float  # leaky count of blocks in which much passed as near-end sound while the far end played
    # diagnostics
    blocks: int = 0
    copies: int = 0  # background -> foreground
    resets: int = 0  # foreground -> background


class EchoCanceller(SequentialBatchMixin[EchoState, EchoChunk, np.ndarray]):
    """Streaming echo canceller / suppressor; see the module docstring. One instance serves any
    number of streams: the state lives in `EchoState`."""

    kind = "echo"

    def __init__(self, config: EchoConfig | None = None) -> None:
        self.config = c = config or EchoConfig()
        self.n = c.block
        self.p = c.partitions
        self.bins = self.n + 1
        self.latency = self.n  # output sample i is the input sample i - latency, processed
        # sqrt-Hann analysis and synthesis windows: at 50 % overlap their product sums to one
        self._win = np.sqrt(0.5 - 0.5 * np.cos(2 * np.pi * np.arange(2 * self.n) / (2 * self.n)))
        self._over = math.exp(_db_to_log(c.over_db))
        self._floor = 10 ** (c.floor_db / 20)
        # a full-scale sine has a power of about N^2 / 4 in its bin: the silence floor is relative to that
        self._far_floor = self.n**2 / 4 * 10 ** (c.far_floor_db / 10)
        self._pass_margin = _db_to_log(c.over_db)
        self._persist = c.double_talk_ms / c.block_ms
        self._hold = self.p + 2  # the far-end envelope covers the filter's reach plus the overlap-add

    def init_state(self) -> EchoState:
        n, p, k = self.n, self.p, self.bins
        return EchoState(
            near_pending=np.zeros(0),
            far_pending=np.zeros(0),
            far_prev=np.zeros(n),
            x_hist=np.zeros((p, k), np.complex128),
            x_pow=np.zeros((p, k)),
            w_fg=np.zeros((p, k), np.complex128),
            w_bg=np.zeros((p, k), np.complex128),
            err_fg=0.0,
            err_bg=0.0,
            e_prev=np.zeros(n),
            ola=np.zeros(n),
            far_spec=np.zeros((self._hold, k)),
            far_pos=0,
            log_gain=np.full(k, _db_to_log(self.config.initial_echo_db)),
            updates=np.zeros(k),
            excess=0.0,
        )

    def step(self, state: EchoState, chunk: EchoChunk) -> tuple[np.ndarray, EchoState]:
        """Process the whole blocks of `chunk` (a partial block waits for the next call); returns
        the cleaned microphone signal (float32), `latency` samples late, one sample per input sample
        of the completed blocks."""
        near = np.asarray(chunk.near, dtype=np.float64).reshape(-1)
        far = np.asarray(chunk.far, dtype=np.float64).reshape(-1)
        if near.shape != far.shape:
            raise ValueError(f"near and far chunks must have the same length, got {near.size} and {far.size}")
        near = np.concatenate([state.near_pending, near])
        far = np.concatenate([state.far_pending, far])
        n = self.n
        count = near.size // n
        out = np.empty(count * n, np.float32)
        for b in range(count):
            block = slice(b * n, (b + 1) * n)
            out[block] = self._block(state, near[block], far[block])
        state.near_pending = near[count * n :].copy()
        state.far_pending = far[count * n :].copy()
        return out, state

    def process(self, near: np.ndarray, far: np.ndarray) -> np.ndarray:
        """Offline: whole signals in one call, the output aligned with the input (latency removed)."""
        pad = np.zeros(self.latency)
        out, _ = self.step(
            self.init_state(), EchoChunk(np.concatenate([near, pad]), np.concatenate([far, pad]))
        )
        return out[self.latency : self.latency + len(near)]

    # -- one block ---------------------------------------------------------------------------

    def _block(self, s: EchoState, d: np.ndarray, x: np.ndarray) -> np.ndarray:
        e = self._linear(s, d, x) if self.config.linear else d
        if self.config.residual:
            out = self._suppress(s, e, x)
        else:
            out, s.e_prev = s.e_prev, e  # the same latency with the suppressor off
        s.far_prev = x
        s.blocks += 1
        return out

    def _linear(self, s: EchoState, d: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Two-path PBFDAF: the microphone block minus the foreground's echo estimate."""
        n, c = self.n, self.config
        spec = np.fft.rfft(np.concatenate([s.far_prev, x]))
        s.x_hist[1:] = s.x_hist[:-1]
        s.x_hist[0] = spec
        s.x_pow[1:] = s.x_pow[:-1]
        s.x_pow[0] = spec.real**2 + spec.imag**2
        e_fg = d - np.fft.irfft((s.w_fg * s.x_hist).sum(axis=0))[n:]
        e_bg = d - np.fft.irfft((s.w_bg * s.x_hist).sum(axis=0))[n:]
        far_active = float(s.x_pow[0].sum()) > self._far_floor
        if far_active:
            self._adapt(s, e_bg)
        a = c.two_path_smoothing
        s.err_fg = a * s.err_fg + (1 - a) * float(e_fg @ e_fg)
        s.err_bg = a * s.err_bg + (1 - a) * float(e_bg @ e_bg)
        if far_active and s.err_bg < c.copy_ratio * s.err_fg:
            s.w_fg[:] = s.w_bg
            s.err_fg = s.err_bg
            s.copies += 1
            return e_bg
        if s.err_bg > c.reset_ratio * s.err_fg + _TINY:
            s.w_bg[:] = s.w_fg
            s.err_bg = s.err_fg
            s.resets += 1
        return e_fg

    def _adapt(self, s: EchoState, e_bg: np.ndarray) -> None:
        """One constrained, proportionate, per-bin NLMS step of the background filter."""
        n, c = self.n, self.config
        err = np.fft.rfft(np.concatenate([np.zeros(n), e_bg]))
        power = s.x_pow.sum(axis=0)
        # regularised: bins the far end hardly excites (a tone's neighbours) must not take huge steps
        norm = power + c.regularization * float(power.mean()) + self._far_floor / self.bins
        size = np.sqrt((s.w_bg.real**2 + s.w_bg.imag**2).sum(axis=1))
        prop = size + 0.1 * max(float(size.max()), _TINY) + _TINY
        prop *= self.p / prop.sum()
        grad = np.fft.irfft(np.conj(s.x_hist) * (c.mu * err / norm) * prop[:, None], axis=1)
        grad[:, n:] = 0.0  # the constraint: keep each partition's N taps, drop the circular wrap
        s.w_bg += np.fft.rfft(grad, axis=1)

    def _suppress(self, s: EchoState, e: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Per-bin gain on a sqrt-Hann STFT (hop N); returns the previous block, finished."""
        n = self.n
        spec_e = np.fft.rfft(self._win * np.concatenate([s.e_prev, e]))
        spec_x = np.fft.rfft(self._win * np.concatenate([s.far_prev, x]))
        s.far_spec[s.far_pos] = spec_x.real**2 + spec_x.imag**2
        s.far_pos = (s.far_pos + 1) % self._hold
        far_env = s.far_spec.max(axis=0)  # the far end's peak over the echo tail, per bin
        e_pow = spec_e.real**2 + spec_e.imag**2
        active = far_env > max(self._far_floor / self.bins, 1e-4 * float(far_env.max()))
        if active.any():
            self._track(s, np.log((e_pow[active] + _TINY) / far_env[active]), active)
        # a room's response changes every few Hz, so the echo gain varies within a bin: take the
        # largest of each bin's and its neighbours' gains
        g = np.exp(s.log_gain)
        g[1:] = np.maximum(g[1:], g[:-1])  # g[i] = max(g[i-1], g[i], g[i+1]) in two in-place passes
        g[:-1] = np.maximum(g[:-1], np.exp(s.log_gain[1:]))
        echo = self._over * g * far_env
        gain = np.where(active, np.clip(1.0 - echo / (e_pow + _TINY), self._floor, 1.0), 1.0)
        frame = self._win * np.fft.irfft(gain * spec_e)
        out = s.ola + frame[:n]
        s.ola = frame[n:].copy()
        s.e_prev = e
        return out

    def _track(self, s: EchoState, log_ratio: np.ndarray, active: np.ndarray) -> None:
        """Move each active bin's echo gain toward the `quantile` of the residual-to-far ratio.

        Sign steps (a stochastic-approximation quantile estimator) bound how far a burst of double
        talk can drag the estimate up; a bin loud enough to pass the suppressor is taken for the
        user and moves it 20 times less, unless such blocks went on for `double_talk_ms` (see the
        module docstring). Steps start large so that the pessimistic start is left within a second
        or two of far-end activity."""
        c = self.config
        gain = s.log_gain[active]
        seen = s.updates[active]
        step = np.maximum(c.tracker_step, c.warmup_step / (1.0 + seen / c.warmup_blocks))
        passing = log_ratio > gain + self._pass_margin
        up = np.where(passing, step * c.quantile / 20, step * c.quantile)
        gain = gain + np.where(log_ratio > gain, up, -step * (1 - c.quantile))
        # a user talking over the bot is heard by the server, which stops the bot: "user" sound that
        # goes on while the far end keeps playing is echo after all (the path changed: the laptop
        # moved, the volume went up). Catch up with it at once.
        s.excess = s.excess + 1 if passing.mean() > 0.3 else max(s.excess - 0.25, 0.0)
        if s.excess > self._persist:
            gain = np.where(passing, gain + 0.3 * (log_ratio - self._pass_margin - gain), gain)
        s.log_gain[active] = gain
        s.updates[active] = seen + 1


class FarEndBuffer:
    """The far-end (played) signal on the microphone's sample clock, for `EchoChunk.far`.

    The player appends what it actually played; the capture side asks for the reference of mic
    samples [start, start + n) given `lag`, the far-end sample index that was playing when mic
    sample 0 was captured. Unknown samples (not played yet, or forgotten) read as silence."""

    def __init__(self, capacity: int) -> None:
        self._buf = np.zeros(capacity, np.float32)
        self.written = 0  # far-end samples appended so far

    def append(self, samples: np.ndarray) -> None:
        x = np.asarray(samples, np.float32).reshape(-1)[-len(self._buf) :]
        pos = self.written % len(self._buf)
        first = min(len(x), len(self._buf) - pos)
        self._buf[pos : pos + first] = x[:first]
        self._buf[: len(x) - first] = x[first:]
        self.written += len(x)

    def read(self, start: int, n: int) -> np.ndarray:
        """Far-end samples [start, start + n), zeros outside what is held."""
        out = np.zeros(n, np.float32)
        lo, hi = max(start, self.written - len(self._buf), 0), min(start + n, self.written)
        if hi > lo:
            idx = np.arange(lo, hi) % len(self._buf)
            out[lo - start : hi - start] = self._buf[idx]
        return out


def erle_db(before: np.ndarray, after: np.ndarray) -> float:
    """Echo return loss enhancement: the echo's power before processing over what remains, in dB
    (measure it on segments with echo only)."""
    p_in = float(np.mean(np.square(before, dtype=np.float64)))
    p_out = float(np.mean(np.square(after, dtype=np.float64)))
    return 10 * math.log10((p_in + _TINY) / (p_out + _TINY))
