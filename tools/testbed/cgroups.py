"""A device's CPU and memory limits as a control group: cgroup v2 (`cpu.max`, `memory.max`, `cgroup.kill`)
where the unified hierarchy has the cpu and memory controllers, else the v1 `cpu` and `memory` hierarchies
(`cpu.cfs_quota_us`, `memory.limit_in_bytes`) as on hybrid hosts. Every group lives under
`flowedge-testbed/<tag>/` so that `cleanup` finds what a killed testbed left."""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("testbed.cgroups")

ROOT = Path("/sys/fs/cgroup")
TOP = "flowedge-testbed"
PERIOD_US = 100_000


def _v2_root() -> Path | None:
    """The unified mount if it offers cpu and memory, else None."""
    for mount in (ROOT, ROOT / "unified"):
        controllers = mount / "cgroup.controllers"
        if controllers.is_file() and {"cpu", "memory"} <= set(controllers.read_text().split()):
            return mount
    return None


@dataclass(frozen=True)
class Limits:
    cpus: float          # cores' worth of CPU time (a quota over PERIOD_US)
    memory_mb: int


@dataclass(frozen=True)
class Cgroup:
    """One device's group: its folder in each hierarchy that enforces something (one folder under v2)."""
    dirs: tuple[Path, ...]
    v2: bool

    def attach_self(self) -> None:
        """Move the calling process into the group (used between fork and exec)."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            procs = d / "cgroup.procs"
            if procs.is_file():
                found |= {int(p) for p in procs.read_text().split()}
        return found

    def kill(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process in the group (and its children: they inherit the group) until it is empty."""
        deadline = time.monotonic() + timeout_s
        kill_file = self.dirs[0] / "cgroup.kill"
        while (pids := self.pids()) and time.monotonic() < deadline:
            if self.v2 and kill_file.is_file():
                kill_file.write_text("1")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        if self.pids():
            log.warning("processes %s outlived SIGKILL in %s", sorted(self.pids()), self.dirs[0])

    def remove(self) -> None:
        for d in self.dirs:
            _rmdir_tree(d)


def _rmdir_tree(d: Path) -> None:
    if not d.is_dir():
        return
    for child in d.iterdir():
        if child.is_dir():
            _rmdir_tree(child)
    try:
        d.rmdir()
    except OSError as err:
        log.warning("cannot remove %s: %s", d, err)


def _hierarchies() -> tuple[tuple[Path, ...], bool]:
    v2 = _v2_root()
    if v2 is not None:
        return (v2,), True
    v1 = tuple(ROOT / c for c in ("cpu", "memory") if (ROOT / c / "cgroup.procs").is_file())
    if len(v1) != 2:
        raise SystemExit("no cgroup hierarchy with the cpu and memory controllers under /sys/fs/cgroup")
    return v1, False


def _enable_v2_controllers(root: Path, leaf: Path) -> None:
    """Turn on cpu and memory in every subtree_control from root down to leaf's parent."""
    d = root
    for part in leaf.relative_to(root).parts:
        (d / "cgroup.subtree_control").write_text("+cpu +memory")
        d = d / part


def create(tag: str, name: str, limits: Limits) -> Cgroup:
    """The group TOP/tag/name with `limits` in force."""
    roots, v2 = _hierarchies()
    dirs = tuple(r / TOP / tag / name for r in roots)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    quota_us = max(1000, int(limits.cpus * PERIOD_US))
    memory = limits.memory_mb * 1024 * 1024
    if v2:
        _enable_v2_controllers(roots[0], dirs[0])
        (dirs[0] / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
        (dirs[0] / "memory.max").write_text(str(memory))
        if (dirs[0] / "memory.swap.max").exists():
            (dirs[0] / "memory.swap.max").write_text("0")
    else:
        cpu, mem = dirs
        (cpu / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(quota_us))
        (mem / "memory.limit_in_bytes").write_text(str(memory))
    return Cgroup(dirs, v2)


def existing(tag: str) -> list[Cgroup]:
    """The device groups a testbed `tag` left, whatever state they are in."""
    roots, v2 = _hierarchies()
    names = {p.name for r in roots if (r / TOP / tag).is_dir() for p in (r / TOP / tag).iterdir() if p.is_dir()}
    return [Cgroup(tuple(r / TOP / tag / n for r in roots), v2) for n in sorted(names)]


def tags() -> set[str]:
    """Every testbed tag with a folder in some hierarchy."""
    roots, _ = _hierarchies()
    return {p.name for r in roots if (r / TOP).is_dir() for p in (r / TOP).iterdir() if p.is_dir()}


def remove_tag(tag: str) -> None:
    """Kill what runs in tag's groups and remove them, and TOP itself once empty."""
    for group in existing(tag):
        group.kill()
        group.remove()
    roots, _ = _hierarchies()
    for r in roots:
        _rmdir_tree(r / TOP / tag)
        try:
            (r / TOP).rmdir()
        except OSError:
            pass   # another testbed still uses it
