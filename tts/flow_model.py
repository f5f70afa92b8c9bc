"""Chunk-aware causal flow-matching acoustic model: phonemes -> the speech codec's latent, chunk by chunk.

    phoneme ids --embedding, conv with `lookahead` phonemes of right context, causal windowed attention-->
      phoneme encodings --duration head--> durations (hibari's 25 ms units)
      --length regulator at 80 Hz (every phoneme keeps >= 2 sub-frames), folded x3--> frame conditions
      at the codec's frame rate (26.7 Hz) and a prior latent mu
      --OT-CFM estimator (causal convs + chunk-masked attention over a FIXED left window), Euler 2/4/8 steps
      from a fixed seeded noise table--> the codec's bounded latent (what `FSQ.quantize` rounds)

Streaming: the estimator attends, for every chunk, to the chunk itself and the `left_chunks` chunks before
it, at the same Euler step. The previous chunks' keys/values and conv inputs at each Euler step are kept
in `FlowState` (preallocated, fixed size), so chunk 50 costs exactly what chunk 2 costs and `step` over any
chunking equals `sample` with the same chunk mask (up to float rounding). The noise of frame f is row
(f + seed) of a fixed table, so a recomputed chunk gets the same noise. Imports only torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

UNIT_SUBFRAMES = 2  # hibari's duration unit (25 ms) in 80 Hz frames


@dataclass(frozen=True)
class FlowConfig:
    """Model dimensions; saved with the weights."""

    n_phonemes: int = 178  # hibari's ids go up to 177
    latent_dim: int = 12  # CodecConfig.latent_dim
    subframes: int = 3  # 80 Hz frames per codec frame (CodecConfig.down)
    enc_dim: int = 128
    enc_layers: int = 3
    enc_heads: int = 2
    enc_window: int = 32  # phonemes of left attention context in the encoder
    lookahead: int = 3  # phonemes the encoder reads ahead (its only non-causal part)
    dim: int = 160
    layers: int = 4
    heads: int = 2
    kernel: int = 3  # causal depthwise conv in each estimator block
    ff_mult: int = 2
    t_dim: int = 64
    chunk: int = 6  # codec frames per streaming chunk (225 ms)
    left_chunks: int = 3  # chunks of left context each chunk attends to
    noise_frames: int = 1024
    noise_seed: int = 20251126
    sigma_min: float = 1e-4

    @staticmethod
    def from_dict(d: dict) -> FlowConfig:
        return FlowConfig(**{f.name: d[f.name] for f in fields(FlowConfig) if f.name in d})

    def to_dict(self) -> dict:
        return asdict(self)


def euler_times(steps: int) -> list[float]:
    """Cosine schedule (CosyVoice): fine steps near the noise end, t_0 = 0 ... t_S = 1."""
    return [1.0 - math.cos(0.5 * math.pi * s / steps) for s in range(steps + 1)]


def chunk_mask(
    n: int, chunk: int | None, left_chunks: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[n, n] bool: frame i may attend frame j. chunk None: full context (bidirectional)."""
    if chunk is None:
        return torch.ones(n, n, dtype=torch.bool, device=device)
    c = torch.arange(n, device=device) // chunk
    d = c[:, None] - c[None, :]
    return (d >= 0) & (d <= left_chunks)


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding: x [B, H, T, dh], pos [B, T] (absolute positions)."""
    half = x.shape[-1] // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=x.device, dtype=torch.float32) / half)
    ang = pos[:, None, :, None].float() * freqs
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t [B] in [0, 1] -> sinusoidal [B, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    ang = 1000.0 * t[:, None].float() * freqs
    return torch.cat([ang.sin(), ang.cos()], -1)


# -- phoneme encoder ------------------------------------------------------------------------------------
class EncoderLayer(nn.Module):
    """Pre-norm causal windowed self-attention + MLP over phonemes."""

    def __init__(self, dim: int, heads: int, ff_mult: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ff1, self.ff2 = nn.Linear(dim, ff_mult * dim), nn.Linear(ff_mult * dim, dim)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(rope(q, pos), rope(k, pos), v, attn_mask=mask)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ff2(F.gelu(self.ff1(self.norm2(x))))


class PhonemeEncoder(nn.Module):
    """Phoneme ids -> encodings; encoding i depends only on phonemes <= i + lookahead."""

    def __init__(self, c: FlowConfig) -> None:
        super().__init__()
        self.c = c
        self.emb = nn.Embedding(c.n_phonemes, c.enc_dim)
        self.left = 2
        self.conv = nn.Conv1d(c.enc_dim, c.enc_dim, self.left + 1 + c.lookahead)
        self.layers = nn.ModuleList(
            EncoderLayer(c.enc_dim, c.enc_heads, c.ff_mult) for _ in range(c.enc_layers)
        )
        self.norm = nn.LayerNorm(c.enc_dim)

    def forward(self, ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, P] (valid [B, P] bool: False on batch padding) -> [B, P, enc_dim]."""
        x = self.emb(ids)
        if valid is not None:  # padding reads as zeros, as the end of an unpadded sequence does
            x = x * valid[..., None]
        h = F.pad(x.transpose(1, 2), (self.left, self.c.lookahead))
        x = x + F.gelu(self.conv(h)).transpose(1, 2)
        p = ids.shape[1]
        i = torch.arange(p, device=ids.device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - self.c.enc_window)
        pos = i[None].expand(ids.shape[0], p)
        for layer in self.layers:
            x = layer(x, pos, mask)
        return self.norm(x)


# -- estimator ------------------------------------------------------------------------------------------
@dataclass
class BlockCache:
    """One estimator block's streaming cache at one Euler step."""

    conv: torch.Tensor  # [B, dim, k-1] last conv inputs
    key: torch.Tensor  # [B, H, W, dh] keys of the last W frames (rotated)
    value: torch.Tensor  # [B, H, W, dh]
    valid: torch.Tensor  # [B, W] bool: slot holds a frame


class EstimatorBlock(nn.Module):
    """adaLN-zero block: causal depthwise conv, chunk-masked attention, MLP; each modulated by t."""

    def __init__(self, c: FlowConfig) -> None:
        super().__init__()
        d = c.dim
        self.heads, self.kernel = c.heads, c.kernel
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.mod = nn.Linear(c.t_dim, 9 * d)
        nn.init.zeros_(self.mod.weight)
        nn.init.zeros_(self.mod.bias)
        self.dw = nn.Conv1d(d, d, c.kernel, groups=d)
        self.pw = nn.Linear(d, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ff1, self.ff2 = nn.Linear(d, c.ff_mult * d), nn.Linear(c.ff_mult * d, d)

    def forward(
        self,
        x: torch.Tensor,
        temb: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor | None,
        cache: BlockCache | None,
    ) -> tuple[torch.Tensor, BlockCache | None]:
        """x [B, T, dim]. Offline: cache None, `mask` [B or 1, 1, T, T]. Streaming: a cache, mask None."""
        b, t, d = x.shape
        m = self.mod(F.silu(temb))[:, None].chunk(9, -1)

        def modulate(h: torch.Tensor, i: int) -> torch.Tensor:
            return self.norm(h) * (1 + m[3 * i + 1]) + m[3 * i]

        # causal depthwise conv (zero history offline, the cached inputs when streaming)
        h = modulate(x, 0).transpose(1, 2)
        hist = cache.conv if cache is not None else h.new_zeros(b, d, self.kernel - 1)
        hc = torch.cat([hist, h], 2)
        x = x + m[2] * self.pw(self.dw(hc).transpose(1, 2))
        # attention
        q, k, v = (
            self.qkv(modulate(x, 1)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )
        q, k = rope(q, pos), rope(k, pos)
        new_cache = None
        if cache is not None:
            w = cache.key.shape[2]
            kk, vv = torch.cat([cache.key, k], 2), torch.cat([cache.value, v], 2)
            valid = torch.cat([cache.valid, cache.valid.new_ones(b, t)], 1)
            a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=valid[:, None, None, :])
            new_cache = BlockCache(
                hc[:, :, hc.shape[2] - (self.kernel - 1) :],
                kk[:, :, kk.shape[2] - w :],
                vv[:, :, vv.shape[2] - w :],
                valid[:, valid.shape[1] - w :],
            )
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + m[5] * self.out(a.transpose(1, 2).reshape(b, t, d))
        x = x + m[8] * self.ff2(F.gelu(self.ff1(modulate(x, 2))))
        return x, new_cache


@dataclass
class FlowState:
    """Per-session streaming state of one utterance (batched along dim 0): the estimator caches of every
    Euler step and block, and where the stream is. Fixed size: it never grows with the utterance."""

    conv: torch.Tensor  # [B, S, L, dim, k-1]
    key: torch.Tensor  # [B, S, L, H, W, dh]
    value: torch.Tensor  # [B, S, L, H, W, dh]
    valid: torch.Tensor  # [B, W] bool
    frame: torch.Tensor  # [B] int64: absolute frame index of the next chunk
    seed: torch.Tensor  # [B] int64: offset into the noise table

    @property
    def steps(self) -> int:
        return int(self.key.shape[1])

    @property
    def window(self) -> int:
        return int(self.key.shape[4])

    @staticmethod
    def stack(states: list[FlowState]) -> FlowState:
        return FlowState(*(torch.cat([getattr(s, f.name) for s in states]) for f in fields(FlowState)))

    def unbind(self) -> list[FlowState]:
        n = self.frame.shape[0]
        return [FlowState(*(getattr(self, f.name)[i : i + 1] for f in fields(FlowState))) for i in range(n)]


@dataclass
class Conditioning:
    """An utterance's frame-level inputs to the flow: conditions [B, N, dim], prior latent mu [B, N, D]
    (normalised units), the durations used (hibari units [B, P]) and the frame count of each item."""

    cond: torch.Tensor
    mu: torch.Tensor
    units: torch.Tensor
    frames: torch.Tensor

    def slice(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cond[:, start:end], self.mu[:, start:end]


class FlowModel(nn.Module):
    """Phoneme encoder + duration head + length regulator + flow estimator. Offline: `condition`,
    `sample`; streaming: `init_state`, `step` (batched over sessions along dim 0)."""

    def __init__(self, cfg: FlowConfig = FlowConfig()) -> None:
        super().__init__()
        self.cfg = c = cfg
        self.encoder = PhonemeEncoder(c)
        self.dur = nn.Sequential(nn.Linear(c.enc_dim, c.enc_dim), nn.GELU(), nn.Linear(c.enc_dim, 1))
        self.sub_pos = nn.Linear(2, c.enc_dim)
        self.fold = nn.Linear(c.subframes * c.enc_dim, c.dim)
        self.cond_norm = nn.LayerNorm(c.dim)
        self.prior = nn.Linear(c.dim, c.latent_dim)
        self.t_mlp = nn.Sequential(nn.Linear(c.t_dim, c.t_dim), nn.SiLU(), nn.Linear(c.t_dim, c.t_dim))
        self.x_in = nn.Linear(2 * c.latent_dim, c.dim)
        self.blocks = nn.ModuleList(EstimatorBlock(c) for _ in range(c.layers))
        self.out_norm = nn.LayerNorm(c.dim, elementwise_affine=False)
        self.out_mod = nn.Linear(c.t_dim, 2 * c.dim)
        self.out = nn.Linear(c.dim, c.latent_dim)
        for layer in (self.out_mod, self.out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        # latent normalisation (fitted on teacher data by the recipe; saved with the weights)
        self.register_buffer("latent_mean", torch.zeros(c.latent_dim))
        self.register_buffer("latent_std", torch.ones(c.latent_dim))
        noise = np.random.default_rng(c.noise_seed).standard_normal((c.noise_frames, c.latent_dim))
        self.register_buffer("noise", torch.from_numpy(noise.astype(np.float32)), persistent=False)

    # -- phonemes -> frame conditions ---------------------------------------------------------------
    def log_durations(self, h: torch.Tensor) -> torch.Tensor:
        """Encodings [B, P, enc_dim] -> predicted log durations (hibari units of 25 ms) [B, P]."""
        return self.dur(h)[..., 0]

    def predict_units(self, h: torch.Tensor, speed: float = 1.0) -> torch.Tensor:
        """Integer durations (>= 1 unit, as hibari's Clip(Round(...))) [B, P]."""
        return torch.clamp(torch.round(torch.exp(self.log_durations(h)) / speed), 1, 40).long()

    def regulate(
        self, h: torch.Tensor, units: torch.Tensor, frames: torch.Tensor | None = None
    ) -> Conditioning:
        """Length regulator at 80 Hz, folded to codec frames. h [B, P, E], units [B, P] (0 on padding);
        frames [B]: force the frame count of each item (training: the target's), else ceil(80 Hz / 3)."""
        c = self.cfg
        sub = units * UNIT_SUBFRAMES
        rows, counts = [], []
        for b in range(h.shape[0]):
            s = sub[b]
            keep = s > 0
            hb, sb = h[b][keep], s[keep]
            total = int(sb.sum())
            n = int(frames[b]) if frames is not None else -(-total // c.subframes)
            x = torch.repeat_interleave(hb, sb, 0)
            j = torch.arange(total, device=h.device) - torch.repeat_interleave(torch.cumsum(sb, 0) - sb, sb)
            d = torch.repeat_interleave(sb, sb).float()
            feats = torch.stack([(j + 0.5) / d, torch.log(d) / 3.0], 1)
            x = x + self.sub_pos(feats)
            need = n * c.subframes
            if need > total:  # pad with the last sub-frame (the trailing pause)
                x = torch.cat([x, x[-1:].expand(need - total, -1)], 0)
            rows.append(x[:need].reshape(n, c.subframes * c.enc_dim))
            counts.append(n)
        width = max(counts)
        x = h.new_zeros(h.shape[0], width, c.subframes * c.enc_dim)
        for b, r in enumerate(rows):
            x[b, : r.shape[0]] = r
        cond = self.cond_norm(self.fold(x))
        return Conditioning(cond, self.prior(cond), units, torch.tensor(counts, device=h.device))

    @torch.no_grad()
    def condition(
        self, ids: torch.Tensor, speed: float = 1.0, units: torch.Tensor | None = None
    ) -> Conditioning:
        """Inference front half for one utterance (or a batch of equal-length ones): ids [B, P] ->
        conditions; `units` overrides the predicted durations (the stage sets the pauses this way)."""
        h = self.encoder(ids)
        if units is None:
            units = self.predict_units(h, speed)
        return self.regulate(h, units)

    # -- estimator ----------------------------------------------------------------------------------
    def _temb(self, t: torch.Tensor) -> torch.Tensor:
        return self.t_mlp(timestep_embedding(t, self.cfg.t_dim))

    def _head(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale = self.out_mod(F.silu(temb))[:, None].chunk(2, -1)
        return self.out(self.out_norm(x) * (1 + scale) + shift)

    def estimate(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        cond: torch.Tensor,
        mu: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Offline velocity: x, mu [B, T, D], t [B], cond [B, T, dim], mask [B or 1, 1, T, T] bool."""
        temb = self._temb(t)
        pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        h = self.x_in(torch.cat([x, mu], -1)) + cond
        for blk in self.blocks:
            h, _ = blk(h, temb, pos, mask, None)
        return self._head(h, temb)

    def noise_for(self, frames: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        """Rows of the fixed noise table for absolute frames [B, n] and per-item seeds [B]."""
        return self.noise[(frames + seed[:, None]) % self.cfg.noise_frames]

    def denormalize(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.latent_std + self.latent_mean

    @torch.no_grad()
    def sample(
        self,
        cond: Conditioning,
        steps: int = 4,
        chunk: int | None = None,
        left_chunks: int | None = None,
        seed: int = 0,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """Offline Euler sampling of the whole utterance under the chunk mask (chunk None: full context).
        Returns the latent in codec units [B, N, D]."""
        b, n, _ = cond.mu.shape
        left = self.cfg.left_chunks if left_chunks is None else left_chunks
        frames = torch.arange(n, device=cond.mu.device)[None].expand(b, -1)
        x = temperature * self.noise_for(frames, torch.full((b,), seed, device=cond.mu.device))
        mask = chunk_mask(n, chunk, left, x.device)[None, None]
        ts = euler_times(steps)
        for s in range(steps):
            v = self.estimate(x, torch.full((b,), ts[s], device=x.device), cond.cond, cond.mu, mask)
            x = x + (ts[s + 1] - ts[s]) * v
        return self.denormalize(x)

    # -- streaming ----------------------------------------------------------------------------------
    def init_state(
        self,
        batch: int = 1,
        steps: int = 4,
        chunk: int | None = None,
        left_chunks: int | None = None,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> FlowState:
        """A fresh utterance: caches sized for a window of left_chunks * chunk frames at every Euler step."""
        c = self.cfg
        w = (c.left_chunks if left_chunks is None else left_chunks) * (c.chunk if chunk is None else chunk)
        dh = c.dim // c.heads
        z = torch.zeros
        return FlowState(
            z(batch, steps, c.layers, c.dim, c.kernel - 1, device=device),
            z(batch, steps, c.layers, c.heads, w, dh, device=device),
            z(batch, steps, c.layers, c.heads, w, dh, device=device),
            torch.zeros(batch, w, dtype=torch.bool, device=device),
            torch.zeros(batch, dtype=torch.long, device=device),
            torch.full((batch,), seed, dtype=torch.long, device=device),
        )

    @torch.no_grad()
    def step(
        self, state: FlowState, cond: torch.Tensor, mu: torch.Tensor, temperature: float = 1.0
    ) -> tuple[torch.Tensor, FlowState]:
        """One chunk (cond [B, n, dim], mu [B, n, D]; n = the state's chunk, or fewer for the last one)
        -> latent in codec units [B, n, D], new state. The input state is not modified."""
        b, n, _ = mu.shape
        frames = state.frame[:, None] + torch.arange(n, device=mu.device)
        x = temperature * self.noise_for(frames, state.seed)
        ts = euler_times(state.steps)
        convs, keys, values = [], [], []
        for s in range(state.steps):
            temb = self._temb(torch.full((b,), ts[s], device=x.device))
            h = self.x_in(torch.cat([x, mu], -1)) + cond
            cs, ks, vs = [], [], []
            for li, blk in enumerate(self.blocks):
                cache = BlockCache(
                    state.conv[:, s, li], state.key[:, s, li], state.value[:, s, li], state.valid
                )
                h, new = blk(h, temb, frames, None, cache)
                cs.append(new.conv)
                ks.append(new.key)
                vs.append(new.value)
            x = x + (ts[s + 1] - ts[s]) * self._head(h, temb)
            convs.append(torch.stack(cs, 1))
            keys.append(torch.stack(ks, 1))
            values.append(torch.stack(vs, 1))
        w = state.window
        valid = torch.cat([state.valid, state.valid.new_ones(b, n)], 1)[:, n:] if w else state.valid
        new = FlowState(
            torch.stack(convs, 1),
            torch.stack(keys, 1),
            torch.stack(values, 1),
            valid[:, valid.shape[1] - w :],
            state.frame + n,
            state.seed,
        )
        return self.denormalize(x), new

    @staticmethod
    def attended_keys(state: FlowState, n: int) -> int:
        """Keys each query of an n-frame chunk attends over (cache slots + the chunk): constant."""
        return state.window + n
