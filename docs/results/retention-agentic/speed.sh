#!/usr/bin/env bash
# Replay speed with hints: this checkout (new) against a baseline checkout (base), interleaved.
# Usage: speed.sh CONVERSATION_TRACE AGENT_SLICE BASELINE_CHECKOUT
#   CONVERSATION_TRACE  Mooncake conversation_trace.jsonl; AGENT_SLICE: lines 8001-8300 of
#   the agentic trace (run.sh writes it as speed.jsonl). Run from the repository root under
#   flock /tmp/kvtier-heavy.lock, with the virtualenv's python on PATH.
set -euo pipefail
conv=$1
slice=$2
base=$3
for rep in 1 2 3; do
  for side in new base; do
    dir=$PWD
    [ "$side" = base ] && dir=$base
    line=$(cd "$dir" && PYTHONPATH=$dir python -m kvtier trace simulate "$conv" \
      --tier host=3Mtok --hints continues:inf | grep '^replay')
    echo "rep $rep $side conversation lru 3Mtok continues:inf: $line"
    line=$(cd "$dir" && PYTHONPATH=$dir python -m kvtier trace simulate "$slice" \
      --block-tokens 64 --tier host=1Mtok --hints router:120 | grep '^replay')
    echo "rep $rep $side agentic-slice lru 1Mtok router:120: $line"
  done
done
echo "done $(date -u)"
