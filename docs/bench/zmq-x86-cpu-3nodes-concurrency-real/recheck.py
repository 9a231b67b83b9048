"""The re-check after batched stage forwards became bit-identical per request: ar-pp alone (the
strategy whose MT-bench/81 answer diverged under batching), the same 4 prompts, 1, 2 and 4 concurrent."""
import functools, sys
from flowedge.launch import local_cluster
local_cluster.LocalClusterSpec = functools.partial(local_cluster.LocalClusterSpec, stage_timeout_s=30.0, client_timeout_s=60.0)
from flowedge.cli import main
sys.argv = ["flowedge", "bench", "--driver", "zmq", "--dataset", "mt-bench", "--dataset", "humaneval", "--samples", "2",
            "--max-new-tokens", "24", "--nodes", "3", "--strategies", "ar-pp", "--concurrency", "1,2,4",
            "--threads", "1", "--out", "docs/bench/zmq-x86-cpu-3nodes-concurrency-real/recheck"]
main()
