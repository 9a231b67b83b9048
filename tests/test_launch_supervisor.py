"""`flowedge up`'s supervisor (launch/supervisor.py) over stand-in node processes (a sleeping python each):
a stage that dies is said and started again after a delay that doubles with each death in a row; the head
is not its to restart; a detached cluster's nodes (not its children) are watched by pid."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flowedge.launch.local_cluster import STATE_FILE, LocalCluster, LocalClusterSpec
from flowedge.launch.supervisor import Backoff, ForeignProcess, RecordedCluster, Supervisor, exit_text

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def cluster(tmp_path):
    procs = [subprocess.Popen(SLEEPER) for _ in range(3)]
    c = LocalCluster(LocalClusterSpec(nodes=3, model="qwen2.5-coder-1.5b"), tmp_path, procs, [SLEEPER] * 3)
    c._record()
    yield c
    for p in c.procs:
        p.kill()
        p.wait()


def _kill(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_dead_stage_is_said_and_restarted_with_a_delay_that_doubles_then_resets(cluster):
    now, said = [0.0], []
    sup = Supervisor(cluster, said.append, Backoff(first_s=1.0, max_s=30.0, stable_s=60.0), clock=lambda: now[0])
    old = cluster.procs[2].pid
    _kill(cluster.procs[2])
    sup.tick()
    assert said == [f"stage-2 was killed by SIGKILL; restarting it in 1 s (death in a row: 1; log "
                    f"{cluster.run_dir / 'stage-2.log'})"]
    now[0] = 0.5
    sup.tick()
    assert cluster.procs[2].poll() is not None and len(said) == 1   # not before its delay
    now[0] = 1.0
    sup.tick()
    new = cluster.procs[2]
    assert new.poll() is None and new.pid != old and said[-1] == f"stage-2 restarted (pid {new.pid}; restart 1)"
    assert json.loads((cluster.run_dir / STATE_FILE).read_text())["pids"][2] == new.pid   # `down` stops this one
    _kill(new)
    now[0] = 2.0
    sup.tick()
    assert "restarting it in 2 s (deaths in a row: 2" in said[-1]
    now[0] = 4.0
    sup.tick()
    now[0] = 70.0   # up for more than a minute: its deaths are forgotten
    sup.tick()
    _kill(cluster.procs[2])
    sup.tick()
    assert "restarting it in 1 s (death in a row: 1" in said[-1]
    assert not sup.head_exited()
    _kill(cluster.procs[0])
    assert sup.head_exited()


def test_the_delay_is_capped_and_exits_are_said_in_words():
    b = Backoff(first_s=1.0, max_s=30.0)
    assert [b.delay_s(n) for n in (1, 2, 3, 5, 6, 9)] == [1, 2, 4, 16, 30, 30]
    assert exit_text(-9) == "was killed by SIGKILL" and exit_text(1) == "exited with status 1"
    assert exit_text("exited") == "exited"


def test_a_detached_cluster_s_nodes_are_watched_by_pid_and_restarted_into_the_record(cluster):
    """The supervisor of `up --detach` did not start the nodes it watches: it cannot wait for them."""
    recorded = RecordedCluster.load(cluster.run_dir)
    assert recorded.names == ["head", "stage-1", "stage-2"]
    assert all(isinstance(p, ForeignProcess) and p.poll() is None for p in recorded.procs)
    said = []
    sup = Supervisor(recorded, said.append, Backoff(first_s=0.0), detach=True)
    _kill(cluster.procs[1])   # reaped by its parent (this test), as init reaps a detached node
    sup.tick()
    assert said == [f"stage-1 exited; restarting it in 0 s (death in a row: 1; log {cluster.run_dir / 'stage-1.log'})"]
    sup.tick()
    new = recorded.procs[1]
    try:
        assert new.poll() is None and json.loads((cluster.run_dir / STATE_FILE).read_text())["pids"][1] == new.pid
        assert said[-1].startswith("stage-1 restarted (pid ")
    finally:
        new.kill()
        new.wait()
