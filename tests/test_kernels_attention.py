"""The native attention kernel: row-invariant, thread-invariant, and the same maths as torch's."""
from __future__ import annotations

import pytest
import torch

from flowedge.kernels import attention

MIN = torch.finfo(torch.float32).min


def _case(rows: int = 40, length: int = 300, cap: int = 384, hkv: int = 2, hq: int = 6, d: int = 64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    kbuf, vbuf = torch.randn(hkv, cap, d, generator=gen), torch.randn(hkv, cap, d, generator=gen)
    q = torch.randn(rows, hq, d, generator=gen) * 2
    mask = torch.zeros(rows, length)
    mask[:, length - 50:] = MIN                     # a tree: late columns hidden from most rows
    mask[::3, length - 50:] = 0
    return q, kbuf[:, :length], vbuf[:, :length], mask   # k, v: views into a longer cache buffer


@pytest.fixture(autouse=True)
def _native_only():
    if not attention.available():
        pytest.skip("no C compiler: the native kernel cannot be built here")


def test_matches_torch_attention():
    q, k, v, mask = _case()
    got = attention.attend(q, k, v, mask)
    want = attention._attend_torch(q, k, v, mask)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_is_the_same_whatever_rows_share_the_call(threads):
    torch.set_num_threads(threads)
    try:
        q, k, v, mask = _case()
        full = attention.attend(q, k, v, mask)
        for n in range(1, 33):
            assert torch.equal(attention.attend(q[:n], k, v, mask[:n]), full[:n]), n
        for i in (0, 7, 39):
            assert torch.equal(attention.attend(q[i:i + 1], k, v, mask[i:i + 1]), full[i:i + 1]), i
    finally:
        torch.set_num_threads(1)


def test_thread_count_does_not_change_results():
    q, k, v, mask = _case()
    one = attention.attend(q, k, v, mask)
    torch.set_num_threads(2)
    try:
        assert torch.equal(attention.attend(q, k, v, mask), one)
    finally:
        torch.set_num_threads(1)


def test_a_row_that_sees_nothing_is_zeros_not_nan():
    q, k, v, mask = _case(rows=2)
    mask[1] = MIN
    out = attention.attend(q, k, v, mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out).all()


def test_torch_fallback_when_switched_off(monkeypatch):
    q, k, v, mask = _case(rows=3)
    monkeypatch.setattr(attention, "_lib", None)
    monkeypatch.setattr(attention, "_lib_tried", True)
    got = attention.attend(q, k, v, mask)
    assert torch.allclose(got, attention._attend_torch(q, k, v, mask))


def _separate_steps(q, k, v, rotary, cache, layer, mask):
    """What the decoder does without the fused call: RoPE, the cache write, attention."""
    n, d = rotary.cos.shape
    q = rotary.apply(q.reshape(n, -1, d))
    k = rotary.apply(k.reshape(n, -1, d))
    keys, values = cache.update(k.transpose(0, 1)[None], v.reshape(n, -1, d).transpose(0, 1)[None], layer)
    return attention.attend(q, keys[0], values[0], mask)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_rope_attention_gives_the_bits_of_the_separate_steps(rows, threads):
    """RoPE + cache write + attention in one call: the same output and cache bits, for a cache that grows."""
    from flowedge.models.decoder import Rotary
    from flowedge.models.kv_cache import KVCache

    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(rows)
        hq, hkv, d, past = 6, 2, 64, 23
        qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen) * 3   # q, k, v as strided views of one call
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        rotary = Rotary.at(torch.arange(past, past + rows), d, 1e6, torch.float32)
        mask = torch.zeros(rows, past + rows)
        mask[:, past:] = torch.where(torch.eye(rows, dtype=torch.bool), 0.0, MIN)   # siblings: each sees itself
        caches = [KVCache(range(3, 4), hkv, d, torch.float32, capacity=past) for _ in range(2)]
        for c in caches:
            c.update(*(torch.randn(1, hkv, past, d, generator=torch.Generator().manual_seed(9)),) * 2, 3)
        assert attention.fusable(q, k, v, rotary.cos, rotary.sin)
        fused = attention.rope_attend(q, k, v, rotary.cos, rotary.sin, caches[0], 3, mask)
        plain = _separate_steps(q, k, v, rotary, caches[1], 3, mask)
        assert torch.equal(fused, plain)
        assert caches[0].length == caches[1].length == past + rows and caches[0].capacity > past
        empty = torch.empty(1, hkv, 0, d)
        (k0, v0), (k1, v1) = (c.update(empty, empty, 3) for c in caches)
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    finally:
        torch.set_num_threads(1)


def test_fused_call_declines_what_it_cannot_take():
    x = torch.randn(2, 64)
    assert attention.fusable(x, x, x)
    assert not attention.fusable(x.double(), x, x)
    assert not attention.fusable(x.t(), x, x)                          # rows not contiguous
    assert not attention.fusable(x.requires_grad_(), x, x)             # no backward through the C call
    with torch.no_grad():
        assert attention.fusable(x, x, x)
