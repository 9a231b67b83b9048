"""Liveness under load: a node busy with a step longer than the liveness window is not taken for dead.

Regression (stop 19): heartbeats went out only between steps, so on the real pair four concurrent
prompts made stage steps and head turns outlast the 2 s window; stages were dropped and replayed until
every request "gave up after 3 replays". Now the work runs on a compute thread while the node's own
thread keeps heartbeating (node/beating.py), and the head judges liveness only after reading its
control socket empty.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cluster_helpers import flowedge_home, free_port_pair, logs, start_cluster
from flowedge.client.sync_client import Client
from flowedge.launch.local_cluster import LocalClusterSpec
from flowedge.node.beating import BeatingWorker

STAGE_TIMEOUT_S = 0.3   # 3 heartbeats of 100 ms: the steps below take several times longer

pytestmark = pytest.mark.serial   # judged against the clock: run alone (Makefile)


def test_beats_go_on_while_the_work_runs_and_its_result_or_error_comes_back():
    worker = BeatingWorker("test")
    beats: list[float] = []
    try:
        assert worker.run(lambda: time.sleep(0.35) or 7, lambda: beats.append(time.monotonic()), 0.05) == 7
        assert len(beats) >= 4 and worker.longest_s >= 0.35
        with pytest.raises(ValueError, match="boom"):
            worker.run(lambda: (_ for _ in ()).throw(ValueError("boom")), lambda: None, 0.05)
        with pytest.raises(TimeoutError, match="the work's own"):   # not mistaken for the wait's timeout
            worker.run(lambda: (_ for _ in ()).throw(TimeoutError("the work's own")), lambda: None, 0.05)
        beats.clear()
        worker.run(lambda: time.sleep(0.4), lambda: beats.append(1), 0.05, give_up_s=0.1)
        assert 1 <= len(beats) <= 3   # past give_up_s the node is taken for hung: no more beats
    finally:
        worker.close()


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A pair wide enough that four 1,000-token prompts make steps of a second or more on one thread."""
    from flowedge.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("wide-pair")
    shape = dict(hidden=768, intermediate=3072, heads=8, kv_heads=4)
    return make_tiny_model(root / "base", num_layers=4, **shape), make_tiny_model(root / "draft", num_layers=2, **shape)


def test_steps_longer_than_the_liveness_window_drop_no_stage_and_replay_nothing(wide_pair, tmp_path):
    base, draft = wide_pair
    with flowedge_home(tmp_path):
        spec = LocalClusterSpec(nodes=3, model=str(base), draft=str(draft), port=free_port_pair(), threads=1,
                                wire_dtype="float32", strategy="flowspec", heartbeat_ms=100,
                                stage_timeout_s=STAGE_TIMEOUT_S)
        cluster = start_cluster(spec)
        try:
            answers: dict[int, object] = {}

            def ask(k: int) -> None:
                prompt = "".join(chr(97 + (i * 7 + k) % 26) for i in range(1000))
                with Client(spec.addr, timeout_s=120) as client:
                    try:
                        answers[k] = client.generate(prompt, max_new_tokens=8, temperature=0.0)
                    except Exception as err:  # noqa: BLE001 - reported by the assertion below
                        answers[k] = err

            threads = [threading.Thread(target=ask, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
            with Client(spec.addr, timeout_s=10) as client:
                rows = client.status()
            head_log = (cluster.run_dir / "head.log").read_text()
        finally:
            cluster.stop()
        assert not any(isinstance(a, Exception) for a in answers.values()) and len(answers) == 4, \
            (answers, logs(cluster.run_dir))
        assert [a["replays"] for a in answers.values()] == [0] * 4, answers
        longest_s = max(r.get("step_ms_longest") or r.get("turn_ms_longest") or 0.0 for r in rows) / 1000
        assert longest_s > 2 * STAGE_TIMEOUT_S, rows   # the load really outlasted the window
        assert "missed heartbeats" not in head_log and "dropped" not in head_log, head_log[-3000:]
