#!/usr/bin/env bash
# GMAC, keyed BLAKE3 and xxh3-64 over the same 1 MiB and 4 MiB payloads on one core, 5
# interleaved rounds each (primitives.py); then `kvtier bench micro --cases trust` three times:
# an fs tier's chunk reads verified with the cluster secret's MAC against the checksum alone,
# 7 interleaved rounds each.
# Usage, from the repository root, the virtualenv's python on PATH:
#   flock /tmp/kvtier-heavy.lock timeout 600 docs/results/primitives/run.sh OUT_DIR
set -euo pipefail
out=${1:?an output folder}
mkdir -p "$out"
echo "commit $(git rev-parse --short HEAD), $(date -u '+%F %T') UTC, load $(cut -d' ' -f1-3 /proc/loadavg)"
python docs/results/primitives/primitives.py --rounds 5 --json "$out/primitives.json"
for i in 1 2 3; do
  echo "=== trust $i $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=$PWD python -m kvtier bench micro --cases trust --json "$out/trust-$i.json"
done
