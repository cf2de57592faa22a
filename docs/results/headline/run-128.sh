#!/bin/bash
# Part 3 of the headline sweep: 128 users for arena + disk (what the cliff rule asks: does it
# still hold 80% of its peak?) and the kvtier fleet, into the same OUT as run.sh (same
# settings; a sweep resumes with other users and configurations). The other lines at 128
# users were not run: device only takes ~9 minutes a run there, and it fell at 8 users.
# Usage: docs/results/headline/run-128.sh OUT [SECONDS]
set -eu
out=${1:?the output folder of run.sh}
limit=${2:-2400}
flock /tmp/kvtier-heavy.lock timeout --signal=INT --kill-after=120 "$limit" \
  kvtier bench sweep \
    --configs arena+disk,2x+cache \
    --users 128 --history 4000 --num-rounds 4 --warmup-rounds 1 \
    --shared-system-prompt 500 --question-len 50 --answer-len 32 \
    --device-blocks 160 --max-model-len 8192 --arena-size 256MiB --disk-size 8GiB \
    --repeat 3 --out "$out"
