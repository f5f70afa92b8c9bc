"""A lean forward pass for Llama / Qwen2 decoders, for the session KV caches of the dialogue engine.

Decoding one token of SmolLM2-135M through `transformers` costs ~20 ms here, of which the matrix
products are ~7 ms: the rest is Python around them (module calls, mask and cache bookkeeping, and
seven separate int8 products per layer, each quantising the same activation again). `FastDecoder`
runs the same arithmetic with the model's own weights in a plain loop:

* q/k/v and gate/up of a dynamically quantised int8 model become one product each (the packed
  per-channel int8 weights are concatenated, so each output channel keeps its own scale; the
  activation is quantised once per tensor from the same input, so every output is bit-identical
  to the separate products). The model's `q_proj`/`k_proj`/`v_proj`/`gate_proj`/`up_proj` become
  slices of the fused product, so the weights are held once and the `transformers` forward still
  gives the same numbers (it is slower: it computes the fused product once per slice);
* RMSNorm, RoPE (the model's own `rotary_emb`, scaling included), grouped-query attention through
  `scaled_dot_product_attention`, the SiLU MLP and the final norm are written out as
  `transformers` writes them, and keys/values go into the same `DynamicCache` layers.

The result equals `model.model(...).last_hidden_state` exactly on the models it accepts
(`tests/dialogue/test_fast_decoder.py`); `FastDecoder.supports(model)` says which: Llama and Qwen2 with SiLU
MLPs, full attention and no tensor-parallel split. Anything else uses the `transformers` forward.

`forward_batch` runs several sessions' caches in one pass (issue 22): a decode step reads every weight
matrix once for all of them instead of once per session, which is what a memory-bound CPU decode pays
for. The rows of all sessions are packed (no padding through the products); attention runs per
session in a decode step and pads and masks the ragged caches for multi-token feeds. One caveat: a dynamic int8 product quantises its input with one
scale per call, so packed rows share that scale and a row's numbers then depend (at int8 rounding)
on the other rows; `per_session_quant=True` runs those products once per session instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from dialogue.kv_pool import KvPool, PooledCache

__all__ = ["ACTIVATION_SCALES", "FastDecoder", "shares_activation_scale", "unsupported_reason"]

_FAMILIES = ("llama", "qwen2")
_ATTR = "_duplex_fast_decoder"


def unsupported_reason(model: Any) -> str | None:
    """Why `FastDecoder` cannot run `model` (None: it can)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in _FAMILIES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {_FAMILIES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if int(getattr(cfg, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no decoder stack with rotary embeddings"
    return None


# -- linear layers ------------------------------------------------------------------------------


def _is_dynamic_int8(mod: nn.Module) -> bool:
    packed = getattr(mod, "_packed_params", None)
    return packed is not None and getattr(packed, "dtype", None) == torch.qint8


def shares_activation_scale(mod: nn.Module) -> bool:
    """Whether `mod` quantises its whole input with one scale (dynamic int8), so rows of a batch interact."""
    if isinstance(mod, FusedPart):
        mod = mod.fused
    return _is_dynamic_int8(mod)


#: how a dynamic int8 product scales its input: "tensor" (torch's own: one scale for all the rows of a
#: call, so in a multi-token feed a row with large values coarsens every other row's rounding) or "token"
#: (each row scaled to its largest magnitude first and back after, so every row of a feed is rounded on
#: its own scale, as a one-token decode step rounds it)
ACTIVATION_SCALES = ("tensor", "token")


def _linear_fn(mod: nn.Module, act_scale: str = "tensor") -> Callable[[torch.Tensor], torch.Tensor]:
    """A direct call of `mod`'s arithmetic (skips the module machinery where it is safe to)."""
    if act_scale not in ACTIVATION_SCALES:
        raise ValueError(f"act_scale must be one of {ACTIVATION_SCALES}, got {act_scale!r}")
    if _is_dynamic_int8(mod):
        packed = mod._packed_params._packed_params
        reduce_range = not (getattr(mod, "version", None) is None or mod.version < 4)

        def dyn(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.quantized.linear_dynamic(x, packed, reduce_range=reduce_range).to(x.dtype)

        if act_scale == "tensor":
            return dyn
        bias = torch.ops.quantized.linear_unpack(packed)[1]

        def per_token(x: torch.Tensor) -> torch.Tensor:
            if x.numel() == x.shape[-1]:
                return dyn(x)  # one row: its own scale already
            # W (x / a) + b, then back: (y - b) a + b = W x + b, with each row's rounding on its own range
            a = x.abs().amax(-1, keepdim=True).clamp_min(1e-6)
            y = dyn(x / a)
            return y * a if bias is None else (y - bias) * a + bias

        return per_token
    if type(mod) is nn.Linear:
        w, b = mod.weight, mod.bias
        return lambda x: F.linear(x, w, b)
    return mod  # any other module (the int8 weight-only down_proj): its own forward


def _fuse_dynamic_int8(mods: Sequence[nn.Module]) -> nn.Module:
    """One dynamic int8 Linear whose output is the concatenation of `mods`' outputs, bit for bit."""
    from torch.ao.nn.quantized.dynamic import Linear as DynLinear

    versions = {getattr(m, "version", None) for m in mods}
    if len(versions) != 1:
        raise ValueError("cannot fuse dynamic int8 layers of different versions")
    weights, biases, scales, zeros = [], [], [], []
    has_bias = False
    for m in mods:
        w, b = torch.ops.quantized.linear_unpack(m._packed_params._packed_params)
        if w.qscheme() not in (torch.per_channel_affine, torch.per_channel_symmetric):
            raise ValueError(f"cannot fuse {w.qscheme()} weights")
        weights.append(w.int_repr())
        scales.append(w.q_per_channel_scales())
        zeros.append(w.q_per_channel_zero_points())
        has_bias = has_bias or b is not None
        biases.append(b if b is not None else torch.zeros(w.shape[0]))
    qw = torch._make_per_channel_quantized_tensor(
        torch.cat(weights), torch.cat(scales).double(), torch.cat(zeros).long(), 0
    )
    fused = DynLinear(qw.shape[1], qw.shape[0], bias_=has_bias, dtype=torch.qint8)
    fused.set_weight_bias(qw, torch.cat(biases).float() if has_bias else None)
    fused.version = versions.pop()
    return fused


class FusedPart(nn.Module):
    """Columns [start, stop) of a fused product: stands in for one of the layers that were fused."""

    def __init__(self, fused: nn.Module, start: int, stop: int) -> None:
        super().__init__()
        self.fused = fused
        self.start, self.stop = start, stop
        self.in_features = getattr(fused, "in_features", None)
        self.out_features = stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start : self.stop]


def _fuse(
    parent: nn.Module, names: Sequence[str], act_scale: str = "tensor"
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Fuse `parent`'s int8 layers `names` into one product (replacing them by `FusedPart`s)."""
    mods = [getattr(parent, n) for n in names]
    if all(isinstance(m, FusedPart) for m in mods) and len({id(m.fused) for m in mods}) == 1:
        return _linear_fn(mods[0].fused, act_scale)  # fused already (a second decoder over the same model)
    if not all(_is_dynamic_int8(m) for m in mods):
        return None
    fused = _fuse_dynamic_int8(mods)
    start = 0
    for n, m in zip(names, mods, strict=True):
        size = int(m.weight().shape[0])
        setattr(parent, n, FusedPart(fused, start, start + size))
        start += size
    return _linear_fn(fused, act_scale)


# -- the decoder ----------------------------------------------------------------------------------


def _signature(model: Any) -> tuple[int, ...]:
    """Identity of the modules and weights a decoder reads (to notice a model edited after it was built)."""
    inner = model.model
    out = [id(inner.embed_tokens), id(inner.norm.weight), len(inner.layers)]
    for layer in inner.layers:
        a, mlp = layer.self_attn, layer.mlp
        out += [
            id(m) for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        ]
        out += [id(layer.input_layernorm.weight), id(layer.post_attention_layernorm.weight)]
    return tuple(out)


Linear = Callable[[torch.Tensor], torch.Tensor]
Split = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def _products(parent: nn.Module, names: Sequence[str], act_scale: str = "tensor") -> Split:
    """`parent`'s layers `names` as one call returning their outputs: one fused int8 product split
    into parts where it can be fused, else each layer in turn."""
    fused = _fuse(parent, names, act_scale)
    if fused is not None:
        sizes = [int(getattr(parent, n).out_features) for n in names]
        return lambda x: fused(x).split(sizes, dim=-1)
    fns = [_linear_fn(getattr(parent, n), act_scale) for n in names]
    return lambda x: tuple(f(x) for f in fns)


@dataclass
class _Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Split
    o: Linear
    gate_up: Split
    down: Linear
    #: per product: whether it quantises its input per tensor (rows of a batch share that scale)
    joint: dict[str, bool]


def _by_group(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, groups: list[int] | None) -> Any:
    """`fn(x)`, or `fn` once per group of rows (a tuple result is concatenated part by part)."""
    if groups is None:
        return fn(x)
    parts = [fn(p) for p in x.split(groups)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(z) for z in zip(*parts, strict=True))
    return torch.cat(parts)


class FastDecoder:
    """`model.model(ids, cache)` without the framework around it; see the module docstring."""

    #: attention of a batched decode step: "per_session" (each session's query over its own cache) or
    #: "padded" (the caches padded to one tensor and masked, one launch a layer). Same numbers up to float
    #: rounding (tested). Per session is faster on the CPU and, measured, on an H200 too (45 vs 99 ms a
    #: step at 32 sessions: padding copies every cache each step; docs/operations.md, "On a GPU")
    decode_attention: str = "per_session"

    def __init__(self, model: Any, act_scale: str = "tensor") -> None:
        """`act_scale`: how the dynamic int8 products scale their input rows (`ACTIVATION_SCALES`)."""
        if act_scale not in ACTIVATION_SCALES:
            raise ValueError(f"FastDecoder: act_scale must be one of {ACTIVATION_SCALES}, got {act_scale!r}")
        why = unsupported_reason(model)
        if why is not None:
            raise ValueError(f"FastDecoder: unsupported model ({why})")
        cfg = model.config
        self.model = model
        self.act_scale = act_scale
        self.inner = model.model
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.scaling = self.head_dim**-0.5
        self.layers: list[_Layer] = []
        for layer in self.inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv = _products(a, ("q_proj", "k_proj", "v_proj"), act_scale)
            gate_up = _products(mlp, ("gate_proj", "up_proj"), act_scale)
            joint = {
                "qkv": any(shares_activation_scale(getattr(a, n)) for n in ("q_proj", "k_proj", "v_proj")),
                "o": shares_activation_scale(a.o_proj),
                "gate_up": any(shares_activation_scale(getattr(mlp, n)) for n in ("gate_proj", "up_proj")),
                "down": shares_activation_scale(mlp.down_proj),
            }
            self.layers.append(
                _Layer(
                    in_norm=layer.input_layernorm.weight,
                    post_norm=layer.post_attention_layernorm.weight,
                    qkv=qkv,
                    o=_linear_fn(a.o_proj, act_scale),
                    gate_up=gate_up,
                    down=_linear_fn(mlp.down_proj, act_scale),
                    joint=joint,
                )
            )
        self.final_norm = self.inner.norm.weight
        self.final_eps = float(getattr(self.inner.norm, "variance_epsilon", self.eps))
        self.signature = _signature(model)

    @classmethod
    def for_model(cls, model: Any, act_scale: str = "tensor") -> FastDecoder | None:
        """The model's decoder (built once and kept on the model), or None if it is not supported.

        A kept decoder is reused only if it was built for this very model object with the same
        modules and `act_scale` (a deep copy, or a model whose layers were replaced since, e.g. by
        LoRA, gets a new one)."""
        if unsupported_reason(model) is not None:
            return None
        dec = getattr(model, _ATTR, None)
        if (
            dec is None
            or dec.model is not model
            or dec.signature != _signature(model)
            or dec.act_scale != act_scale
        ):
            dec = cls(model, act_scale)
            setattr(model, _ATTR, dec)
        return dec

    def _norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        # transformers' RMSNorm: in float32, then the weight times the input dtype
        x32 = x.to(torch.float32)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return w * y.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def forward(self, cache: Any, ids: Sequence[int], start: int) -> torch.Tensor:
        """Run `ids` at positions start.. after the `DynamicCache` (extended in place); the final-norm
        hidden states [1, len(ids), hidden]."""
        n = len(ids)
        device = self.final_norm.device
        x = self.inner.embed_tokens(torch.tensor([list(ids)], dtype=torch.long, device=device))
        positions = torch.arange(start, start + n, device=device)
        cos, sin = self.inner.rotary_emb(x, positions[None])
        cos, sin = cos[:, None], sin[:, None]
        mask = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start) if n > 1 else None
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        for i, ly in enumerate(self.layers):
            h = self._norm(x, ly.in_norm, self.eps)
            q, k, v = ly.qkv(h)
            q = self._rope(q.view(1, n, nh, hd).transpose(1, 2), cos, sin)
            k = self._rope(k.view(1, n, nkv, hd).transpose(1, 2), cos, sin)
            v = v.view(1, n, nkv, hd).transpose(1, 2)
            keys, values = cache.layers[i].update(k, v)
            o = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=nkv != nh
            )
            x = x + ly.o(o.transpose(1, 2).reshape(1, n, nh * hd))
            h = self._norm(x, ly.post_norm, self.eps)
            g, u = ly.gate_up(h)
            x = x + ly.down(F.silu(g) * u)
        return self._norm(x, self.final_norm, self.final_eps)

    def forward_batch(
        self,
        caches: Sequence[Any],
        ids: Sequence[Sequence[int]],
        starts: Sequence[int],
        *,
        per_session_quant: bool = False,
        decode_attention: str | None = None,
    ) -> list[torch.Tensor]:
        """`forward` for several sessions in one pass: session b runs `ids[b]` at positions
        starts[b].. after `caches[b]` (each extended in place, as `forward` would). Returns, per
        session, its final-norm hidden states [1, len(ids[b]), hidden].

        The caches may hold different lengths and the sessions feed different numbers of tokens.
        Products run on the packed rows (sum of the lengths, no padding). Attention of a decode step
        (one token per session) runs per session over its own cache; otherwise it pads the keys and
        values to the longest cache and the queries to the longest feed, and a mask keeps each row
        to its own session's keys up to its own position, so padding never reaches a result.
        `per_session_quant` runs the dynamic int8 products once per session, so that no session's
        activation scale depends on the others (see the module docstring); float products are
        row-independent either way.
        """
        b = len(caches)
        if b == 0 or len(ids) != b or len(starts) != b:
            raise ValueError(
                f"forward_batch: {len(caches)} caches, {len(ids)} id lists, {len(starts)} starts"
            )
        lens = [len(t) for t in ids]
        if min(lens) < 1:
            raise ValueError("forward_batch: every session needs at least one token")
        device = self.final_norm.device
        flat = torch.tensor([int(t) for seq in ids for t in seq], dtype=torch.long, device=device)
        x = self.inner.embed_tokens(flat)  # [N, H]: every session's rows, packed
        n = x.shape[0]
        positions = torch.cat(
            [torch.arange(s, s + k, device=device) for s, k in zip(starts, lens, strict=True)]
        )
        cos, sin = self.inner.rotary_emb(x[None], positions[None])
        cos, sin = cos[0, :, None], sin[0, :, None]  # [N, 1, head_dim]: broadcast over heads
        t_max = max(lens)
        s_max = max(int(s) + k for s, k in zip(starts, lens, strict=True))
        decode = t_max == 1
        # every session in one KvPool: one indexed write and one masked attention per layer for all of them
        pool = _shared_pool(caches)
        how = decode_attention or self.decode_attention
        per_session = decode and pool is None and how == "per_session"
        starts_t = torch.tensor([int(s) for s in starts], device=device)
        lens_t = torch.tensor(lens, device=device)
        if pool is not None:
            slots_t = torch.tensor([c.slot for c in caches], device=device)
            slot_rows = torch.repeat_interleave(slots_t, lens_t)  # the slot of every packed row
        mask = None
        if not per_session:
            # query t of session b sees keys 0..starts[b] + t; a padding query (t >= lens[b]) copies
            # the session's last real query, so no row is fully masked (that would give NaN)
            t_idx = torch.arange(t_max, device=device)
            last = starts_t[:, None] + torch.minimum(t_idx[None], lens_t[:, None] - 1)  # [B, T]
            mask = (torch.arange(s_max, device=device)[None, None] <= last[:, :, None])[:, None]
        valid = None if decode else (torch.arange(t_max, device=device)[None] < lens_t[:, None]).reshape(-1)
        groups = lens if per_session_quant and b > 1 else None
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        for i, ly in enumerate(self.layers):
            h = self._norm(x, ly.in_norm, self.eps)
            q, k, v = _by_group(ly.qkv, h, groups if ly.joint["qkv"] else None)
            q = self._rope(q.view(n, nh, hd), cos, sin)
            k = self._rope(k.view(n, nkv, hd), cos, sin)
            v = v.view(n, nkv, hd)
            if pool is not None:
                kp, vp = pool.keys[i], pool.values[i]
                kp[slot_rows, :, positions] = k
                vp[slot_rows, :, positions] = v
                keys, values = kp[slots_t, :, :s_max], vp[slots_t, :, :s_max]  # [B, kv heads, S, head_dim]
                if decode:
                    qb = q.view(b, nh, 1, hd)
                else:
                    qb = pad_sequence(list(q.split(lens)), batch_first=True).transpose(1, 2)
                o = F.scaled_dot_product_attention(
                    qb, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=nkv != nh
                )
                o = o.transpose(1, 2).reshape(b * t_max, nh * hd)
            elif per_session:
                # one query per session: attend each over its own cache as it stands, with no
                # padded copy of every cache and no mask (measured ~15-25 % faster per step than
                # the padded path at 4 sessions, and the very call `forward` makes)
                outs = []
                for bi, c in enumerate(caches):
                    keys, values = c.layers[i].update(k[bi].view(1, nkv, 1, hd), v[bi].view(1, nkv, 1, hd))
                    outs.append(
                        F.scaled_dot_product_attention(
                            q[bi].view(1, nh, 1, hd), keys, values, scale=self.scaling, enable_gqa=nkv != nh
                        )
                    )
                o = torch.cat(outs).view(b, nh * hd)
            else:
                ks, vs = [], []
                for c, kb, vb in zip(caches, k.split(lens), v.split(lens), strict=True):
                    keys, values = c.layers[i].update(kb.transpose(0, 1)[None], vb.transpose(0, 1)[None])
                    ks.append(keys[0].transpose(0, 1))  # [L_b, kv heads, head_dim], what pad_sequence pads
                    vs.append(values[0].transpose(0, 1))
                keys = pad_sequence(ks, batch_first=True).transpose(1, 2)  # [B, kv heads, S, head_dim]
                values = pad_sequence(vs, batch_first=True).transpose(1, 2)
                qb = pad_sequence(list(q.split(lens)), batch_first=True).transpose(1, 2)  # [B, heads, T, hd]
                o = F.scaled_dot_product_attention(
                    qb, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=nkv != nh
                )
                o = o.transpose(1, 2).reshape(b * t_max, nh * hd)
            if valid is not None:
                o = o[valid]  # back to the packed rows
            x = x + _by_group(ly.o, o, groups if ly.joint["o"] else None)
            h = self._norm(x, ly.post_norm, self.eps)
            g, u = _by_group(ly.gate_up, h, groups if ly.joint["gate_up"] else None)
            x = x + _by_group(ly.down, F.silu(g) * u, groups if ly.joint["down"] else None)
        if pool is not None:
            for c, k_ in zip(caches, lens, strict=True):
                c.advance(k_)
        out = self._norm(x, self.final_norm, self.final_eps)
        return [part[None] for part in out.split(lens)]


def _shared_pool(caches: Sequence[Any]) -> KvPool | None:
    """The KvPool that holds every one of `caches`, or None (a plain DynamicCache among them, or two pools)."""
    first = caches[0]
    if not isinstance(first, PooledCache):
        return None
    pool = first.pool
    return pool if all(isinstance(c, PooledCache) and c.pool is pool for c in caches) else None


def decoder_hidden(
    model: Any, ids: Sequence[int], cache: Any = None, start: int | None = None
) -> torch.Tensor:
    """Final-norm hidden states [1, len(ids), H] of `ids` after `cache` (extended in place; a fresh
    `DynamicCache` if None): the lean forward where the model allows it, else `transformers`'.

    The offline tools (feature extraction, labelling, judging) call this, so they compute exactly
    what the engine computes, as fast as it does."""
    from transformers import DynamicCache

    if cache is None:
        cache = DynamicCache(config=model.config)
    pos = cache.get_seq_length() if start is None else int(start)
    dec = FastDecoder.for_model(model)
    if dec is not None:
        return dec.forward(cache, ids, pos)
    device = model.model.embed_tokens.weight.device
    positions = torch.arange(pos, pos + len(ids), device=device)
    out = model.model(
        input_ids=torch.tensor([list(ids)], dtype=torch.long, device=device),
        past_key_values=cache,
        use_cache=True,
        cache_position=positions,
        position_ids=positions[None],
    )
    return out.last_hidden_state
