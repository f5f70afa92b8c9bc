"""Moonshine base-en's decoder in torch, from the packaged model's weights (for training through it).

The service decodes with onnxruntime (asr/moonshine.py). Training the streaming encoder's adapters on what the
*decoder* makes of its frames (asr/training/train_moonshine_stream.py, `--objective decoder`) needs gradients
through the decoder, so the same weights run here: 8 pre-norm layers of 416 dims, each causal self-attention
with rotary positions (the first 32 of each head's 52 dims, interleaved pairs, as in the encoder), cross-attention
to the encoder frames (no positions), and a SwiGLU MLP (`up_proj` to 2 x 1664; `silu(second half) * first
half`); a final LayerNorm and logits tied to the token embedding. Layer norms have no bias (eps 1e-5).

`forward(ids, frames)` is teacher-forced over a whole token sequence (no cache): what a training step needs.
Tested to give the packaged onnxruntime decoder's logits (tests/asr/test_moonshine_stream.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from asr.moonshine_stream import DIM, HEAD_DIM, HEADS, LAYERS, ROTARY_DIM, _layer_norm, _rotate

FF_DIM = 1664


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)

    @staticmethod
    def _heads(x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, HEADS, HEAD_DIM).transpose(1, 2)

    def forward(self, x, memory, rotary=None, mask=None, causal=False) -> torch.Tensor:
        q, k, v = (
            self._heads(self.q_proj(x)),
            self._heads(self.k_proj(memory)),
            self._heads(self.v_proj(memory)),
        )
        if rotary is not None:
            cos, sin = rotary

            def rot(z: torch.Tensor) -> torch.Tensor:
                r, rest = z[..., :ROTARY_DIM], z[..., ROTARY_DIM:]
                return torch.cat((r * cos + _rotate(r) * sin, rest), -1)

            q, k = rot(q), rot(k)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, DIM))


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(DIM))
        self.self_attn = _Attention()
        self.post_attention_layernorm = nn.Parameter(torch.ones(DIM))
        self.encoder_attn = _Attention()
        self.final_layernorm = nn.Parameter(torch.ones(DIM))
        self.up_proj = nn.Linear(DIM, 2 * FF_DIM)
        self.down_proj = nn.Linear(FF_DIM, DIM)

    def forward(self, x, frames, rotary, frame_mask) -> torch.Tensor:
        h = _layer_norm(x, self.input_layernorm)
        x = x + self.self_attn(h, h, rotary=rotary, causal=True)
        x = x + self.encoder_attn(_layer_norm(x, self.post_attention_layernorm), frames, mask=frame_mask)
        hidden, gate = self.up_proj(_layer_norm(x, self.final_layernorm)).chunk(2, -1)
        return x + self.down_proj(F.silu(gate) * hidden)


class MoonshineDecoder(nn.Module):
    """Moonshine base-en's decoder, teacher-forced (module doc)."""

    def __init__(self, vocab: int = 32768) -> None:
        super().__init__()
        self.embed_tokens = nn.Parameter(torch.zeros(vocab, DIM))
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(LAYERS))
        self.norm = nn.Parameter(torch.ones(DIM))
        inv = 10000.0 ** (-torch.arange(0, ROTARY_DIM, 2, dtype=torch.float32) / ROTARY_DIM)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(
        self, ids: torch.Tensor, frames: torch.Tensor, n_frames: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, L, vocab] after each of the tokens `ids` [B, L] (BOS first) given encoder `frames`
        [B, T, 416]; `n_frames` [B]: each row's real frame count when rows are padded (None: all real)."""
        t = ids.shape[1]
        a = torch.arange(t, device=ids.device).float()[:, None] * self.inv_freq[None]
        a = a.repeat_interleave(2, -1)
        rotary = (a.cos(), a.sin())
        frame_mask = None
        if n_frames is not None:
            real = torch.arange(frames.shape[1], device=frames.device)[None] < n_frames[:, None]  # [B, T]
            frame_mask = real[:, None, None, :]
        x = F.embedding(ids, self.embed_tokens)
        for layer in self.layers:
            x = layer(x, frames, rotary, frame_mask)
        return _layer_norm(x, self.norm) @ self.embed_tokens.T


def packaged_decoder_state_dict(package: str = "moonshine_cpp") -> dict[str, torch.Tensor]:
    """The decoder's weights from moonshine-cpp's `decoder_model_merged.ort`, dequantised, named for this module."""
    import numpy as np

    from asr.moonshine import model_file
    from asr.ort_format import ort_to_onnx
    from asr.ort_weights import GraphWeights

    weight_of = GraphWeights(ort_to_onnx(model_file("decoder_model_merged.ort", package)).graph).input_of
    d = "/model/decoder/"
    sd: dict[str, np.ndarray] = {
        "embed_tokens": weight_of(d + "embed_tokens/Gather", 0),
        "norm": weight_of(d + "norm/Mul"),
    }
    for i in range(LAYERS):
        p, q = f"{d}layers.{i}/", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "final_layernorm"):
            sd[q + norm] = weight_of(p + f"{norm}/Mul")
        for attn in ("self_attn", "encoder_attn"):
            for ours, theirs in (
                ("q_proj", "q_proj"),
                ("k_proj", "k_proj"),
                ("v_proj", "v_proj"),
                ("o_proj", "dense"),
            ):
                sd[f"{q}{attn}.{ours}.weight"] = weight_of(p + f"{attn}/{theirs}/MatMul").T
        for proj in ("up_proj", "down_proj"):
            sd[f"{q}{proj}.weight"] = weight_of(p + f"mlp/{proj}/MatMul").T
            sd[f"{q}{proj}.bias"] = weight_of(p + f"mlp/{proj}/Add", 0)
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}


def load_packaged_decoder(package: str = "moonshine_cpp") -> MoonshineDecoder:
    """The packaged decoder's weights in torch, frozen, in eval mode."""
    sd = packaged_decoder_state_dict(package)
    dec = MoonshineDecoder(vocab=sd["embed_tokens"].shape[0])
    dec.load_state_dict(sd)
    for p in dec.parameters():
        p.requires_grad_(False)
    return dec.eval()
