"""Moonshine base-en's encoder as a cache-aware streaming encoder (torch), from the packaged model's weights.

Moonshine's encoder (20 M parameters: a conv stem on raw 16 kHz audio, 8 transformer layers of 416 dims, one frame
per 24 ms) was trained with full attention over the whole utterance. Here the same weights run chunk by chunk:

- the conv stem is causal as it is (valid convolutions: a frame reads samples up to ~56 ms past its start); its
  one-group GroupNorm, which normalises over the whole utterance, becomes a *running* normalisation over the frames
  so far (optionally seeded with a prior, so the first frames are not normalised by silence alone);
- attention is chunk-aware (as NeMo's cache-aware FastConformer): a frame attends to every frame of its own chunk
  and to `left_frames` before the chunk, never to a later chunk, so a chunk's output is final when the chunk ends
  (lookahead = the chunk) and each layer's keys and values of the frames before are all a new chunk needs.

`forward(audio, chunk_frames, left_frames)` runs a whole utterance offline under the chunk mask; `init_state` /
`step` run it in pieces with explicit state and give the same frames (tested). `causal_norm=False, chunk_frames=None`
is Moonshine's own encoder (tested against the packaged onnxruntime graph).

The weights are read from moonshine-cpp's `encoder_model.ort` (int8 weights with per-tensor scale and offset,
dequantised here to float32), so nothing is downloaded and nothing large is copied into the repository.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

DIM = 416
HEADS = 8
HEAD_DIM = DIM // HEADS  # 52
ROTARY_DIM = 32
LAYERS = 8
FF_DIM = 1664
EPS = 1e-5
#: the conv stem: (kernel, stride) of conv1 (1 -> 416), conv2 (416 -> 832), conv3 (832 -> 416)
STEM = ((127, 64), (7, 3), (3, 2))
HOP = 64 * 3 * 2  # samples per encoder frame (24 ms)
SAMPLE_RATE = 16000


def frames_for(n_samples: int) -> int:
    """Encoder frames of `n_samples` of audio (valid convolutions)."""
    n = n_samples
    for k, s in STEM:
        n = (n - k) // s + 1 if n >= k else 0
    return max(n, 0)


def _layer_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, None, EPS)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rotation: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(DIM))
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(DIM))
        self.fc1 = nn.Linear(DIM, FF_DIM)
        self.fc2 = nn.Linear(FF_DIM, DIM)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        h = _layer_norm(x, self.input_layernorm)
        q, k, v = (
            p(h).view(b, t, HEADS, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )

        def rot(z: torch.Tensor) -> torch.Tensor:
            r, rest = z[..., :ROTARY_DIM], z[..., ROTARY_DIM:]
            return torch.cat((r * cos + _rotate(r) * sin, rest), -1)

        return rot(q), rot(k), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, DIM))
        return x + self.fc2(F.gelu(self.fc1(_layer_norm(x, self.post_attention_layernorm))))


@dataclass
class StreamState:
    """One utterance in progress. Sample and frame buffers hold only what the next outputs still read."""

    samples: torch.Tensor  # [B, n] not yet consumed by conv1
    c1: torch.Tensor  # [B, 416, n] normalised conv1 frames not yet consumed by conv2
    c2: torch.Tensor  # [B, 832, n] conv2 frames not yet consumed by conv3
    pending: torch.Tensor  # [B, n, 416] stem frames waiting for a full chunk
    norm_sum: torch.Tensor  # [B] running sums of the conv1 output (after tanh) for the running GroupNorm
    norm_sq: torch.Tensor  # [B]
    norm_count: torch.Tensor  # [B] values summed (frames x channels), prior included
    keys: list[torch.Tensor]  # per layer [B, heads, <= left_frames, head_dim] (rotated)
    values: list[torch.Tensor]
    frame: int  # absolute index of the next frame the layers will see
    s_pos: int  # absolute sample index of samples[:, 0]
    n1: int  # conv1 frames made so far
    n2: int
    n3: int


class MoonshineStreamingEncoder(nn.Module):
    """Moonshine base-en's encoder with a chunk-aware attention mask and a running GroupNorm (module doc)."""

    def __init__(
        self,
        chunk_frames: int | None = 20,
        left_frames: int = 250,
        causal_norm: bool = True,
        norm_prior: tuple[float, float, float] = (0.0, 1.0, 0.0),
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, DIM, 127, 64, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(DIM))
        self.norm_bias = nn.Parameter(torch.zeros(DIM))
        self.conv2 = nn.Conv1d(DIM, 2 * DIM, 7, 3)
        self.conv3 = nn.Conv1d(2 * DIM, DIM, 3, 2)
        self.layers = nn.ModuleList(EncoderLayer() for _ in range(LAYERS))
        self.final_norm = nn.Parameter(torch.ones(DIM))
        inv = 10000.0 ** (-torch.arange(0, ROTARY_DIM, 2, dtype=torch.float32) / ROTARY_DIM)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.chunk_frames = chunk_frames
        self.left_frames = left_frames
        self.causal_norm = causal_norm
        #: (mean, variance, weight in frames): the running GroupNorm starts as if `weight` frames of these
        #: statistics had been seen (0: the utterance's own frames only)
        self.norm_prior = norm_prior

    # -- pieces -------------------------------------------------------------------------------------
    def _angles(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = pos.float()[:, None] * self.inv_freq[None]  # [T, 16]
        a = a.repeat_interleave(2, -1)  # interleaved: f0 f0 f1 f1 ...
        return a.cos(), a.sin()

    def _norm(
        self, x: torch.Tensor, s0, q0, n0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Running (or whole-utterance) one-group normalisation of conv1 frames x [B, 416, T]."""
        b, c, t = x.shape
        if not self.causal_norm:
            y = F.group_norm(x, 1, None, None, EPS)
        else:
            s = s0[:, None] + torch.cumsum(x.sum(1), 1)
            q = q0[:, None] + torch.cumsum((x * x).sum(1), 1)
            n = n0[:, None] + c * torch.arange(1, t + 1, dtype=x.dtype, device=x.device)[None]
            mean = s / n
            var = (q / n - mean * mean).clamp_min(0.0)
            y = (x - mean[:, None]) / torch.sqrt(var[:, None] + EPS)
            if t:
                s0, q0, n0 = s[:, -1], q[:, -1], n[:, -1]
        return y * self.norm_weight[None, :, None] + self.norm_bias[None, :, None], s0, q0, n0

    def _prior(self, b: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, var, weight = self.norm_prior
        n = torch.full((b,), float(weight) * DIM, device=device)
        return n * mean, n * (var + mean * mean), n

    def stem(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [B, S] -> stem frames [B, T, 416] (offline)."""
        x = torch.tanh(self.conv1(audio[:, None]))
        x, *_ = self._norm(x, *self._prior(audio.shape[0], audio.device))
        x = F.gelu(self.conv2(x))
        return F.gelu(self.conv3(x)).transpose(1, 2)

    def mask(self, t: int, device=None) -> torch.Tensor | None:
        """[T, T] bool: may frame i attend to frame j (None: everything, Moonshine's own)."""
        if self.chunk_frames is None:
            return None
        idx = torch.arange(t, device=device)
        ci, cj = idx[:, None] // self.chunk_frames, idx[None] // self.chunk_frames
        start = ci * self.chunk_frames
        return (cj <= ci) & (idx[None] >= start - self.left_frames)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        """Offline: audio [B, S] float32 16 kHz -> encoder frames [B, T, 416] under the chunk mask."""
        x = self.stem(audio)
        t = x.shape[1]
        cos, sin = self._angles(torch.arange(t, device=x.device))
        mask = self.mask(t, x.device)
        for layer in self.layers:
            q, k, v = layer.qkv(x, cos, sin)
            x = layer.finish(x, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        return _layer_norm(x, self.final_norm)

    # -- streaming ----------------------------------------------------------------------------------
    def init_state(self, batch: int = 1, device: torch.device | str = "cpu") -> StreamState:
        if self.chunk_frames is None or not self.causal_norm:
            raise ValueError("streaming needs a chunk mask and the running GroupNorm")
        z = torch.zeros
        s0, q0, n0 = self._prior(batch, device)
        empty = [z(batch, HEADS, 0, HEAD_DIM, device=device) for _ in range(LAYERS)]
        return StreamState(
            z(batch, 0, device=device), z(batch, DIM, 0, device=device), z(batch, 2 * DIM, 0, device=device),
            z(batch, 0, DIM, device=device), s0, q0, n0, empty, [e.clone() for e in empty], 0, 0, 0, 0, 0,
        )  # fmt: skip

    def _stem_step(self, st: StreamState, samples: torch.Tensor) -> torch.Tensor:
        """New stem frames [B, n, 416] from new samples; consumes what later frames no longer need."""
        buf = torch.cat([st.samples, samples], 1)
        (k1, s1), (k2, s2), (k3, s3) = STEM
        n = (buf.shape[1] - k1) // s1 + 1 if buf.shape[1] >= k1 else 0
        if n > 0:
            x = torch.tanh(self.conv1(buf[:, None, : (n - 1) * s1 + k1]))
            x, st.norm_sum, st.norm_sq, st.norm_count = self._norm(x, st.norm_sum, st.norm_sq, st.norm_count)
            st.c1 = torch.cat([st.c1, x], 2)
            buf = buf[:, n * s1 :]
            st.n1 += n
        st.samples = buf
        n = (st.c1.shape[2] - k2) // s2 + 1 if st.c1.shape[2] >= k2 else 0
        if n > 0:
            st.c2 = torch.cat([st.c2, F.gelu(self.conv2(st.c1[:, :, : (n - 1) * s2 + k2]))], 2)
            st.c1 = st.c1[:, :, n * s2 :]
            st.n2 += n
        n = (st.c2.shape[2] - k3) // s3 + 1 if st.c2.shape[2] >= k3 else 0
        if n > 0:
            out = F.gelu(self.conv3(st.c2[:, :, : (n - 1) * s3 + k3])).transpose(1, 2)
            st.c2 = st.c2[:, :, n * s3 :]
            st.n3 += n
            return out
        return st.c2.new_zeros(st.c2.shape[0], 0, DIM)

    def _layers_step(self, st: StreamState, x: torch.Tensor) -> torch.Tensor:
        """One chunk of stem frames [B, n, 416] through the layers with the caches."""
        n = x.shape[1]
        cos, sin = self._angles(torch.arange(st.frame, st.frame + n, device=x.device))
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, cos, sin)
            keys, values = torch.cat([st.keys[i], k], 2), torch.cat([st.values[i], v], 2)
            x = layer.finish(x, F.scaled_dot_product_attention(q, keys, values))
            st.keys[i] = keys[:, :, -self.left_frames :] if self.left_frames else keys[:, :, :0]
            st.values[i] = values[:, :, -self.left_frames :] if self.left_frames else values[:, :, :0]
        st.frame += n
        return _layer_norm(x, self.final_norm)

    @torch.no_grad()
    def step(self, st: StreamState, samples: torch.Tensor, final: bool = False) -> torch.Tensor:
        """Feed samples [B, n]; returns the encoder frames whose chunk is complete ([B, k*chunk, 416]); with
        `final`, also the last, shorter chunk. Mutates `st` (one utterance's state, owned by its caller)."""
        st.pending = torch.cat([st.pending, self._stem_step(st, samples)], 1)
        c = int(self.chunk_frames)  # type: ignore[arg-type]
        outs = []
        while st.pending.shape[1] >= c or (final and st.pending.shape[1] > 0):
            x, st.pending = st.pending[:, :c], st.pending[:, c:]
            outs.append(self._layers_step(st, x))
        return torch.cat(outs, 1) if outs else st.pending.new_zeros(st.pending.shape[0], 0, DIM)


#: the layer projections the project's adapters (LoRA) adapt (asr/training/train_moonshine_stream.py)
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2")


def merge_adapters(
    enc: MoonshineStreamingEncoder, state: dict[str, torch.Tensor], rank: int, alpha: float
) -> None:
    """Fold trained adapters into a plain encoder: each projection W += (alpha / rank) B A, and the layers' norms
    replaced by the trained ones (names as the recipe's `adapter_state`)."""
    scale = alpha / rank
    with torch.no_grad():
        for i, layer in enumerate(enc.layers):
            for name in ADAPTED:
                a, b = state[f"layers.{i}.{name}.a"].float(), state[f"layers.{i}.{name}.b"].float()
                getattr(layer, name).weight += scale * b @ a
            for norm in ("input_layernorm", "post_attention_layernorm"):
                getattr(layer, norm).copy_(state[f"layers.{i}.{norm}"].float())
        enc.final_norm.copy_(state["final_norm"].float())


# -- weights from the packaged graph ----------------------------------------------------------------------


def packaged_state_dict(package: str = "moonshine_cpp") -> dict[str, torch.Tensor]:
    """The encoder's weights from moonshine-cpp's `encoder_model.ort`, dequantised, named for this module."""
    from asr.moonshine import model_file
    from asr.ort_format import ort_to_onnx
    from asr.ort_weights import GraphWeights

    weight_of = GraphWeights(ort_to_onnx(model_file("encoder_model.ort", package)).graph).input_of

    sd: dict[str, np.ndarray] = {
        "conv1.weight": weight_of("/conv1/Conv"),
        "conv2.weight": weight_of("/conv2/Conv"),
        "conv2.bias": weight_of("/conv2/Conv", 2),
        "conv3.weight": weight_of("/conv3/Conv"),
        "conv3.bias": weight_of("/conv3/Conv", 2),
        "norm_weight": weight_of("/groupnorm/Mul").reshape(-1),
        "norm_bias": weight_of("/groupnorm/Add").reshape(-1),
        "final_norm": weight_of("/layer_norm/Mul"),
    }
    for i in range(LAYERS):
        p, q = f"/layers.{i}/", f"layers.{i}."
        sd[q + "input_layernorm"] = weight_of(p + "input_layernorm/Mul")
        sd[q + "post_attention_layernorm"] = weight_of(p + "post_attention_layernorm/Mul")
        for ours, theirs in (
            ("q_proj", "q_proj"),
            ("k_proj", "k_proj"),
            ("v_proj", "v_proj"),
            ("o_proj", "dense"),
        ):
            sd[q + ours + ".weight"] = weight_of(p + f"self_attn/{theirs}/MatMul").T
        sd[q + "fc1.weight"] = weight_of(p + "mlp/fc1/MatMul").T
        sd[q + "fc1.bias"] = weight_of(p + "mlp/fc1/Add", 0)
        sd[q + "fc2.weight"] = weight_of(p + "mlp/fc2/MatMul").T
        sd[q + "fc2.bias"] = weight_of(p + "mlp/fc2/Add", 0)
    scale = weight_of("/layers.0/self_attn/Mul_4")
    if not math.isclose(float(scale.reshape(-1)[0]), HEAD_DIM**-0.25, rel_tol=1e-4):
        raise ValueError(f"unexpected attention scaling {scale} in the packaged encoder")
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}


def load_packaged(**kwargs) -> MoonshineStreamingEncoder:
    """A streaming encoder with the packaged Moonshine base-en weights (kwargs: the constructor's)."""
    enc = MoonshineStreamingEncoder(**kwargs)
    enc.load_state_dict(packaged_state_dict())
    return enc.eval()
