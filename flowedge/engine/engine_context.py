"""What an engine reads of the driver that runs it: the load on the pipeline and whether a drafter device
is there. Given to the engine's constructor by its composition roots (the scheduler and the driver's
engine factory), so no one patches an engine after it is built; the driver's time comes with each call
(`RequestEngine.start` / `receive`), as befits a sans-I/O engine.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def _one() -> int:
    return 1


def _yes() -> bool:
    return True


@dataclass(frozen=True)
class EngineContext:
    """`running_requests`: requests sharing the pipeline now, this one included (strategy `auto` weighs its
    predictions by it); `drafters_present`: whether a drafter device can take pre-draft jobs (with none, no
    job is made: no snapshot copied for nobody)."""
    running_requests: Callable[[], int] = _one
    drafters_present: Callable[[], bool] = _yes
