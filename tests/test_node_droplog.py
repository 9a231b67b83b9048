"""DropLog: every drop counted, the log not flooded (a burst, then one summary per interval)."""
from __future__ import annotations

import logging

from flowedge.node.droplog import DropLog


def test_drops_are_counted_and_logged_without_flooding(caplog):
    now = [0.0]
    drops = DropLog(logging.getLogger("droplog-test"), burst=3, interval_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="droplog-test"):
        for i in range(1000):
            drops.drop("segment_parents" if i % 2 else "prune_overlap", f"message {i}")
        assert len(caplog.records) == 3                       # the burst only
        now[0] = 61.0
        drops.tick()                                          # the window ended: one summary line
        assert len(caplog.records) == 4 and "997 more" in caplog.records[-1].getMessage()
        drops.drop("prune_overlap", "again")                  # a new window: logged in full again
        assert len(caplog.records) == 5
        drops.tick()
        assert len(caplog.records) == 5                       # nothing suppressed: no summary
    assert drops.snapshot() == {"prune_overlap": 501, "segment_parents": 500}
