#!/bin/bash
# The headline figure (the seed's Figure 1) with repeats, run in parts: each call goes on where
# the last one stopped (kvtier bench sweep keeps every finished run in OUT/runs/).
# Usage: docs/results/headline/run.sh OUT [SECONDS]   (default: stop after 3 hours)
# To continue from the runs committed here: mkdir -p OUT && cp -r docs/results/headline/runs OUT/
set -eu
out=${1:?an output folder}
limit=${2:-10800}
flock /tmp/kvtier-heavy.lock timeout --signal=INT --kill-after=120 "$limit" \
  kvtier bench sweep \
    --configs device+noop,device,arena+disk,lmcache,2x-plain+vllm-router,2x+cache \
    --users 2,4,8,16,32,64 --history 4000 --num-rounds 4 --warmup-rounds 1 \
    --shared-system-prompt 500 --question-len 50 --answer-len 32 \
    --device-blocks 160 --max-model-len 8192 --arena-size 256MiB --disk-size 8GiB \
    --repeat 3 --out "$out"
