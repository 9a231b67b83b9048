#!/bin/bash
# usage: three_at_once.sh THREADS PORT [ENV=VALUE...]: `flowedge up --nodes 3` on the real pair, three prompts of 64 tokens at once, aggregate tok/s
T=$1; P=$2; shift 2
cd "$(git rev-parse --show-toplevel)"
env "$@" .venv/bin/python -m flowedge up --nodes 3 --threads $T --detach --port $P --model qwen2.5-coder-1.5b > /tmp/up-$T-$P.log 2>&1 || { echo "up failed"; exit 1; }
.venv/bin/python -m flowedge prompt "Say hi." --json --max-new-tokens 8 --head 127.0.0.1:$P > /dev/null 2>&1
start=$(date +%s.%N)
for p in "Write a Python function that checks whether a string is a palindrome." "Explain in a short paragraph why the sky is blue." "List five uses of a Raspberry Pi in a home."; do
  ( .venv/bin/python -m flowedge prompt "$p" --json --max-new-tokens 64 --head 127.0.0.1:$P 2>/dev/null | tail -1 > /tmp/conc-$P-$RANDOM.json ) &
done
wait
end=$(date +%s.%N)
python3 -c "
import json,glob
rs=[json.load(open(f)) for f in glob.glob('/tmp/conc-$P-*.json')]
n=sum(r['new_tokens'] for r in rs); print('threads $T concurrent 3:', n, 'tokens in', round($end-$start,1), 's ->', round(n/($end-$start),2), 'tok/s aggregate;', [r.get('strategy') for r in rs])"
rm -f /tmp/conc-$P-*.json
.venv/bin/python -m flowedge down --port $P > /dev/null 2>&1
