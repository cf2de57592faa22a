#!/usr/bin/env bash
# Replay speed of kvtier trace simulate on a generated trace: five tier configurations, three
# repeats, interleaved (each repeat runs all five in turn); the `replay` line of each.
# Usage, from the repository root, the virtualenv's python on PATH:
#   flock /tmp/kvtier-heavy.lock timeout 600 docs/results/replay-speed/run.sh WORK_DIR
set -euo pipefail
work=${1:?a work folder (the generated trace goes there)}
mkdir -p "$work"
export PYTHONPATH=$PWD
echo "commit $(git rev-parse --short HEAD), $(date -u '+%F %T') UTC"
python -m kvtier trace generate --sessions 27000 --seed 1 -o "$work/gen1m.jsonl"
configs=("--tier host=300ktok"
         "--tier host=300ktok --eviction arc"
         "--tier host=300ktok --eviction s3fifo"
         "--tier host=150ktok --tier disk=600ktok --admission after_uses=2"
         "--tier host=150ktok --tier disk=600ktok:write=back")
for i in 1 2 3; do
  echo "=== repeat $i $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  for c in "${configs[@]}"; do
    # shellcheck disable=SC2086
    line=$(python -m kvtier trace simulate "$work/gen1m.jsonl" $c | grep '^replay')
    echo "$c: $line"
  done
done
