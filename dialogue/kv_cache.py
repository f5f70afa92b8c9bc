"""Per-session KV cache with attention sinks, a rolling window and rollback (StreamingLLM).

A full-duplex session never ends on its own, so a cache that keeps every token grows without
bound in memory and in attention cost per decoded token. StreamingLLM (Xiao et al., 2023) shows
that a decoder stays fluent if it keeps the first few tokens (the "attention sinks": softmax dumps
its excess mass there, so dropping them breaks the model) plus a window of the most recent ones.
transformers v5 removed `SinkCache`, so this module implements the policy on top of a plain
`DynamicCache`.

Positions are cache-relative: a token fed while the cache holds L tokens gets position L, so the
model never sees a position beyond `sink_tokens + window_tokens` (no extrapolation past the trained
context, however long the call runs). Evicting k tokens after the sinks therefore moves every kept
window token k positions down. The cache stores keys *after* RoPE, and RoPE is a rotation whose
angles add, so re-rotating a stored key by -k positions gives exactly the key the model would have
produced at its new position; values carry no position and are kept as they are. The first
layer's keys/values (which depend only on token and position) are then, up to float rounding,
those of a fresh prefill of the kept `ids`. Deeper layers keep what each token computed while it
still saw the now-evicted context: that is StreamingLLM's behaviour (the evicted context lives on
in them) and much cheaper than re-prefilling the window; so with more than one layer the logits
after an eviction differ from those of a fresh prefill of `ids`, by design.

Eviction happens in multiples of `evict_chunk` so the O(window) re-rotation and copy is paid once
per chunk of tokens instead of once per token.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from dialogue.fast_decoder import FastDecoder, shares_activation_scale
from dialogue.kv_pool import KvPool, PooledCache


@dataclass
class LmCache:
    """One session's cache. Invariant: `cache` holds exactly the keys/values of `ids`, in order."""

    cache: DynamicCache | PooledCache
    #: token ids now in the cache (sinks, then the window); len(ids) == cache.get_seq_length()
    ids: list[int]
    #: tokens evicted so far; ids[sink_tokens] sat at absolute position sink_tokens + evicted
    evicted: int = 0
    #: float32 next-token logits after ids[-1]; None when not computed (new cache, after a rollback)
    logits: torch.Tensor | None = None
    #: float32 final-norm hidden state at ids[-1] (what lm_head sees), [hidden_size]; None like logits
    hidden: torch.Tensor | None = None


@dataclass
class FeedResult:
    """What one `CachedLM.feed` produced."""

    #: [vocab] float32 next-token logits after the last fed token
    logits: torch.Tensor
    #: [hidden_size] float32 final-norm hidden state at the last fed token
    hidden: torch.Tensor
    #: tokens this feed evicted from the window
    evicted: int
    #: with `feed(..., greedy=True)`: the model's greedy next token after each fed token (what a
    #: speculative check compares a draft with); else None
    greedy: list[int] | None = None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    # the Llama/Qwen2 (GPT-NeoX) RoPE layout: the two halves of the head dim form the rotated pairs
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class CachedLM:
    """Runs a decoder LM (Llama or Qwen2 family) over `LmCache`s with sinks + rolling window.

    One instance is shared by every session; it holds no per-session state. The model may be
    float, bfloat16 or dynamically int8-quantized: only `model.model` (the decoder stack, whose
    `rotary_emb` gives the real RoPE frequencies and scaling) and `model.lm_head` are called.
    """

    def __init__(
        self,
        model: nn.Module,
        sink_tokens: int = 4,
        window_tokens: int = 2048,
        evict_chunk: int = 64,
        fast: bool = True,
        kv_pool_slots: int | None = None,
        act_scale: str = "tensor",
    ) -> None:
        if sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")
        if window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
        if evict_chunk < 1:
            raise ValueError(f"evict_chunk must be >= 1, got {evict_chunk}")
        self.model = model
        self.sink_tokens = sink_tokens
        self.window_tokens = window_tokens
        self.evict_chunk = evict_chunk
        self.capacity = sink_tokens + window_tokens
        # eviction edits the layers' tensors directly, which is only sound for plain full-attention
        # layers; a sliding-window layer would keep its own bookkeeping of absolute positions
        probe = DynamicCache(config=model.config)
        odd = {type(layer).__name__ for layer in probe.layers if type(layer) is not DynamicLayer}
        if odd:
            raise ValueError(f"CachedLM needs full-attention cache layers only, the model config gives {odd}")
        # the lean forward (dialogue.fast_decoder) where the architecture allows it: same numbers, ~1.5x faster
        self.fast = FastDecoder.for_model(model, act_scale) if fast else None
        #: the lean decoder's attention for batched decode steps outside the pool (FastDecoder.decode_attention
        #: when None; "padded" is the A/B in duplex.bench.gpu_capacity)
        self.decode_attention: str | None = None
        # sessions' caches in one preallocated store (dialogue.kv_pool): on a GPU a batched step is then one
        # write and one attention per layer instead of ~3 launches per session per layer. None: 64 slots on
        # CUDA, none on the CPU (where per-session attention over DynamicCaches is as fast); needs the lean
        # decoder. Sessions past the slots get DynamicCaches.
        if kv_pool_slots is None:
            kv_pool_slots = 64 if self._device().type == "cuda" else 0
        self.pool: KvPool | None = None
        if kv_pool_slots > 0 and self.fast is not None:
            emb = self.model.model.embed_tokens.weight
            self.pool = KvPool(
                kv_pool_slots,
                len(self.fast.layers),
                self.fast.n_kv,
                self.capacity,
                self.fast.head_dim,
                emb.dtype,
                emb.device,
            )

    # -- sessions ---------------------------------------------------------------------------

    def new(self) -> LmCache:
        """An empty cache (a pool slot where there is a pool with one free)."""
        pooled = self.pool.new_cache() if self.pool is not None else None
        if pooled is not None:
            return LmCache(cache=pooled, ids=[])
        return LmCache(cache=DynamicCache(config=self.model.config), ids=[])

    def fork(self, c: LmCache) -> LmCache:
        """An independent deep copy, e.g. to hand each session its own copy of a prefilled system prompt."""
        with torch.inference_mode():
            return copy.deepcopy(c)

    def nbytes(self, c: LmCache) -> int:
        """Bytes held by the cache's key and value tensors (the per-session memory that the window bounds)."""
        if isinstance(c.cache, PooledCache):
            return c.cache.nbytes()  # the slot's reservation
        total = 0
        for layer in c.cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    # -- feeding ----------------------------------------------------------------------------

    def feed(
        self, c: LmCache, ids: Sequence[int], *, greedy: bool = False, picks_last: int = 0
    ) -> FeedResult:
        """Run `ids` through the model after the cached tokens (in place), evicting as needed.

        A feed that would overflow `sink_tokens + window_tokens` first evicts the oldest window
        tokens, rounded up to a multiple of `evict_chunk`. A feed longer than the window goes in
        window-sized pieces, since no single forward can fit more than that after the sinks.
        `greedy`: also the argmax next token after every fed token (lm_head on every position);
        `picks_last`: only after each of the last that many fed tokens (`FeedResult.greedy` holds those).
        """
        toks = [int(t) for t in ids]
        if not toks:
            raise ValueError("feed: no tokens to feed")
        evicted = 0
        pos = 0
        picks: list[int] | None = [] if greedy or picks_last > 0 else None
        first_pick = 0 if greedy else len(toks) - picks_last  # the first fed position whose pick is wanted
        with torch.inference_mode():
            while pos < len(toks):
                take, k = self._make_room(c, len(toks) - pos)
                evicted += k
                self._forward(c, toks[pos : pos + take], picks, max(0, first_pick - pos))
                pos += take
        assert c.logits is not None and c.hidden is not None
        return FeedResult(logits=c.logits, hidden=c.hidden, evicted=evicted, greedy=picks)

    def feed_batch(
        self,
        caches: Sequence[LmCache],
        ids: Sequence[Sequence[int]],
        *,
        per_session_quant: bool = False,
    ) -> list[FeedResult]:
        """`feed` for several sessions at once: one forward pass per round instead of one per session.

        Each session gets exactly what its own `feed` would do to it (eviction, window-sized
        pieces, sinks, the cache invariant); only the forward is shared, so N sessions decoding a
        token each cost about one decode step's weight reads instead of N. The caches may be at
        different lengths and `ids[b]` of different lengths. Where the lean decoder does not run
        the model (`fast=False` or an unsupported architecture) the sessions are fed one by one:
        the `transformers` forward has no ragged per-session cache.

        The results equal the one-by-one feeds up to float rounding, except on a dynamically
        int8-quantised model, whose products quantise their whole input with one scale: there a
        session's numbers move with the other members of the batch by about int8 rounding, unless
        `per_session_quant` runs those products (and lm_head) once per session, which keeps every
        session independent of the batch at the cost of the shared int8 weight reads.
        """
        if len(caches) != len(ids):
            raise ValueError(f"feed_batch: {len(caches)} caches but {len(ids)} id lists")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("feed_batch: a cache appears more than once")
        toks = [[int(t) for t in seq] for seq in ids]
        if any(not t for t in toks):
            raise ValueError("feed_batch: a session has no tokens to feed")
        if self.fast is None:
            return [self.feed(c, t) for c, t in zip(caches, toks, strict=True)]
        evicted = [0] * len(caches)
        pos = [0] * len(caches)
        with torch.inference_mode():
            while True:  # one round per window-sized piece of the longest feed; usually one
                active = [b for b in range(len(caches)) if pos[b] < len(toks[b])]
                if not active:
                    break
                pieces = []
                for b in active:
                    take, k = self._make_room(caches[b], len(toks[b]) - pos[b])
                    evicted[b] += k
                    pieces.append(toks[b][pos[b] : pos[b] + take])
                    pos[b] += take
                self._forward_batch([caches[b] for b in active], pieces, per_session_quant)
        out = []
        for c, k in zip(caches, evicted, strict=True):
            assert c.logits is not None and c.hidden is not None
            out.append(FeedResult(logits=c.logits, hidden=c.hidden, evicted=k))
        return out

    def rollback(self, c: LmCache, length: int) -> None:
        """Keep only the first `length` cached tokens, e.g. to drop an assistant reply cut by a barge-in.

        The logits and hidden state no longer match the last kept token, so they are cleared; feed at
        least one token (or use `sync`) before reading them again.
        """
        if not 0 <= length <= len(c.ids):
            raise ValueError(f"rollback: length {length} is outside 0..{len(c.ids)}")
        drop = len(c.ids) - length
        if drop:
            with torch.inference_mode():
                c.cache.crop(-drop)
            del c.ids[length:]
        c.logits = None
        c.hidden = None

    def sync(self, c: LmCache, target: Sequence[int]) -> int:
        """Make the cache hold `target`, reusing its longest common prefix; returns the tokens fed.

        `target` is in cache coordinates: after evictions it must start with the kept `c.ids`
        (sinks + window), not with the full conversation. At least one token is re-fed so the
        logits and hidden state are those after target[-1], unless the cache already holds exactly
        `target` with fresh logits, in which case nothing runs.
        """
        tgt = [int(t) for t in target]
        if not tgt:
            raise ValueError("sync: empty target")
        common = _common_prefix(c.ids, tgt)
        if common == len(c.ids) == len(tgt) and c.logits is not None and c.hidden is not None:
            return 0
        keep = min(common, len(tgt) - 1)
        self.rollback(c, keep)
        rest = tgt[keep:]
        self.feed(c, rest)
        return len(rest)

    # -- internals ----------------------------------------------------------------------------

    def _forward(
        self, c: LmCache, toks: list[int], picks: list[int] | None = None, pick_from: int = 0
    ) -> None:
        start = len(c.ids)
        n = len(toks)
        device = self._device()
        if self.fast is not None:
            states = self.fast.forward(c.cache, toks, start)
            last = states[:, -1]
        else:
            positions = torch.arange(start, start + n, device=device)
            out = self.model.model(
                input_ids=torch.tensor([toks], dtype=torch.long, device=device),
                past_key_values=c.cache,
                use_cache=True,
                # newer v5 releases derive the position from the cache and ignore cache_position;
                # earlier ones build the causal mask from it, so pass it consistent with position_ids
                cache_position=positions,
                position_ids=positions.unsqueeze(0),
            )
            states = out.last_hidden_state
            last = states[:, -1]
        # lm_head on the last position only: the vocab projection of prefill positions is wasted
        # (unless the caller wants every position's greedy pick)
        logits = self.model.lm_head(last)
        if picks is not None and pick_from < n:
            if pick_from < n - 1:
                head = self.model.lm_head(states[0, pick_from:-1])
                picks.extend(int(t) for t in torch.argmax(head, dim=-1))
            picks.append(int(torch.argmax(logits[0])))
        c.ids.extend(toks)
        c.logits = logits[0].float()
        c.hidden = last[0].float()
        if c.cache.get_seq_length() != len(c.ids):
            raise RuntimeError(f"cache holds {c.cache.get_seq_length()} tokens but ids has {len(c.ids)}")

    def _make_room(self, c: LmCache, want: int) -> tuple[int, int]:
        """Evict so the next piece of up to `want` tokens fits; (tokens to feed now, tokens evicted).

        A piece is at most the window (no single forward fits more than that after the sinks); an
        overflow evicts the oldest window tokens, rounded up to a multiple of `evict_chunk`."""
        take = min(want, self.window_tokens)
        overflow = len(c.ids) + take - self.capacity
        k = 0
        if overflow > 0:
            evictable = len(c.ids) - min(len(c.ids), self.sink_tokens)
            k = min(evictable, math.ceil(overflow / self.evict_chunk) * self.evict_chunk)
            self._evict(c, k)
            # cannot bind (take <= window and the sinks stay), kept as a guard on the invariant
            take = min(take, self.capacity - len(c.ids))
        return take, k

    def _forward_batch(self, caches: list[LmCache], pieces: list[list[int]], per_session_quant: bool) -> None:
        if len(caches) == 1:  # nothing to share: the single path is the reference and the fastest
            self._forward(caches[0], pieces[0])
            return
        assert self.fast is not None
        hidden = self.fast.forward_batch(
            [c.cache for c in caches],
            pieces,
            [len(c.ids) for c in caches],
            per_session_quant=per_session_quant,
            decode_attention=self.decode_attention,
        )
        last = torch.cat([h[:, -1] for h in hidden])  # [B, hidden]
        head = self.model.lm_head
        if per_session_quant and shares_activation_scale(head):
            logits = torch.cat([head(last[b : b + 1]) for b in range(len(caches))])
        else:
            logits = head(last)  # lm_head on the last position of each session only
        for b, (c, toks) in enumerate(zip(caches, pieces, strict=True)):
            c.ids.extend(toks)
            c.logits = logits[b].float()
            c.hidden = last[b].float()
            if c.cache.get_seq_length() != len(c.ids):
                raise RuntimeError(f"cache holds {c.cache.get_seq_length()} tokens but ids has {len(c.ids)}")

    def _device(self) -> torch.device:
        # dynamically quantized Linear modules hold packed params, so look at the embedding instead
        return self.model.model.embed_tokens.weight.device

    def _evict(self, c: LmCache, k: int) -> None:
        """Drop k tokens right after the sinks and move the rest of the window k positions down."""
        if k <= 0:
            return
        s = min(self.sink_tokens, len(c.ids))
        if isinstance(c.cache, PooledCache):  # moved in place in its slot
            cs, sn = self._rope_shift(k, self._device())
            c.cache.evict(s, k, lambda keys: self._rotate(keys, cs, sn))
        else:
            self._evict_dynamic(c.cache, s, k)
        del c.ids[s : s + k]
        c.evicted += k

    def _evict_dynamic(self, cache: DynamicCache, s: int, k: int) -> None:
        cos = sin = None
        for layer in cache.layers:
            keys, values = layer.keys, layer.values
            if keys is None or keys.numel() == 0:
                continue
            kept = keys[..., s + k :, :]
            if kept.shape[-2]:
                if cos is None:
                    cos, sin = self._rope_shift(k, keys.device)
                kept = self._rotate(kept, cos, sin)
            layer.keys = torch.cat((keys[..., :s, :], kept), dim=-2)
            layer.values = torch.cat((values[..., :s, :], values[..., s + k :, :]), dim=-2)

    def _rope_shift(self, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the model's own RoPE at position k, float32, without attention scaling."""
        rotary = self.model.model.rotary_emb
        # a float32 probe makes rotary_emb return float32; its attention_scaling (YaRN & co.) scales
        # q and k once at encode time and must not be applied again to a stored key
        probe = torch.zeros(1, dtype=torch.float32, device=device)
        cos, sin = rotary(probe, torch.tensor([[k]], device=device))
        scale = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
        return cos[0, 0] / scale, sin[0, 0] / scale

    @staticmethod
    def _rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate RoPE'd keys by -k positions: R(-k) R(p) = R(p - k), since RoPE angles add."""
        rd = cos.shape[-1]  # rotary dims; smaller than head_dim only with partial rotary
        k32 = keys.float()
        rot, rest = k32[..., :rd], k32[..., rd:]
        # R(-a) x = x cos(a) - rotate_half(x) sin(a)
        rot = rot * cos - _rotate_half(rot) * sin
        return torch.cat((rot, rest), dim=-1).to(keys.dtype)
