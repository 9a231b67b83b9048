"""A board lost for good, then the head: the head re-plans the model onto the two stages left, and a
standby head that loaded the three-stage plan at start must serve the re-planned one when it takes over
(the head's state carries the plan's layer counts; the standby writes that split as they change). The
stages rejoin their slots without a reload and the answers stay plain one-process greedy decoding's."""
from __future__ import annotations

import time

from board_cluster import BoardCluster
from cluster_helpers import free_port_run, logs
from test_node_board_lost import MAX_NEW, PROMPT, RECOVERY_S, _wait, reference  # noqa: F401 - a fixture


def test_a_standby_that_takes_over_after_a_replan_serves_the_replanned_split(tiny_pair, tmp_path, reference):
    base, draft = tiny_pair
    cluster = BoardCluster(tmp_path, base, draft, recovery_s=RECOVERY_S, standby=True,
                           port=free_port_run(4)).start()
    try:
        assert _wait(lambda: "following head" in cluster.log("standby"), 60), logs(tmp_path)
        cluster.kill("stage-2")   # never restarted: the head re-plans onto stage-1 and stage-3
        assert _wait(lambda: [e["kind"] for e in cluster.head_row()["membership"]["events"]][-1:] == ["replanned"]
                     and all(r["ready"] for r in cluster.stage_rows()), RECOVERY_S + 120), logs(tmp_path)
        assert _wait(lambda: "writing that split too" in cluster.log("standby"), 30), logs(tmp_path)
        fetched = {n: cluster.log(n).count("fetching shard") for n in ("stage-1", "stage-3")}

        cluster.kill("head")
        t0 = time.monotonic()
        with cluster.client(timeout_s=RECOVERY_S + 120) as c:
            answer = list(c.generate(PROMPT, max_new_tokens=MAX_NEW, strategy="flowspec").token_ids)
        assert answer == reference, logs(tmp_path)
        assert "serving the head's re-planned split" in cluster.log("standby"), logs(tmp_path)
        rows = cluster.stage_rows()
        assert [r["node_id"] for r in rows] == ["stage-1", "stage-3"] and all(r["ready"] for r in rows), rows
        assert rows[0]["layers"][0] == 0 and rows[1]["layers"][1] == 4, rows
        # the survivors rejoined the slots whose layers they hold: nothing fetched again
        assert {n: cluster.log(n).count("fetching shard") for n in fetched} == fetched, logs(tmp_path)
        assert time.monotonic() - t0 < 60, logs(tmp_path)
    finally:
        cluster.stop()
