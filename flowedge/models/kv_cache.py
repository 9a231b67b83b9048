"""One KV cache class for a layer range: preallocated, compacts by index in place, never re-concatenates.

The decoder's attention (models/decoder.py) calls `update(k, v, layer_idx)` and reads the returned views,
so this class is all the cache a stage needs. Sized once for the context a request may reach, a steady
decode step allocates nothing; a request that outgrows it doubles it (logged by nobody: it is rare). Entries
are kept in *cache order*; positions were already applied (rotary) when the keys were written, so reordering
or dropping entries is safe as long as the attention mask is built over the same order.
"""
from __future__ import annotations

from typing import Protocol

import torch


class CacheLike(Protocol):
    """What a stage's bookkeeping asks of a request's cache: KVCache, or a stand-in holding lengths only
    (the simulator's oracle verification)."""

    @property
    def length(self) -> int: ...

    def keep(self, idx: torch.Tensor) -> None: ...

    def truncate(self, length: int) -> None: ...


class KVCache:
    def __init__(self, layer_ids: range, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 capacity: int = 256, device: torch.device | str = "cpu") -> None:
        self.layer_ids = layer_ids
        self._first = layer_ids.start
        shape = (1, n_kv_heads, capacity, head_dim)
        self._k = {i: torch.empty(shape, dtype=dtype, device=device) for i in layer_ids}
        self._v = {i: torch.empty(shape, dtype=dtype, device=device) for i in layer_ids}
        self._len = {i: 0 for i in layer_ids}

    @property
    def length(self) -> int:
        """Entries held (equal on every layer between forwards)."""
        return self._len[self._first] if len(self.layer_ids) else 0

    @property
    def dtype(self) -> torch.dtype:
        return self._k[self._first].dtype

    @property
    def capacity(self) -> int:
        return self._k[self._first].shape[2] if len(self.layer_ids) else 0

    def _grow(self, layer: int, needed: int) -> None:
        old_k, old_v = self._k[layer], self._v[layer]
        cap = max(needed, 2 * old_k.shape[2])
        n = self._len[layer]
        self._k[layer] = torch.empty((*old_k.shape[:2], cap, old_k.shape[3]), dtype=old_k.dtype, device=old_k.device)
        self._v[layer] = torch.empty_like(self._k[layer])
        self._k[layer][:, :, :n] = old_k[:, :, :n]
        self._v[layer][:, :, :n] = old_v[:, :, :n]

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: [1, H_kv, n, D] -> views [1, H_kv, length + n, D]
        n0, n = self._len[layer_idx], k.shape[2]
        if n0 + n > self._k[layer_idx].shape[2]:
            self._grow(layer_idx, n0 + n)
        self._k[layer_idx][:, :, n0:n0 + n] = k
        self._v[layer_idx][:, :, n0:n0 + n] = v
        self._len[layer_idx] = n0 + n
        return self._k[layer_idx][:, :, :n0 + n], self._v[layer_idx][:, :, :n0 + n]

    def reserve(self, layer_idx: int, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for n new entries that the caller writes itself (the fused attention kernel): the whole
        buffers [1, H_kv, capacity, D] and the first new column; the length already counts them."""
        n0 = self._len[layer_idx]
        if n0 + n > self._k[layer_idx].shape[2]:
            self._grow(layer_idx, n0 + n)
        self._len[layer_idx] = n0 + n
        return self._k[layer_idx], self._v[layer_idx], n0

    @torch.inference_mode()
    def keep(self, idx: torch.Tensor) -> None:
        """Keep entries `idx` (cache positions, in the order given) and drop the rest.

        Runs in inference mode: buffers regrown during a forward are inference tensors, and only
        inference mode may update those in place (prune sets arrive outside any forward)."""
        idx = idx.to(torch.long)
        m = idx.numel()
        for i in self.layer_ids:
            self._k[i][:, :, :m] = self._k[i].index_select(2, idx)
            self._v[i][:, :, :m] = self._v[i].index_select(2, idx)
            self._len[i] = m

    def truncate(self, length: int) -> None:
        """Drop every entry at or after `length` (no copy)."""
        for i in self.layer_ids:
            self._len[i] = min(self._len[i], length)

    def nbytes(self) -> int:
        """Bytes of live entries (for status and memory reports)."""
        if not len(self.layer_ids):
            return 0
        k = self._k[self._first]
        per_entry = k.shape[1] * k.shape[3] * k.element_size() * 2
        return per_entry * self.length * len(self.layer_ids)
