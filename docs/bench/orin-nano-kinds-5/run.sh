#!/bin/bash
# 5 prompts per kind, phase t0 (ar-pp, naive-pp, auto), simulated 5 x Orin Nano, niced (virtual-time results)
cd "$(dirname "$0")/../../.."
KINDS="humaneval mt-bench:writing mt-bench:roleplay mt-bench:reasoning mt-bench:math mt-bench:coding mt-bench:extraction mt-bench:stem mt-bench:humanities"
for k in $KINDS; do
  out=bench-out/kinds5/t0/${k//:/-}
  [ -f "$out/results.json" ] && continue
  nice -n 19 .venv/bin/flowedge bench --dataset "$k" --samples 5 --strategies ar-pp,naive-pp,auto --temperature 0 \
    --max-new-tokens 128 --nodes 5 --profile orin-nano-8gb --verify oracle --threads 1 --out "$out" > /tmp/grid5-${k//:/-}.log 2>&1
done
echo grid-done
