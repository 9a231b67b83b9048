"""The testbed's link presets, read from the simulator's own link file (device_profiles/links.toml,
entries `testbed-<preset>`), so a measured run and its simulated prediction use the same figures."""
from __future__ import annotations

import tomllib

from flowedge.costs.profiles import LINKS_FILE, profiles_dir

from tools.testbed.relay import LinkShape

PREFIX = "testbed-"


def _entries() -> dict[str, dict]:
    data = tomllib.loads((profiles_dir() / LINKS_FILE).read_text())
    return {name.removeprefix(PREFIX): entry for name, entry in data.get("links", {}).items()
            if name.startswith(PREFIX)}


def preset_names() -> list[str]:
    return sorted(_entries())


def sim_link(preset: str) -> str:
    """The simulator's link profile of a preset (`flowedge bench --link ...`)."""
    load_preset(preset)
    return PREFIX + preset


def load_preset(name: str) -> LinkShape:
    entries = _entries()
    if name not in entries:
        raise SystemExit(f"unknown preset {name!r}; known: {', '.join(sorted(entries))}")
    e = entries[name]
    return LinkShape(delay_ms=float(e["latency_ms"]), jitter_ms=float(e.get("jitter_ms", 0.0)),
                     bandwidth_mbps=float(e["bandwidth_mbps"]), stall_prob=float(e.get("stall_prob", 0.0)),
                     stall_ms=float(e.get("stall_ms", 0.0)))
