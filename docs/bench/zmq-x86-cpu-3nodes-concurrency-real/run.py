"""The zmq concurrency sweep with the real pair on this 2-core CPU, default liveness settings (2 s):
nodes heartbeat while they compute, so multi-second batched steps are not taken for deaths."""
import sys
from flowedge.cli import main
sys.argv = ["flowedge", "bench", "--driver", "zmq", "--dataset", "mt-bench", "--dataset", "humaneval", "--samples", "2",
            "--max-new-tokens", "24", "--nodes", "3", "--strategies", "flowspec,ar-pp", "--concurrency", "1,2,4",
            "--threads", "1", "--out", "docs/bench/zmq-x86-cpu-3nodes-concurrency-real"]
main()
