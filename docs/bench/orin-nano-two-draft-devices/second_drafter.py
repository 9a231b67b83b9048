"""Upper bound for a second draft device that adds breadth: node 0's draft calls run `--draft-width`
rows (e.g. 32) but are charged as if they ran at most NODE0_ROWS (e.g. 16) — the rows beyond it run on a
second board in parallel, at no time to node 0 and nothing lost to shipping draft KV or merging."""
import os
import sys

import flowedge.costs.model as costs

node0_rows = int(os.environ["NODE0_ROWS"])
original = costs.draft_time_s


def charged(device, config, tokens, context, *args, **kwargs):
    return original(device, config, min(tokens, node0_rows), context, *args, **kwargs)


costs.draft_time_s = charged
from flowedge.cli import main  # noqa: E402  (after the patch: sim modules import draft_time_s by name)

sys.argv = ["flowedge"] + sys.argv[1:]
main()
