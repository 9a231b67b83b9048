#!/usr/bin/env bash
# Pre-drafting on the simulated 5 x Orin Nano cluster, real pair, 128 tokens, 4 prompts (docs/bench/predraft).
set -euo pipefail
B="flowedge bench --dataset mt-bench --dataset humaneval --samples 2 --max-new-tokens 128 --profile orin-nano-8gb --verify oracle"
$B --nodes 5 --strategies ar-pp,flowspec --out 1+4                                   # today's cluster
$B --nodes 5 --strategies flowspec --predraft idle --out 1+4-idle                     # node 0's gaps
$B --nodes 5 --strategies flowspec --predraft drafter --out 2+4                       # a drafter board
# 2+4-dropped/ and 2+4-c1-dropped/ (2 and 1 calls) came from the earlier model that dropped late answers (see README)
$B --nodes 6 --strategies ar-pp,flowspec --out 1+5                                    # the 6th board as a stage
