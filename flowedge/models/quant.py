"""Weight-only 4-bit quantization backends, chosen at run time per device.

- none: keep the weights as loaded.
- nf4:  bitsandbytes Linear4bit (NF4, blocksize 64), CUDA and CPU.
- int4: group-wise asymmetric 4-bit (W4A16): on CPU flowedge's row-invariant kernel (flowedge.kernels,
        built with the system C compiler on first use), else torch's tinygemm int4 kernels. With
        FLOWEDGE_ACTIVATIONS=int8 the CPU kernel takes int8 activations instead (W4A8, kernels/int8act.py).
Only nn.Linear layers are replaced; embeddings and lm_head stay as they are unless asked.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from flowedge.errors import BackendUnavailable, ConfigError
from flowedge.kernels import int8act, w4a16

log = logging.getLogger(__name__)

BACKENDS = ("none", "nf4", "int4")
DEFAULT_GROUP_SIZE = 32
GROUP_SIZES = (32, 64, 128, 256)
NF4_OUT_MULTIPLE = 32  # bnb's packed CPU layout (AVX512-BF16 path) needs out_features % 32 == 0
INT4_CPU_N_MULTIPLE = 16
INT4_CUDA_N_MULTIPLE = 8
ROW_CHUNK = 4096   # rows quantized or repacked at once (a multiple of the CPU kernel's 64-row blocks)


@dataclass(frozen=True, slots=True)
class QuantReport:
    backend: str
    quantized: int
    skipped: list[str] = field(default_factory=list)  # "name: reason"
    bytes_before: int = 0  # all targeted Linear layers, skipped ones included
    bytes_after: int = 0


def _module_bytes(module: nn.Module) -> int:
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    total = sum(t.numel() * t.element_size() for t in tensors)
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    if state is not None:  # bnb keeps absmax (and nested stats) outside the parameters
        total += sum(v.numel() * v.element_size() for v in state.as_dict(packed=False).values()
                     if isinstance(v, torch.Tensor))
    return total


# ---------------------------------------------------------------- int4 (torch tinygemm)

def quantize_int4_weight(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric per-group 4-bit codes and the kernel's scales-and-zeros table.

    weight: [N, K] -> codes: [N, K] int32 in 0..15, scales_zeros: [K / group_size, N, 2] float32.
    The kernel dequantises as (code - 8) * scale + zero, so zero = min + 8 * scale.
    """
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low = groups.amin(-1, keepdim=True)
    high = groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)
    codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = low + 8 * scale
    scales_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return codes, scales_zeros


def int4_skip_reason(linear: nn.Linear, group_size: int) -> str | None:
    n, k = linear.out_features, linear.in_features
    if linear.weight.device.type == "cuda":
        if n % INT4_CUDA_N_MULTIPLE:
            return f"out_features {n} not a multiple of {INT4_CUDA_N_MULTIPLE}"
        if _inner_k_tiles(k) is None:
            return f"in_features {k} not a multiple of 32"
    elif n % INT4_CPU_N_MULTIPLE:
        return f"out_features {n} not a multiple of {INT4_CPU_N_MULTIPLE}"
    if k % group_size:
        return f"in_features {k} not a multiple of group size {group_size}"
    return None


def _inner_k_tiles(k: int) -> int | None:
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


@dataclass(frozen=True, slots=True)
class PackedInt4:
    """A Linear weight in flowedge's portable W4A16 layout (what shard files store).

    qweight: uint8 [N, K / 2], two codes per byte, the even column in the low nibble;
    scales, zeros: bfloat16 [N, K / group_size]; weight = (code - 8) * scale + zero.
    bfloat16 because both torch kernels (CPU and CUDA tinygemm) take their table in bfloat16: the
    stored numbers are the ones every device computes with. Repacked per device at load.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 2

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1]

    def check(self, what: str) -> None:
        n, k = self.out_features, self.in_features
        ok = (self.qweight.dtype == torch.uint8 and self.scales.dtype == self.zeros.dtype == torch.bfloat16
              and self.scales.shape == self.zeros.shape and self.scales.shape[0] == n
              and self.scales.shape[1] > 0 and k % self.scales.shape[1] == 0)
        if not ok:
            raise ConfigError(f"{what}: not a W4A16 weight (qweight {tuple(self.qweight.shape)} "
                              f"{self.qweight.dtype}, scales {tuple(self.scales.shape)} {self.scales.dtype})")

    def codes(self) -> torch.Tensor:
        """[N, K] int32 codes 0..15."""
        return unpack_codes(self.qweight)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 weight (tests, and devices without an int4 kernel)."""
        n, k, g = self.out_features, self.in_features, self.group_size
        codes = (self.codes() - 8).float().reshape(n, k // g, g)
        return (codes * self.scales.float().unsqueeze(-1) + self.zeros.float().unsqueeze(-1)).reshape(n, k)


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> int32 [N, K] codes, the even column from the low nibble."""
    # Interleave in uint8, widen once (7x faster than widening first: this runs on every stage load).
    return torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1).to(torch.int32)


def packable(out_features: int, in_features: int, group_size: int) -> str | None:
    """None when a [out, in] weight can be stored packed for every kernel (CPU and CUDA), else why not."""
    if out_features % INT4_CPU_N_MULTIPLE:
        return f"out_features {out_features} not a multiple of {INT4_CPU_N_MULTIPLE}"
    if _inner_k_tiles(in_features) is None:
        return f"in_features {in_features} not a multiple of 32"
    if in_features % group_size:
        return f"in_features {in_features} not a multiple of group size {group_size}"
    return None


def pack_int4(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> PackedInt4:
    """Quantize a [N, K] weight into the portable layout (one place, so a shard packed at split time and
    a layer quantized at load time hold the very same numbers). Rows are quantized independently, so
    a big matrix (a vocabulary-sized lm_head) goes ROW_CHUNK rows at a time in float32."""
    parts = []
    for rows in weight.split(ROW_CHUNK):
        codes, scales_zeros = quantize_int4_weight(rows, group_size)
        qweight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        table = scales_zeros.to(torch.bfloat16).transpose(0, 1)   # [N, K/G, 2]
        parts.append((qweight, table[..., 0], table[..., 1]))
    return PackedInt4(*(torch.cat(ts).contiguous() for ts in zip(*parts)))


class Int4Linear(nn.Module):
    """Linear with 4-bit group-quantized weights.

    CPU: flowedge's row-invariant native kernel (`flowedge.kernels.w4a16`) when it builds here, else
    torch's int4pack matmul (not row-invariant: a row's result depends on the rows sharing the call).
    CUDA: torch's tinygemm int4pack matmul. `int8`: the native tiles computed with int8 activations
    (`kernels.int8act`, W4A8), chosen at construction from FLOWEDGE_ACTIVATIONS."""
    packed: torch.Tensor        # buffers (registered in __init__)
    bias: torch.Tensor | None

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor | None, bias: torch.Tensor | None,
                 in_features: int, out_features: int, group_size: int, native: bool = False,
                 int8: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.native = native   # packed holds the native kernel's tiles (scales and zeros inside)
        self.int8 = native and int8   # the native tiles with int8 activations (W4A8)
        self._weight: w4a16.W4A16Weight | None = None   # a view of `packed` for the kernel, made on first use
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Linear:
        reason = int4_skip_reason(linear, group_size)
        if reason is not None:
            raise ConfigError(f"cannot int4-quantize this Linear: {reason}")
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls.from_packed(pack_int4(linear.weight.detach(), group_size), bias, linear.weight.device)

    @classmethod
    def from_packed(cls, w: PackedInt4, bias: torch.Tensor | None,
                    device: torch.device | str = "cpu") -> Int4Linear:
        """Repack the portable layout for this device's kernel (CPU native: 16-output tiles; CPU int4pack:
        int32 codes in; CUDA: two codes a byte, high nibble first). Never a float weight."""
        device = torch.device(device)
        if device.type == "cpu" and _native_kernel(w):
            tiles = w4a16.prepare(w).tiles
            bias = None if bias is None else bias.float()
            return cls(tiles, None, bias, w.in_features, w.out_features, w.group_size, native=True,
                       int8=int8act.use_int8())
        if device.type == "cuda":
            q = w.qweight.to(device)
            as_bytes = ((q & 15) << 4) | (q >> 4)   # the CUDA kernel wants the even column high
            packed = torch.ops.aten._convert_weight_to_int4pack(as_bytes, _inner_k_tiles(w.in_features))
        else:   # the CPU packing is local to blocks of 64 rows: ROW_CHUNK rows of int32 codes at a time
            packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                unpack_codes(q), 1) for q in w.qweight.split(ROW_CHUNK)])
        # bf16 tables and activations: on CPU the fp32/fp16 variants of the kernel are a slow
        # path (measured 15x slower at 1 token, 40x at 16 tokens on AVX2); CUDA needs bf16.
        scales_zeros = torch.stack([w.scales, w.zeros], dim=-1).transpose(0, 1).contiguous().to(device)
        return cls(packed, scales_zeros, bias, w.in_features, w.out_features, w.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        if self.native:
            return self._native_forward(x)
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if flat.device.type == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(flat, self.packed, self.group_size, self.scales_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.packed, self.group_size, self.scales_zeros)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _native_forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each torch call here costs ~1-2 us, as much as the kernel on a small layer: skip the no-ops.
        tiles, weight = self._buffers["packed"], self._weight
        if weight is None or weight.tiles is not tiles:   # first call, or the buffer was replaced
            weight = self._weight = w4a16.W4A16Weight(self.packed, self.out_features, self.in_features, self.group_size)
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        kernel = int8act.linear4 if self.int8 else w4a16.linear
        out = kernel(flat if x.dtype == torch.float32 else flat.float(), weight, self._buffers["bias"])
        out = out if x.dtype == torch.float32 else out.to(x.dtype)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = ("native-int8" if self.int8 else "native") if self.native else "int4pack"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, kernel={kernel}")


def _native_kernel(w: PackedInt4) -> bool:
    """True when flowedge's CPU kernel takes this weight (it is built here and the shape fits)."""
    return w4a16.supports(w.out_features, w.in_features, w.group_size) and w4a16.available()


# ---------------------------------------------------------------- nf4 (bitsandbytes)

def nf4_skip_reason(linear: nn.Linear) -> str | None:
    if linear.out_features % NF4_OUT_MULTIPLE:
        return f"out_features {linear.out_features} not a multiple of {NF4_OUT_MULTIPLE}"
    return None


def nf4_linear(linear: nn.Linear, compute_dtype: torch.dtype) -> nn.Module:
    import bitsandbytes as bnb

    device = linear.weight.device
    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          compute_dtype=compute_dtype, quant_type="nf4", device="meta")
    q.weight = bnb.nn.Params4bit(linear.weight.detach().to("cpu", torch.float32).clone(),
                                 requires_grad=False, quant_type="nf4")
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.detach().to(torch.float32).clone(), requires_grad=False)
    # Params4bit quantizes when moved to its device (CPU included).
    return q.to(device)


# ---------------------------------------------------------------- availability and the entry point

@functools.lru_cache(maxsize=None)
def _probe(backend: str, device: str) -> str | None:
    """None when a tiny layer quantizes and runs correctly on `device`, else the reason."""
    if backend == "none":
        return None
    if backend == "nf4":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as exc:
            return f"bitsandbytes is not installed ({exc})"
    torch_device = torch.device(device)
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(128, 64).to(torch_device)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 128, generator=generator) * 0.05)
        x = torch.randn(2, 128, generator=generator).to(torch_device)
        try:
            q = nf4_linear(linear, torch.float32) if backend == "nf4" else Int4Linear.from_linear(linear)
            err = ((q(x).float() - linear(x)).norm() / linear(x).norm()).item()
        except Exception as exc:  # noqa: BLE001 - any kernel failure means "not usable here"
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return None if err < 0.25 else f"kernel gives wrong results here (relative error {err:.2f})"


def available_backends(device: str = "cpu") -> dict[str, str | None]:
    """Backend -> None when usable on `device`, else the reason it is not."""
    return {b: _probe(b, str(torch.device(device))) for b in BACKENDS}


def _require(backend: str, device: str) -> None:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown quantization backend {backend!r}; choose from {', '.join(BACKENDS)}")
    reason = _probe(backend, device)
    if reason is None:
        return
    other = "int4" if backend == "nf4" else "nf4" if _probe("nf4", device) is None else "none"
    needs = "bitsandbytes with a working kernel" if backend == "nf4" else "torch int4pack kernels"
    raise BackendUnavailable(f"{backend} needs {needs} on {device} ({reason}); use --quant {other}")


def default_backend(device: str = "cpu") -> str:
    """The fastest usable backend at decode batch sizes, measured (see tools/bench_quant.py)."""
    order = ("nf4", "int4") if torch.device(device).type == "cuda" else ("int4", "nf4")
    for backend in order:
        if _probe(backend, str(torch.device(device))) is None:
            return backend
    return "none"


def quantize_module(
    module: nn.Module,
    backend: str,
    *,
    compute_dtype: torch.dtype = torch.float32,
    group_size: int = DEFAULT_GROUP_SIZE,
    skip_names: Iterable[str] = ("lm_head",),
) -> QuantReport:
    """Replace every nn.Linear under `module` in place; unsupported shapes are kept and reported."""
    if group_size not in GROUP_SIZES:
        raise ConfigError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")
    if isinstance(module, nn.Linear):
        raise ConfigError("quantize_module needs a container of Linear layers, not a bare Linear")
    # bnb's Linear4bit subclasses nn.Linear: a uint8 weight marks a layer already quantized.
    targets = [(name, m) for name, m in module.named_modules()
               if isinstance(m, nn.Linear) and m.weight.is_floating_point()
               and not _skipped_name(name, skip_names)]
    if backend == "none":
        size = sum(_module_bytes(m) for _, m in targets)
        return QuantReport("none", 0, [], size, size)
    device = str(targets[0][1].weight.device) if targets else "cpu"
    _require(backend, device)
    quantized, skipped, before, after = 0, [], 0, 0
    for name, linear in targets:
        before += _module_bytes(linear)
        reason = nf4_skip_reason(linear) if backend == "nf4" else int4_skip_reason(linear, group_size)
        if reason is not None:
            skipped.append(f"{name}: {reason}")
            after += _module_bytes(linear)
            continue
        with torch.no_grad():
            new = nf4_linear(linear, compute_dtype) if backend == "nf4" else Int4Linear.from_linear(linear, group_size)
        after += _module_bytes(new)
        module.set_submodule(name, new)
        quantized += 1
    if skipped:
        log.info("%s: left %d Linear layers unquantized: %s", backend, len(skipped), "; ".join(skipped))
    return QuantReport(backend, quantized, skipped, before, after)


def draft_backend(device: str = "cpu") -> str:
    """Node 0's draft model: int4 first on every device. Draft calls carry 10-16 tokens, where
    bitsandbytes dequantizes to fp16 (slower than no quantization); tinygemm streams the 4-bit codes."""
    for backend in ("int4", "nf4"):
        if _probe(backend, str(torch.device(device))) is None:
            return backend
    return "none"


def _skipped_name(name: str, skip_names: Iterable[str]) -> bool:
    return any(part in skip_names for part in name.split("."))


def fuse_native(linears: list[nn.Module]) -> Int4Linear | None:
    """One native Int4Linear computing several that read the same input (q/k/v, gate/up), or None.

    The native tiles of a weight are independent 16-output blocks, so stacking them along N is the fused
    weight; every output column is computed exactly as in its own layer (same bits), in one call."""
    native = [m for m in linears if isinstance(m, Int4Linear) and m.native]
    if len(linears) < 2 or len(native) != len(linears):
        return None
    first = native[0]
    if any(m.in_features != first.in_features or m.group_size != first.group_size or m.int8 != first.int8
           for m in native):
        return None
    biases = [m.bias for m in native]
    bias = (torch.cat([torch.zeros(m.out_features) if b is None else b.float() for m, b in zip(native, biases)])
            if any(b is not None for b in biases) else None)
    return Int4Linear(torch.cat([m.packed for m in native]), None, bias, first.in_features,
                      sum(m.out_features for m in native), first.group_size, native=True, int8=first.int8)
