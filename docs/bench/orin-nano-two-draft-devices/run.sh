#!/bin/bash
# 1 + 4 (node 0 drafting, 4 stages) vs 2 + 4 (a second draft board adding breadth, its
# upper bound: second_drafter.py) vs 1 + 5 (the sixth board as one more stage). Simulated Orin Nano, real
# pair, 128 tokens, T=0, oracle verification, 3 prompts of 3 kinds. Niced; virtual time.
cd "$(dirname "$0")/../../.."
OUT=${OUT:-bench-out/two-draft}
COMMON="--samples 3 --temperature 0 --max-new-tokens 128 --profile orin-nano-8gb --verify oracle --threads 1"
for k in mt-bench:writing mt-bench:roleplay humaneval; do
  kk=${k//:/-}
  [ -f "$OUT/1+4/$kk/results.json" ] || nice -n 19 .venv/bin/flowedge bench --dataset "$k" $COMMON \
    --strategies ar-pp,flowspec --nodes 5 --out "$OUT/1+4/$kk"
  [ -f "$OUT/2+4/$kk/results.json" ] || NODE0_ROWS=16 nice -n 19 .venv/bin/python \
    docs/bench/orin-nano-two-draft-devices/second_drafter.py bench --dataset "$k" $COMMON \
    --strategies flowspec --draft-width 32 --nodes 5 --out "$OUT/2+4/$kk"
  [ -f "$OUT/1+5/$kk/results.json" ] || nice -n 19 .venv/bin/flowedge bench --dataset "$k" $COMMON \
    --strategies ar-pp,flowspec --nodes 6 --out "$OUT/1+5/$kk"
done
echo two-draft-done
