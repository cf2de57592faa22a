#!/bin/bash
# Lookups while a peer floods the journal, this tree ("after") against main before the
# bookings work ("before": fd9a002, with the same flood case copied in), runs interleaved.
# Each run is `kvtier bench micro --cases flood`: 3 quiet and 3 flooded phases, interleaved.
# Usage: flock /tmp/kvtier-heavy.lock docs/results/journal-flood/run.sh OUT_DIR
set -eu
out=${1:?an output folder}
here=$(cd "$(dirname "$0")/../../.." && pwd)
base=$(mktemp -d /tmp/kvtier-flood-base-XXXXXX)
git -C "$here" archive fd9a002 kvtier | tar -x -C "$base"
cp "$here/kvtier/bench/flood.py" "$base/kvtier/bench/"
mkdir -p "$out"
for i in 1 2; do
  echo "=== after $i $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=$here python -m kvtier.cli bench micro --cases flood --json "$out/after-$i.json" \
    2>&1 | grep -v "^tier shared"
  echo "=== before $i $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd "$base" && PYTHONPATH=$base python -c "
import json
from kvtier.bench import flood
rows, figs = flood.bench(None, 3)
for row in rows:
    print(row)
json.dump(figs, open('$out/before-$i.json', 'w'), indent=2, sort_keys=True)
" 2>&1 | grep -v "^tier shared")
done
rm -rf "$base"
