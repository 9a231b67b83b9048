"""Device and link profiles for the cost model (the simulator, the planner, the head's tree sizing), read
from `device_profiles/*.toml` at the repository's top (they ship inside the wheel, so an installed
flowedge finds them anywhere: flowedge/shipped.py).

The numbers live in data files (with their sources) rather than in code, so a person can add a
board or re-calibrate one without touching the cost model.
"""
from __future__ import annotations

import logging
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowedge.errors import ConfigError
from flowedge.shipped import shipped_dir

log = logging.getLogger(__name__)

PROFILES_ENV = "FLOWEDGE_PROFILES"
LINKS_FILE = "links.toml"
TESTBED_PREFIX = "testbed-"   # the testbed presets' entries in LINKS_FILE


@dataclass(frozen=True, slots=True)
class ComputePath:
    """One software path (runtime + weight format) on a device: how well it uses the hardware."""

    name: str
    bytes_per_param: float  # weight bytes moved per parameter per forward
    eta_bw: float  # achieved fraction of peak memory bandwidth
    eta_flops_small: float  # achieved fraction of peak FLOPS at <= 128 tokens
    eta_flops_large: float  # ... at >= 512 tokens (interpolated between)
    overhead_fwd_s: float  # fixed cost per forward call (launches, Python, sync)
    overhead_layer_s: float  # fixed cost per decoder layer per forward
    act_bytes: float = 2.0  # bytes per activation / KV element (fp16 = 2, fp32 = 4)
    sample_s_per_mvocab: float = 0.0  # per lm_head call: logits copy-out + sampling, per 1M vocab
    head_path: str | None = None  # path the lm_head runs on when this one is chosen (bnb skips it)
    token_tile: int = 0  # tokens per pass over the weights (tinygemm: 16); 0 = one pass for any count
    unpack_s_per_gb: float = 0.0  # seconds per GB of weights unpacked in line, overlapping neither bound

    def __post_init__(self) -> None:
        positive = {"bytes_per_param": self.bytes_per_param, "act_bytes": self.act_bytes}
        fractions = {
            "eta_bw": self.eta_bw,
            "eta_flops_small": self.eta_flops_small,
            "eta_flops_large": self.eta_flops_large,
        }
        overheads = {
            "overhead_fwd_s": self.overhead_fwd_s,
            "overhead_layer_s": self.overhead_layer_s,
            "sample_s_per_mvocab": self.sample_s_per_mvocab,
            "unpack_s_per_gb": self.unpack_s_per_gb,
        }
        if self.token_tile < 0:
            raise ConfigError(f"path {self.name}: token_tile must be >= 0, got {self.token_tile}")
        for key, value in positive.items():
            if not value > 0:
                raise ConfigError(f"path {self.name}: {key} must be > 0, got {value}")
        for key, value in fractions.items():
            if not 0 < value <= 1:
                raise ConfigError(f"path {self.name}: {key} must be in (0, 1], got {value}")
        for key, value in overheads.items():
            if not value >= 0:
                raise ConfigError(f"path {self.name}: {key} must be >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """Peak hardware numbers plus the compute paths calibrated on them."""

    name: str
    description: str
    memory_bytes: int
    bandwidth_Bps: float  # peak memory bandwidth, bytes per second
    flops: float  # peak dense FLOPS of the compute units the paths use
    paths: dict[str, ComputePath] = field(hash=False)
    default_path: str
    default_link: str
    sources: tuple[str, ...] = ()
    draft_path: str | None = None  # node 0's draft model (default: default_path)
    draft_head_path: str | None = None  # node 0's draft head, one layer (default: draft_path)

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.bandwidth_Bps <= 0 or self.flops <= 0:
            raise ConfigError(f"device {self.name}: memory, bandwidth and flops must be > 0")
        if not self.paths:
            raise ConfigError(f"device {self.name}: no compute paths")
        if not self.has_path(self.default_path):
            raise ConfigError(
                f"device {self.name}: default_path {self.default_path!r} is not one of "
                f"{sorted(self.paths)}"
            )
        for key in ("draft_path", "draft_head_path"):
            value = getattr(self, key)
            if value is not None and not self.has_path(value):
                raise ConfigError(f"device {self.name}: {key} {value!r} is not a path")
        for path in self.paths.values():
            if path.head_path is not None and path.head_path not in self.paths:
                raise ConfigError(f"device {self.name}: path {path.name} head_path unknown")

    def has_path(self, name: str) -> bool:
        """True for a concrete path or a single/multi family such as `hf-bnb4`."""
        return name in self.paths or (
            f"{name}-single" in self.paths and f"{name}-multi" in self.paths
        )


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """A point-to-point link: one-way latency and goodput, and the impairments the testbed relay adds
    (costs/link_costs.py says how each is charged)."""

    name: str
    latency_s: float
    bandwidth_bps: float  # bits per second
    jitter_s: float = 0.0     # uniform +- around latency_s, per chunk
    stall_prob: float = 0.0   # per chunk of up to 64 KiB
    stall_s: float = 0.0
    message_s: float = 0.0    # fixed cost per message (a forwarding hop)

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_bps <= 0:
            raise ConfigError(f"link {self.name}: latency must be >= 0 and bandwidth > 0")
        if min(self.jitter_s, self.stall_prob, self.stall_s, self.message_s) < 0 or self.stall_prob > 1:
            raise ConfigError(f"link {self.name}: jitter, stalls and message cost must be >= 0, stall_prob <= 1")


def profiles_dir() -> Path:
    """The profiles directory: $FLOWEDGE_PROFILES, else the one shipped with flowedge."""
    env = os.environ.get(PROFILES_ENV)
    if env:
        return Path(env)
    return shipped_dir("device_profiles")


def list_devices() -> list[str]:
    return sorted(p.stem for p in profiles_dir().glob("*.toml") if p.name != LINKS_FILE)


def list_links() -> list[str]:
    return sorted(_read_links())


def load_named_device(name: str) -> DeviceProfile:
    """A shipped profile by name only: for names a remote peer reports, which must never open a path."""
    if name not in list_devices():
        raise ConfigError(f"unknown device profile {name!r}; known: {', '.join(list_devices())}")
    return load_device(name)


def load_device(name_or_path: str | Path) -> DeviceProfile:
    """Load a device by file stem (`orin-nano-8gb`) or by a path to a `.toml` file."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = profiles_dir() / f"{name_or_path}.toml"
        if not path.is_file() or path.name == LINKS_FILE:
            raise ConfigError(
                f"unknown device profile {str(name_or_path)!r}; known: {', '.join(list_devices())}"
            )
    data = _read_toml(path)
    try:
        return _device_from_dict(data, path.stem)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: bad device profile ({exc!r})") from exc


def load_link(name: str) -> LinkProfile:
    """A link by name; a testbed preset's own name (`lan`, `wifi`, `bad-wifi`) names its `testbed-` entry."""
    links = _read_links()
    if name not in links and TESTBED_PREFIX + name in links:
        name = TESTBED_PREFIX + name
    if name not in links:
        raise ConfigError(f"unknown link {name!r}; known: {', '.join(sorted(links))}")
    return links[name]


def _device_from_dict(data: dict[str, Any], stem: str) -> DeviceProfile:
    paths = {
        key: ComputePath(name=key, **value) for key, value in data.get("paths", {}).items()
    }
    return DeviceProfile(
        name=str(data.get("name", stem)),
        description=str(data["description"]),
        memory_bytes=int(data["memory_bytes"]),
        bandwidth_Bps=float(data["bandwidth_Bps"]),
        flops=float(data["flops"]),
        paths=paths,
        default_path=str(data["default_path"]),
        default_link=str(data["default_link"]),
        sources=tuple(str(s) for s in data.get("sources", ())),
        draft_path=data.get("draft_path"),
        draft_head_path=data.get("draft_head_path"),
    )


def _read_links() -> dict[str, LinkProfile]:
    path = profiles_dir() / LINKS_FILE
    data = _read_toml(path)
    try:
        return {
            name: _link_from_dict(name, entry) for name, entry in data.get("links", {}).items()
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: bad link entry ({exc!r})") from exc


def _link_from_dict(name: str, entry: dict[str, Any]) -> LinkProfile:
    return LinkProfile(
        name=name,
        latency_s=float(entry["latency_ms"]) / 1e3,
        bandwidth_bps=float(entry["bandwidth_mbps"]) * 1e6,
        jitter_s=float(entry.get("jitter_ms", 0.0)) / 1e3,
        stall_prob=float(entry.get("stall_prob", 0.0)),
        stall_s=float(entry.get("stall_ms", 0.0)) / 1e3,
        message_s=float(entry.get("message_ms", 0.0)) / 1e3,
    )


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"profile file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
