#!/usr/bin/env bash
# kvtier bench ttft without the shared-tier cases, three times in a row: each run measures
# recompute, device hit, arena hit and disk hit on the same prompts (median of 3 prompts
# each, every prompt in the JSON), and throughput without reuse with the kvtier connector,
# no connector and the no-op connector.
# Usage, from the repository root, the virtualenv's python on PATH:
#   flock /tmp/kvtier-heavy.lock timeout 600 docs/results/ttft/run.sh OUT_DIR
set -euo pipefail
out=${1:?an output folder}
mkdir -p "$out"
echo "commit $(git rev-parse --short HEAD), $(date -u '+%F %T') UTC"
for i in 1 2 3; do
  echo "=== repeat $i $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=$PWD python -m kvtier bench ttft --shared none --json "$out/ttft-$i.json"
done
