#!/bin/bash
# A/B of the draft head's starting weights: the base's last layer vs random, same records, same step budget.
set -x
F=flowedge
nice -n 15 $F draft-head train --init last-layer --out work/ll/head.safetensors --work work/ll \
   --threads 1 --eval-every 25 --checkpoint-every 25 --max-minutes 30 > work/ll.log 2>&1
mkdir -p work/rand && cp -r work/ll/records work/ll/vocab.pt work/rand/ 2>/dev/null
nice -n 15 $F draft-head train --init random --out work/rand/head.safetensors --work work/rand \
   --threads 1 --eval-every 25 --checkpoint-every 25 --max-minutes 30 > work/rand.log 2>&1
