#!/usr/bin/env bash
# kvtier bench shared on S3: the s3 tier against plain boto3 on a SeaweedFS the bench starts on
# loopback, three times in a row (each run alternates tier and boto3 calls on the same objects).
# Usage, from the repository root, the virtualenv's python on PATH:
#   flock /tmp/kvtier-heavy.lock timeout 600 docs/results/shared-s3/run.sh OUT_DIR
set -euo pipefail
out=${1:?an output folder}
mkdir -p "$out"
echo "commit $(git rev-parse --short HEAD), $(date -u '+%F %T') UTC"
for i in 1 2 3; do
  echo "=== repeat $i $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=$PWD python -m kvtier bench shared --backends s3 --json "$out/repeat-$i.json"
done
