#!/bin/bash
# Lookups while a peer floods the journal: this tree ("after") against main ("before"; the
# same flood case copied in), three runs of each, interleaved, the load average before each.
# Each run is `kvtier bench micro --cases flood`: 3 quiet and 3 flooded phases, interleaved.
# Usage: flock /tmp/kvtier-heavy.lock docs/results/journal-flood/run.sh OUT_DIR [BASE]
set -eu
out=${1:?an output folder}
here=$(cd "$(dirname "$0")/../../.." && pwd)
rev=${2:-main}
base=$(mktemp -d /tmp/kvtier-flood-base-XXXXXX)
git -C "$here" archive "$rev" kvtier | tar -x -C "$base"
cp "$here/kvtier/bench/flood.py" "$base/kvtier/bench/"
mkdir -p "$out"
echo "after: $(git -C "$here" rev-parse --short HEAD) (+ uncommitted: $(git -C "$here" status --porcelain kvtier | wc -l) files)"
echo "before: $rev = $(git -C "$here" rev-parse --short "$rev")"
for i in 1 2 3; do
  for side in after before; do
    tree=$here
    [ "$side" = before ] && tree=$base
    echo "=== $side $i $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd "$tree" && PYTHONPATH=$tree python -m kvtier.cli bench micro --cases flood \
      --json "$out/$side-$i.json" 2>&1 | grep -v "^tier shared")
  done
done
echo "=== end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
rm -rf "$base"
