#!/bin/bash
# A/B through the CLI itself: ar, tree (0.5B draft), tree (draft head), interleaved per prompt; T=0, 128 tokens.
FE=${FE:-flowedge}
P1="Write a Python function that checks whether two strings are anagrams of each other, with doctests."
P2="Write a short product description for a reusable steel water bottle."
i=0
for P in "$P1" "$P2"; do
  for arm in ar tree05 treehead; do
    case $arm in
      ar) args="--strategy ar";;
      tree05) args="--strategy tree";;
      treehead) args="--strategy tree --draft head:qwen2.5-coder-1.5b";;
    esac
    echo "== prompt $i $arm"; nice -n 10 $FE generate "$P" $args --max-new-tokens 128 --threads 2 --json | python3 -c "import json,sys; d=json.load(sys.stdin); d.pop('text'); ids=d.pop('token_ids'); print(json.dumps(d)); print('ids', hash(tuple(ids)))"
  done
  i=$((i+1))
done
for P in "$P1"; do
  for draft in qwen2.5-coder-0.5b head:qwen2.5-coder-1.5b; do
    echo "== sim flowspec $draft"; nice -n 10 $FE generate "$P" --strategy flowspec --nodes 3 --profile x86-cpu --draft $draft --max-new-tokens 128 --threads 2 --json | python3 -c "import json,sys; d=json.load(sys.stdin); d.pop('text'); ids=d.pop('token_ids'); print(json.dumps(d)); print('ids', hash(tuple(ids)))"
  done
done
