"""Upper bound for two-device drafting: node 0's draft calls charged at FACTOR of their cost."""
import os, sys
import flowedge.costs.model as costs
factor = float(os.environ["FACTOR"])
orig = costs.draft_time_s
costs.draft_time_s = lambda *a, **k: factor * orig(*a, **k)
from flowedge.cli import main
sys.argv = ["flowedge"] + sys.argv[1:]
main()
