"""W8A16: 8-bit weights for the tensors a GGUF keeps at 6-8 bits (Q6_K, Q8_0, ...).

llama.cpp's Q4_K_M mixes keep attn_v and ffn_down of half the layers, and the output matrix, at 6 bits
or more because they matter; re-quantizing them to 4 bits was the largest loss of agreement with the
float model. Here they keep 8-bit codes: symmetric, one float32 scale per group of 32 inputs
(weight = code * scale, code in -127..127), 9 bits a weight. On CPU flowedge's row-invariant kernel
(flowedge.kernels.w8a16) computes them, or with FLOWEDGE_ACTIVATIONS=int8 its int8-activation twin over the
same tiles (W8A8, kernels/int8act.py); where neither can run, the weight is held dequantised in bfloat16.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from flowedge.errors import ConfigError
from flowedge.kernels import int8act, w8a16

log = logging.getLogger(__name__)

GROUP_SIZE = 32          # Q8_0's block: its codes carry over exactly
ROW_CHUNK = 4096         # rows quantized at once (bounds the float32 temporaries of a vocabulary-sized matrix)
_QMAX = 127


@dataclass(frozen=True, slots=True)
class PackedInt8:
    """A Linear weight in flowedge's portable W8A16 layout (what checkpoints store).

    qweight: int8 [N, K]; scales: float32 [N, K / group_size]; weight = code * scale."""

    qweight: torch.Tensor
    scales: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1]

    def check(self, what: str) -> None:
        n, k = self.out_features, self.in_features
        ok = (self.qweight.dtype == torch.int8 and self.scales.dtype == torch.float32 and self.qweight.dim() == 2
              and self.scales.dim() == 2 and self.scales.shape[0] == n and self.scales.shape[1] > 0
              and k % self.scales.shape[1] == 0)
        if not ok:
            raise ConfigError(f"{what}: not a W8A16 weight (qweight {tuple(self.qweight.shape)} "
                              f"{self.qweight.dtype}, scales {tuple(self.scales.shape)} {self.scales.dtype})")

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 weight (tests, and devices without the kernel)."""
        n, k, g = self.out_features, self.in_features, self.group_size
        return (self.qweight.float().reshape(n, k // g, g) * self.scales.unsqueeze(-1)).reshape(n, k)


def packable8(out_features: int, in_features: int, group_size: int = GROUP_SIZE) -> str | None:
    """None when a [out, in] weight can be stored W8A16, else why not."""
    if out_features % w8a16.TILE:
        return f"out_features {out_features} not a multiple of {w8a16.TILE}"
    if in_features % group_size:
        return f"in_features {in_features} not a multiple of group size {group_size}"
    return None


def pack_int8(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> PackedInt8:
    """Quantize a [N, K] weight: per group, scale = max |w| / 127 and code = round(w / scale).
    A Q8_0 block (d * q with max |q| = 127) comes back as its own codes and d."""
    parts = []
    for rows in weight.split(ROW_CHUNK):
        n, k = rows.shape
        groups = rows.detach().float().reshape(n, k // group_size, group_size)
        scale = groups.abs().amax(-1) / _QMAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = (groups / scale.unsqueeze(-1)).round().clamp(-_QMAX, _QMAX).to(torch.int8).reshape(n, k)
        parts.append((codes, scale))
    return PackedInt8(torch.cat([p[0] for p in parts]).contiguous(), torch.cat([p[1] for p in parts]).contiguous())


class Int8Linear(nn.Module):
    """Linear with 8-bit group-quantized weights: flowedge's row-invariant CPU kernel where it runs,
    else a bfloat16 copy of the dequantised weight (torch's matmul; not row-invariant)."""
    weight: torch.Tensor        # buffers (registered in __init__)
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int,
                 group_size: int, native: bool, int8: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.native = native   # weight holds the kernel's tiles; else a bfloat16 [N, K] matrix
        self.int8 = native and int8   # the tiles with int8 activations (W8A8), from FLOWEDGE_ACTIVATIONS
        self._weight: w8a16.W8A16Weight | None = None
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    @classmethod
    def from_packed(cls, w: PackedInt8, bias: torch.Tensor | None, device: torch.device | str = "cpu") -> Int8Linear:
        device = torch.device(device)
        bias = None if bias is None else bias.float().to(device)
        if device.type == "cpu" and native_kernel(w):
            return cls(w8a16.prepare(w).tiles, bias, w.in_features, w.out_features, w.group_size, native=True,
                       int8=int8act.use_int8())
        log.info("W8A16 %dx%d without flowedge's kernel: holding it as bfloat16", w.out_features, w.in_features)
        dense = torch.cat([PackedInt8(q, s).dequantize().to(torch.bfloat16)
                           for q, s in zip(w.qweight.split(ROW_CHUNK), w.scales.split(ROW_CHUNK))])
        return cls(dense.to(device), bias, w.in_features, w.out_features, w.group_size, native=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        if not self.native:
            out = F.linear(x.to(torch.bfloat16), self.weight).float()
            out = out if self.bias is None else out + self.bias
            return out.to(x.dtype)
        tiles, weight = self._buffers["weight"], self._weight
        if weight is None or weight.tiles is not tiles:   # first call, or the buffer was replaced
            weight = self._weight = w8a16.W8A16Weight(self.weight, self.out_features, self.in_features, self.group_size)
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        kernel = int8act.linear8 if self.int8 else w8a16.linear
        out = kernel(flat if x.dtype == torch.float32 else flat.float(), weight, self._buffers["bias"])
        out = out if x.dtype == torch.float32 else out.to(x.dtype)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"kernel={('native-int8' if self.int8 else 'native') if self.native else 'bf16'}")


def native_kernel(w: PackedInt8) -> bool:
    """True when flowedge's CPU kernel takes this weight (built here, shape fits)."""
    return w8a16.supports(w.out_features, w.in_features, w.group_size) and w8a16.available()

