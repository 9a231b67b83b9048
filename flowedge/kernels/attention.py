"""Row-invariant attention (kernels/attention.c) called through ctypes, with a torch fallback.

`attend(q, k, v, mask)` gives every query row the same result whatever rows share the call: that is
what keeps T=0 speculation token-identical to `ar` (see attention.c). Where no C compiler is at hand
the torch fallback runs the same maths with torch's matmuls (correct, not row-invariant) and says so
once in the log.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
from pathlib import Path

import torch

from flowedge.kernels import build

log = logging.getLogger(__name__)

_SIGNATURE = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5 + [ctypes.c_long, ctypes.c_float, ctypes.c_int]
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_FUSED_SIGNATURE = [_P, _L, _P, _L, _P, _L, _P, _P, _P, _P, _L, _I, _P, _P, _I, _I, _I, _I, ctypes.c_float, _I]
FUSED_ENV = "FLOWEDGE_FUSED_ATTENTION"   # "0": RoPE, cache write and attention as separate steps (A/B)
SOURCE = Path(__file__).with_name("attention.c")
_lib = None
_lib_tried = False


def _native():
    global _lib, _lib_tried
    if not _lib_tried:
        _lib_tried = True
        built = build.load(SOURCE)
        if built is not None:
            built.lib.flowedge_attend_f32.argtypes = _SIGNATURE
            built.lib.flowedge_attend_f32.restype = ctypes.c_int
            built.lib.flowedge_rope_attend_f32.argtypes = _FUSED_SIGNATURE
            built.lib.flowedge_rope_attend_f32.restype = ctypes.c_int
            _lib = built.lib
    return _lib


def available() -> bool:
    return _native() is not None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [n, Hq, D]; k, v [Hkv, L, D] (views into a cache: the L axis may be a prefix of a longer
    buffer, rows of D contiguous); mask [n, L] additive (0 allowed, <= -1e30 masked) -> [n, Hq, D]."""
    n, hq, d = q.shape
    hkv, length = k.shape[0], k.shape[1]
    lib = _native() if q.dtype == torch.float32 else None
    if lib is None or not _cache_view_ok(k, v, d):
        return _attend_torch(q, k, v, mask)
    q = q.contiguous()
    mask = mask.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    rc = lib.flowedge_attend_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), out.data_ptr(),
                                 n, hq, hkv, d, length, k.stride(0), 1.0 / math.sqrt(d), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"native attention failed ({rc}) for q {tuple(q.shape)}, k {tuple(k.shape)}")
    return out


def fused_wanted() -> bool:
    """Whether a model loading now should run RoPE + cache write + attention as one native call."""
    return os.environ.get(FUSED_ENV, "1") != "0" and available()


def fusable(*tensors: torch.Tensor) -> bool:
    """Whether rope_attend takes these q, k, v, cos and sin (with a float32 KVCache): float32 CPU tensors
    with contiguous rows, nothing to differentiate (the call has no backward), not under torch.compile."""
    if _native() is None or torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return not grad and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1
                            for t in tensors)


def rope_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache, layer: int, mask: torch.Tensor) -> torch.Tensor:
    """RoPE on q and k, k and v appended to `cache` (a KVCache) at `layer`, attention over it: one call,
    bit-identical to Rotary.apply + cache.update + attend. q [n, Hq * D], k, v [n, Hkv * D] (rows may be
    strided views, each row contiguous); cos, sin [n, D]; mask [n, length + n] -> [n, Hq, D].
    Only where `fusable` says so."""
    lib = _native()
    n, d = cos.shape
    hq, hkv = q.shape[1] // d, k.shape[1] // d
    kbuf, vbuf, at = cache.reserve(layer, n)
    cos, sin, mask = cos.contiguous(), sin.contiguous(), mask.to(torch.float32).contiguous()
    out = torch.empty(n, hq, d)
    rc = lib.flowedge_rope_attend_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                                      v.stride(0), cos.data_ptr(), sin.data_ptr(), kbuf.data_ptr(), vbuf.data_ptr(),
                                      kbuf.stride(1), at, mask.data_ptr(), out.data_ptr(), n, hq, hkv, d,
                                      1.0 / math.sqrt(d), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"native fused attention failed ({rc}) for q {tuple(q.shape)}, k {tuple(k.shape)}")
    return out


def _cache_view_ok(k: torch.Tensor, v: torch.Tensor, d: int) -> bool:
    return (k.dtype == v.dtype == torch.float32 and k.stride() == v.stride() and k.stride(2) == 1
            and k.stride(1) == d and k.shape == v.shape)


def _attend_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[0]
    qh = q.transpose(0, 1)                                        # [Hq, n, D]
    kh = k.repeat_interleave(group, 0).to(q.dtype)                # [Hq, L, D]
    vh = v.repeat_interleave(group, 0).to(q.dtype)
    scores = qh @ kh.transpose(1, 2) / math.sqrt(q.shape[-1]) + mask.to(q.dtype)
    return (torch.softmax(scores.float(), -1).to(q.dtype) @ vh).transpose(0, 1)
