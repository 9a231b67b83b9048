#!/bin/bash
# usage: one_request.sh THREADS PORT [ENV=VALUE...]: `flowedge up --nodes 3` on the real pair, two prompts of 64 tokens one at a time, decode tok/s each
T=$1; P=$2; shift 2
cd "$(git rev-parse --show-toplevel)"
env "$@" .venv/bin/python -m flowedge up --nodes 3 --threads $T --detach --port $P --model qwen2.5-coder-1.5b > /tmp/up-$T-$P.log 2>&1 || { echo "up failed"; tail -5 /tmp/up-$T-$P.log; exit 1; }
.venv/bin/python -m flowedge prompt "Say hi." --json --max-new-tokens 8 --head 127.0.0.1:$P > /dev/null 2>&1
for p in "Write a Python function that checks whether a string is a palindrome, with a docstring and two examples." "Explain in a short paragraph why the sky is blue."; do
  .venv/bin/python -m flowedge prompt "$p" --json --max-new-tokens 64 --head 127.0.0.1:$P 2>/dev/null | tail -1 | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); d=r['client_wall_s']-r['first_token_s']; print('threads $T', r.get('strategy'), r['new_tokens'], 'decode tok/s', round((r['new_tokens']-1)/d,2))"
done
.venv/bin/python -m flowedge down --port $P > /dev/null 2>&1
