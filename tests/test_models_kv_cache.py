"""KVCache: growth by doubling, compaction by index, and use across inference-mode boundaries."""
from __future__ import annotations

import torch

from flowedge.models.kv_cache import KVCache


def _kv(n: int, start: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 2, n, 3).contiguous()


def test_growth_keeps_entries_and_keep_reorders():
    cache = KVCache(range(2, 4), n_kv_heads=2, head_dim=3, dtype=torch.float32, capacity=4)
    for layer in (2, 3):
        k, v = cache.update(_kv(6, 0), _kv(6, 100), layer)
        assert k.shape[2] == 6 and cache.capacity >= 6
    cache.keep(torch.tensor([0, 1, 4, 2]))
    assert cache.length == 4
    k, v = cache.update(_kv(1, 50), _kv(1, 150), 2)
    assert k[0, 0, :, 0].tolist() == [0, 1, 4, 2, 50] and v[0, 0, :, 0].tolist() == [100, 101, 104, 102, 150]


def test_a_cache_regrown_in_inference_mode_can_be_pruned_outside_it():
    """Regression: the daemon and the simulator apply prune sets outside a forward's inference mode."""
    cache = KVCache(range(1), n_kv_heads=2, head_dim=3, dtype=torch.float32, capacity=2)
    with torch.inference_mode():
        cache.update(_kv(5, 0), _kv(5, 0), 0)   # regrows: the new buffers are inference tensors
    cache.keep(torch.tensor([4, 0]))
    cache.truncate(1)
    with torch.inference_mode():
        k, _ = cache.update(_kv(1, 9), _kv(1, 9), 0)
    assert k[0, 0, :, 0].tolist() == [4, 9]
