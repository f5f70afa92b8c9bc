"""One preallocated key/value store for many sessions' caches (the GPU's decode path, issue 22).

A `DynamicCache` grows each layer with `torch.cat` and a batched step attends session by session, so a
decode step for N sessions costs ~3 kernel launches per session per layer: on an H200, 53 ms a step at
32 sessions for a 0.5 B model, nearly all of it launches (docs/operations.md, "On a GPU"). Here every
layer's keys and values live in one tensor [slots, kv_heads, capacity, head_dim] and a session owns a
slot, so a batched step writes every session's new rows with one indexed copy per layer and attends with
one masked call per layer (`FastDecoder.forward_batch`), whatever N is.

`PooledCache` stands in for the `DynamicCache` that `CachedLM` keeps per session: the same per-layer
`update` / `keys` / `values`, `crop` and `get_seq_length`, plus `evict` (the sinks + window move, done
in place) and a deep copy that takes a fresh slot. All layers hold the same number of tokens, so the
length is kept once per cache. A slot returns to the pool when its cache is garbage collected. The pool
is allocated once, on first use, and never grows (tensors that forward passes may hold are never moved):
when it is full, `CachedLM.new` hands out plain `DynamicCache`s, which batch the old way.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch


class KvPool:
    """`slots` sessions' keys and values, `layers` x [slots, kv_heads, capacity, head_dim] each."""

    def __init__(
        self,
        slots: int,
        layers: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if min(slots, layers, kv_heads, capacity, head_dim) < 1:
            raise ValueError("KvPool: every size must be >= 1")
        self.slots, self.layers, self.capacity = slots, layers, capacity
        self.shape = (slots, kv_heads, capacity, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    def _allocate(self) -> None:
        z = lambda: torch.zeros(self.shape, dtype=self.dtype, device=self.device)  # noqa: E731
        self.keys = [z() for _ in range(self.layers)]
        self.values = [z() for _ in range(self.layers)]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def slot_bytes(self) -> int:
        """Bytes one session's slot reserves (all layers, keys and values)."""
        return 2 * self.layers * math.prod(self.shape[1:]) * torch.empty((), dtype=self.dtype).element_size()

    def new_cache(self) -> PooledCache | None:
        """A cache in a free slot (empty), or None when every slot is taken."""
        with self._lock:
            if not self._free:
                return None
            if not self.keys:
                self._allocate()
            slot = self._free.pop()
        cache = PooledCache(self, slot)
        weakref.finalize(cache, self._release, slot)
        return cache

    def _release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


class PooledLayer:
    """One layer of a `PooledCache`, with the parts of `DynamicLayer` that the decoders use."""

    def __init__(self, cache: PooledCache, index: int) -> None:
        # a weak reference: the cache holds its layers, and a cycle would keep a session's slot taken until
        # the cycle collector's next full pass (minutes in a server), so the pool ran out of slots
        self._cache = weakref.ref(cache)
        self.index = index

    @property
    def cache(self) -> PooledCache:
        c = self._cache()
        if c is None:
            raise RuntimeError("PooledLayer: its PooledCache is gone (a layer used after its cache)")
        return c

    @property
    def keys(self) -> torch.Tensor:
        c = self.cache
        return c.pool.keys[self.index][c.slot : c.slot + 1, :, : c.length]

    @property
    def values(self) -> torch.Tensor:
        c = self.cache
        return c.pool.values[self.index][c.slot : c.slot + 1, :, : c.length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append [1, kv_heads, n, head_dim] rows; the layer's keys and values up to them. The cache's
        length moves on once the last layer has taken the same rows."""
        c = self.cache
        n = key_states.shape[-2]
        end = c.length + n
        if end > c.pool.capacity:
            raise RuntimeError(f"PooledCache: {end} tokens exceed the pool's capacity {c.pool.capacity}")
        k, v = c.pool.keys[self.index], c.pool.values[self.index]
        k[c.slot, :, c.length : end] = key_states[0]
        v[c.slot, :, c.length : end] = value_states[0]
        out = k[c.slot : c.slot + 1, :, :end], v[c.slot : c.slot + 1, :, :end]
        if self.index == c.pool.layers - 1:
            c.length = end
        return out

    def get_seq_length(self) -> int:
        return self.cache.length


class PooledCache:
    """A session's cache in a `KvPool` slot (see the module docstring)."""

    def __init__(self, pool: KvPool, slot: int) -> None:
        self.pool, self.slot, self.length = pool, slot, 0
        self.layers = [PooledLayer(self, i) for i in range(pool.layers)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """`DynamicCache.crop`: keep the first max_length tokens (a negative value drops that many)."""
        if max_length < 0:
            max_length = self.length + max_length
        self.length = max(0, min(self.length, max_length))

    def advance(self, n: int) -> None:
        """Count n rows that a batched forward wrote straight into the pool (`FastDecoder.forward_batch`)."""
        if self.length + n > self.pool.capacity:
            raise RuntimeError(
                f"PooledCache: {self.length + n} tokens exceed the capacity {self.pool.capacity}"
            )
        self.length += n

    def nbytes(self) -> int:
        return self.pool.slot_bytes()

    def evict(self, s: int, k: int, rotate: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Drop the k tokens after the first s, moving the rest down in place; `rotate` re-positions keys."""
        end = self.length
        if k <= 0 or end <= s:
            return
        k = min(k, end - s)
        for keys, values in zip(self.pool.keys, self.pool.values, strict=True):
            kept_k = keys[self.slot, :, s + k : end].clone()
            kept_v = values[self.slot, :, s + k : end].clone()
            if kept_k.shape[-2]:
                keys[self.slot, :, s : end - k] = rotate(kept_k)
                values[self.slot, :, s : end - k] = kept_v
        self.length = end - k

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A fork takes a slot of its own (or, with the pool full, becomes a plain DynamicCache)."""
        other = self.pool.new_cache()
        n = self.length
        if other is None:
            from transformers import DynamicCache

            dyn = DynamicCache()
            for i, layer in enumerate(self.layers):
                dyn.update(layer.keys.clone(), layer.values.clone(), i)
            return dyn
        for keys, values in zip(self.pool.keys, self.pool.values, strict=True):
            keys[other.slot, :, :n] = keys[self.slot, :, :n]
            values[other.slot, :, :n] = values[self.slot, :, :n]
        other.length = n
        return other
