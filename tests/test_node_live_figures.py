"""The head's live figures (node/live_figures.py): its token rate and its own CPU load."""
from __future__ import annotations

import time

import pytest

from flowedge.node.head_node import model_created
from flowedge.node.live_figures import CpuLoad, TokenRate


class FakeProcess:
    """cpu_percent as psutil gives it: the first call primes the counter and says 0."""

    def __init__(self, readings: list[float]) -> None:
        self.readings = [0.0, *readings]

    def cpu_percent(self, interval=None) -> float:
        return self.readings.pop(0)


def test_the_token_rate_covers_the_last_window_and_falls_to_zero():
    rate = TokenRate(window_s=2.0)
    for t in (0.5, 1.0, 1.5, 2.0):
        rate.add(3, t)
    assert rate.per_s(2.0) == pytest.approx(6.0)
    assert rate.per_s(3.2) == pytest.approx(3.0)   # the first two left the window
    assert rate.per_s(10.0) == 0.0


def test_the_cpu_load_is_primed_once_and_sampled_at_most_once_a_second():
    now = [0.0]
    load = CpuLoad(sample_s=1.0, clock=lambda: now[0], process=FakeProcess([150.0, 40.0]))
    assert load.read() == 0.0          # too soon after the priming to say anything
    now[0] = 1.2
    assert load.read() == 1.5          # one and a half cores since the priming
    now[0] = 1.7
    assert load.read() == 1.5          # a reader in between gets the same figure
    now[0] = 2.3
    assert load.read() == 0.4


def test_the_cpu_load_of_a_busy_process_is_above_zero():
    """A new psutil.Process per call (the head's old way) says 0.0 on its first reading, always."""
    load = CpuLoad(sample_s=0.0)
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert load.read() > 0


def test_the_model_s_creation_time_is_its_files_or_the_head_s_start(tmp_path):
    model = tmp_path / "tiny-base"
    model.mkdir()
    assert model_created(str(model), 5.0) == int(model.stat().st_mtime)
    assert model_created("qwen2.5-coder-1.5b", 1_800_000_000.7) == 1_800_000_000
