#!/bin/bash
# The prompt-kind grid: simulated 5 x Jetson Orin Nano 8GB, real pair, 128 tokens, oracle verification,
# one `flowedge bench` per prompt kind (so a cut-off run keeps what it finished), then merge.py.
# Usage (repo root, venv active): bash docs/bench/orin-nano-kinds/run.sh t0|t1|oracle|t0b  [KINDS="..."]
set -u
phase=$1
KINDS="${KINDS:-humaneval mt-bench:writing mt-bench:roleplay mt-bench:reasoning mt-bench:math mt-bench:coding mt-bench:extraction mt-bench:stem mt-bench:humanities}"
case $phase in
  t0) args="--strategies ar-pp,naive-pp,auto --temperature 0";;
  oracle) args="--strategies auto@oracle --temperature 0";;
  t0b) args="--strategies pipedec,pipespec --temperature 0";;
  t1) args="--strategies naive-pp,auto --temperature 1";;
  *) echo "unknown phase $phase" >&2; exit 2;;
esac
for k in $KINDS; do
  out=bench-out/kinds/$phase/${k//:/-}
  [ -f "$out/results.json" ] && continue
  flowedge bench --dataset "$k" --samples 1 $args --max-new-tokens 128 --nodes 5 --profile orin-nano-8gb \
    --verify oracle --threads 1 --out "$out"
done
