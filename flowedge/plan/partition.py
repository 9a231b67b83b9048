"""Assign contiguous layer ranges to stages so that every stage fits its memory and the slowest stage
is as fast as possible.

The rule (exact, not a heuristic): stage k, on device k in the given order, serves n_k >= 1 consecutive
decoder layers with sum n_k = L. Its memory need is weights(n_k) at the configured quantization + the
KV cache of n_k layers for the configured context + the runtime's footprint (+ the 16-bit lm_head on the
last stage when it chooses tokens); it must not exceed what the device reported free when it joined (or
its profile's memory less an OS reserve). Its time per pipeline step is the roofline cost of one forward
of the strategy's segment (l_max tokens for the tree strategies, 1 for ar-pp) over n_k layers on the
device's profile, plus sending the segment's hidden states over the link (+ the lm_head on a last stage
that chooses tokens). In a pipeline the slowest stage sets the pace, so:

1. minimise the bottleneck max_k t_k(n_k) subject to memory: dynamic programming over (stage, layers
   placed) in O(S * L^2), all layers of a model being alike so t_k and the memory need depend on n_k only;
2. among the partitions with that bottleneck, minimise the sum of stage times (the pipeline's latency,
   which every round's first token pays): a second DP restricted to t_k(n_k) <= the optimum.

A single ar-pp request has one token in flight, so its speed is 1 / latency: with `objective="latency"`
(what `step_tokens_for("ar-pp")` callers use) step 1 is skipped and the sum is minimised outright.

prima.cpp's layer assignment (Halda) solves a related problem for a ring of devices that run one token at
a time (it minimises the per-token latency, a sum, with memory and disk-offload limits); flowedge's stages
work concurrently on different segments, so the bottleneck is the objective and the sum the tie-break.
Layers may not be offloaded to disk here: a partition that does not fit in memory is an error (PlanError)
that says how many bytes are missing on which devices.

Leaving devices out (`allow_idle`): a device too slow for even one layer (a Raspberry Pi 5 beside Orins)
sets the pace of every step it takes part in. The same DPs then also allow n_k = 0 for every stage but
the last (the one holding the lm_head, chosen by the caller's device order): the bottleneck DP finds
the best pace over any subset of devices, and the latency DP breaks its ties by using as many devices
as possible (for the latency objective: latency first, then most devices). Such a plan is taken only
when the plan using every device does not fit, or is IDLE_GAIN slower; the devices left out are listed
in `PartitionPlan.unused` with the reason.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flowedge.costs.model import forward_time_s, lm_head_time_s, shape_of_layers, transfer_time_s
from flowedge.costs.pipeline import path_for_quant
from flowedge.costs.profiles import DeviceProfile, LinkProfile, load_link
from flowedge.costs.sizing import SIZING_CONTEXT
from flowedge.errors import PlanError
from flowedge.plan.memory import GiB, MemoryNeed, stage_need, usable_bytes

HIDDEN_WIRE_BYTES = 2   # hidden states travel as fp16/bf16
IDLE_GAIN = 0.02        # leave devices out only for a plan at least 2% faster (a device in use also adds
                        # KV memory and room for concurrent requests, which the step time does not value)


@dataclass(frozen=True, slots=True)
class StageDevice:
    """One stage's device: its profile, the free memory it reported (None: not known) and kernel path."""

    profile: DeviceProfile
    free_memory_bytes: int | None = None
    path: str | None = None

    @property
    def usable_bytes(self) -> int:
        return usable_bytes(self.profile, self.free_memory_bytes)


@dataclass(frozen=True, slots=True)
class StagePlan:
    device: str
    start: int
    end: int
    memory: MemoryNeed
    usable_bytes: int
    step_s: float          # one pipeline step (segment forward + send) on this stage

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class UnusedDevice:
    """A device the plan leaves idle, its position in the device order planned, and why: it cannot hold
    one layer (`need_bytes` > `usable_bytes`), or one layer costs it `one_layer_s` per step while the
    plan's objective (`what`) is `without_s` with the unused devices left out and `with_all_s` with every
    device in use (None: that does not fit)."""

    device: str
    index: int
    what: str
    without_s: float
    with_all_s: float | None
    one_layer_s: float
    need_bytes: int
    usable_bytes: int

    @property
    def reason(self) -> str:
        if self.need_bytes > self.usable_bytes:
            return (f"cannot hold one layer ({self.need_bytes / GiB:.2f} GiB needed, "
                    f"{self.usable_bytes / GiB:.2f} usable)")
        if self.with_all_s is None:
            return "the plan using every device does not fit"
        return (f"one layer takes {1e3 * self.one_layer_s:.1f} ms/step here; {self.what} "
                f"{1e3 * self.without_s:.1f} ms with the unused left out, {1e3 * self.with_all_s:.1f} ms "
                "with every device in use")


@dataclass(frozen=True, slots=True)
class PartitionPlan:
    stages: tuple[StagePlan, ...]          # the stages in use, in pipeline order
    step_tokens: int
    unused: tuple[UnusedDevice, ...] = ()

    @property
    def counts(self) -> list[int]:
        return [s.layers for s in self.stages]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.start, s.end) for s in self.stages]

    @property
    def bottleneck_s(self) -> float:
        return max(s.step_s for s in self.stages)

    @property
    def latency_s(self) -> float:
        return sum(s.step_s for s in self.stages)

    def objective_s(self, objective: str) -> float:
        return self.latency_s if objective == "latency" else self.bottleneck_s


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What the planner needs: model shape, stage devices, quantization, context, the step's tokens."""

    config: Any
    devices: tuple[StageDevice, ...]
    quant: str = "int4"
    context: int = 4096
    step_tokens: int = 16          # tokens per stage forward: l_max for tree strategies, 1 for ar-pp
    last_stage_head: bool = True   # the last stage holds the lm_head (chooses tokens)
    link: LinkProfile | None = None   # default: the first device's default link
    last_stage_runs_head: bool | None = None   # its step includes the lm_head (default: last_stage_head)
    objective: str = "bottleneck"  # "latency" for one token in flight (ar-pp): minimise the sum only
    allow_idle: bool = False       # may leave devices out (see the module doc)

    def need(self, k: int, layers: int, last: bool | None = None) -> MemoryNeed:
        """Stage k's memory with `layers` layers; `last`: it ends the pipeline (default: k is the last)."""
        dev, last = self.devices[k], k == len(self.devices) - 1 if last is None else last
        return stage_need(self.config, layers, self.quant, self.context, dev.profile, dev.path,
                          holds_head=self.last_stage_head and last)

    def step_s(self, k: int, layers: int, last: bool | None = None) -> float:
        dev, tokens = self.devices[k], self.step_tokens
        link = self.link or _link(self.devices[0].profile.default_link)
        t = forward_time_s(dev.profile, shape_of_layers(self.config, 0, layers), tokens, SIZING_CONTEXT, dev.path)
        t += transfer_time_s(link, tokens * int(self.config.hidden_size) * HIDDEN_WIRE_BYTES)
        runs_head = self.last_stage_head if self.last_stage_runs_head is None else self.last_stage_runs_head
        if runs_head and (k == len(self.devices) - 1 if last is None else last):
            t += lm_head_time_s(dev.profile, self.config, tokens, dev.path)
        return t

    def evaluate(self, counts: Sequence[int]) -> tuple[bool, float]:
        """(every stage fits, the objective's seconds) of a given split: is re-splitting worth it?"""
        fits = all(self.need(k, n).total_bytes <= self.devices[k].usable_bytes for k, n in enumerate(counts))
        times = [self.step_s(k, n) for k, n in enumerate(counts)]
        return fits, sum(times) if self.objective == "latency" else max(times)


@functools.lru_cache(maxsize=None)
def _link(name: str) -> LinkProfile:
    return load_link(name)


@dataclass(frozen=True, slots=True)
class _Tables:
    """step_s and fits of stage k with n layers, as a middle stage ([0]) or the last one ([1]); n = 0 is
    an idle stage where `idle` allows it."""

    step: tuple[list[list[float]], list[list[float]]]
    fits: tuple[list[list[bool]], list[list[bool]]]
    idle: tuple[bool, ...]

    @classmethod
    def of(cls, inputs: PlanInputs, idle: bool) -> _Tables:
        layers, stages = int(inputs.config.num_hidden_layers), len(inputs.devices)
        ends = (False, True) if idle else (None, None)   # without idle stages only the last one ends it
        step = [[[0.0] + [inputs.step_s(k, n, e) for n in range(1, layers + 1)] for k in range(stages)]
                for e in ends]
        fits = [[[True] + [inputs.need(k, n, e).total_bytes <= inputs.devices[k].usable_bytes
                           for n in range(1, layers + 1)] for k in range(stages)] for e in ends]
        return cls((step[0], step[1]), (fits[0], fits[1]), (idle,) * stages)

    def cell(self, k: int, n: int, ends: bool) -> tuple[bool, float]:
        """(allowed, seconds) for stage k taking n layers, ending the pipeline or not."""
        if n == 0:
            return self.idle[k], 0.0
        return self.fits[ends][k][n], self.step[ends][k][n]


def plan_partition(inputs: PlanInputs) -> PartitionPlan:
    """The exact min-bottleneck, then min-latency, contiguous partition that fits (see module doc)."""
    layers, stages = int(inputs.config.num_hidden_layers), len(inputs.devices)
    if not 1 <= stages <= layers and not (inputs.allow_idle and stages >= 1):
        raise PlanError(f"cannot split {layers} layers over {stages} stages (each stage serves >= 1 layer)")
    every_t = _Tables.of(inputs, idle=False)
    every = _solve(inputs, every_t, layers) if stages <= layers else None
    if inputs.allow_idle and stages > 1:
        idle_t = _Tables.of(inputs, idle=True)
        fewer = _solve(inputs, idle_t, layers)
        if fewer is not None and (every is None or _objective(inputs, idle_t, fewer)
                                  < _objective(inputs, every_t, every) * (1 - IDLE_GAIN)):
            return _plan(inputs, idle_t, fewer, _unused_reasons(inputs, idle_t, every_t, every, fewer))
    if every is None:
        raise PlanError(_why_not(inputs, every_t.fits[1]))
    return _plan(inputs, every_t, every, ())


def _solve(inputs: PlanInputs, t: _Tables, layers: int) -> list[int] | None:
    bottleneck = _min_bottleneck(t, layers)
    if bottleneck is None:
        return None
    cap_s = math.inf if inputs.objective == "latency" else bottleneck * (1 + 1e-9)
    return _min_latency(t, layers, cap_s, inputs.objective == "latency")


def _times(t: _Tables, counts: list[int]) -> list[tuple[int, float]]:
    """(stage, seconds) of the stages in use; the last of them ends the pipeline."""
    used = [k for k, n in enumerate(counts) if n]
    return [(k, t.cell(k, counts[k], k == used[-1])[1]) for k in used]


def _objective(inputs: PlanInputs, t: _Tables, counts: list[int]) -> float:
    times = [s for _, s in _times(t, counts)]
    return sum(times) if inputs.objective == "latency" else max(times)


def _plan(inputs: PlanInputs, t: _Tables, counts: list[int], unused: tuple[UnusedDevice, ...]) -> PartitionPlan:
    out, start, times = [], 0, dict(_times(t, counts))
    last = max(times)
    for k, n in enumerate(counts):
        if n:
            out.append(StagePlan(inputs.devices[k].profile.name, start, start + n, inputs.need(k, n, k == last),
                                 inputs.devices[k].usable_bytes, times[k]))
        start += n
    return PartitionPlan(tuple(out), inputs.step_tokens, unused)


def _unused_reasons(inputs: PlanInputs, t: _Tables, every_t: _Tables, every: list[int] | None,
                    fewer: list[int]) -> tuple[UnusedDevice, ...]:
    what = "pipeline latency" if inputs.objective == "latency" else "bottleneck"
    with_all = None if every is None else _objective(inputs, every_t, every)
    return tuple(UnusedDevice(inputs.devices[k].profile.name, k, what, _objective(inputs, t, fewer), with_all,
                              t.step[0][k][1], inputs.need(k, 1, False).total_bytes,
                              inputs.devices[k].usable_bytes)
                 for k, n in enumerate(fewer) if n == 0)


def _min_bottleneck(t: _Tables, layers: int) -> float | None:
    """best[j]: the smallest bottleneck placing j layers on the stages so far (inf: impossible); the
    stage that places the last layer ends the pipeline (any after it must be idle)."""
    best = [0.0] + [math.inf] * layers
    for k in range(len(t.idle)):
        nxt = [math.inf] * (layers + 1)
        for j in range(layers + 1):
            for n in range(j + 1):
                ok, step_s = t.cell(k, n, j == layers)
                if ok and best[j - n] < math.inf:
                    nxt[j] = min(nxt[j], max(best[j - n], step_s))
        best = nxt
    return best[layers] if best[layers] < math.inf else None


def _min_latency(t: _Tables, layers: int, cap_s: float, latency_first: bool) -> list[int]:
    """Counts with every stage time <= cap_s minimising (idle stages, latency), or with `latency_first`
    (latency, idle stages); feasible by construction."""
    inf = (math.inf, math.inf)
    best: list[tuple[float, float]] = [(0.0, 0.0)] + [inf] * layers
    choice: list[list[int]] = []
    for k in range(len(t.idle)):
        nxt, pick = [inf] * (layers + 1), [0] * (layers + 1)
        for j in range(layers + 1):
            for n in range(j + 1):
                ok, step_s = t.cell(k, n, j == layers)
                if not ok or step_s > cap_s or best[j - n] == inf:
                    continue
                idle, latency = (best[j - n][1], best[j - n][0]) if latency_first else best[j - n]
                idle, latency = idle + (n == 0), latency + step_s
                key = (latency, idle) if latency_first else (idle, latency)
                if key < nxt[j]:
                    nxt[j], pick[j] = key, n
        best = nxt
        choice.append(pick)
    counts, j = [], layers
    for k in reversed(range(len(t.idle))):
        counts.append(choice[k][j])
        j -= choice[k][j]
    return counts[::-1]


def _why_not(inputs: PlanInputs, fits: list[list[bool]]) -> str:
    """One message: the total shortfall and, per device, what it can hold and what one more layer needs."""
    layers = int(inputs.config.num_hidden_layers)
    name = getattr(inputs.config, "name", "the model")
    caps = [max((n for n in range(1, layers + 1) if fits[k][n]), default=0) for k in range(len(fits))]
    parts = []
    for k, dev in enumerate(inputs.devices):
        need = inputs.need(k, max(caps[k], 1)).total_bytes
        parts.append(f"stage {k + 1} {dev.profile.name}: {dev.usable_bytes / GiB:.2f} GiB usable, holds "
                     f"{caps[k]} layers" + ("" if caps[k] else f" (one layer needs {need / GiB:.2f} GiB)"))
    # the shortfall: memory to hold every layer on the devices as they are (per-layer cost of the cheapest)
    per_layer = min(inputs.need(k, 2).total_bytes - inputs.need(k, 1).total_bytes for k in range(len(fits)))
    short_layers = max(0, layers - sum(caps))
    empty = [k for k, c in enumerate(caps) if c == 0]
    missing = short_layers * per_layer + sum(inputs.need(k, 1).total_bytes - inputs.devices[k].usable_bytes
                                             for k in empty)
    return (f"{name} ({layers} layers, quant {inputs.quant}, context {inputs.context}) does not fit: "
            f"{missing / GiB:.2f} GiB missing ({short_layers} layers unplaced"
            + (f"; stages {', '.join(str(k + 1) for k in empty)} cannot hold one layer" if empty else "")
            + f"). " + "; ".join(parts)
            + ". Add a device, free memory, or lower the quantization / context.")


def stage_devices(profiles: Sequence[DeviceProfile], free_bytes: Sequence[int | None] | None = None,
                  path: str | None = None, quant: str = "int4") -> tuple[StageDevice, ...]:
    """StageDevices whose kernel path is `path`, else the one each device runs `quant` weights on."""
    free = list(free_bytes) if free_bytes is not None else [None] * len(profiles)
    if len(free) != len(profiles):
        raise PlanError(f"{len(free)} free-memory figures for {len(profiles)} devices")
    return tuple(StageDevice(p, f, path or path_for_quant(p, quant)) for p, f in zip(profiles, free))
