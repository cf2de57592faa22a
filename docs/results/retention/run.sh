#!/usr/bin/env bash
# Retention hints on the held-out Mooncake conversation trace, and replay speed.
# Usage: run.sh TRACE [BASELINE_CHECKOUT]   (TRACE: conversation_trace.jsonl, kept outside)
# Run from the repository root with the virtualenv's python on PATH.
set -euo pipefail
trace=$1
base=${2:-}
for hints in none continues:inf continues:600; do
  echo "== --hints $hints"
  PYTHONPATH=$PWD python -m kvtier trace simulate "$trace" --sweep 1Mtok,3Mtok,10Mtok \
    --hints "$hints"
done
echo "== replay speed at 3Mtok: this checkout (new) and the baseline (base), interleaved"
for rep in 1 2 3; do
  for eviction in lru prefix; do
    for hints in none continues:inf; do
      line=$(PYTHONPATH=$PWD python -m kvtier trace simulate "$trace" --tier host=3Mtok \
        --eviction "$eviction" --hints "$hints" | grep '^replay')
      echo "rep $rep new $eviction hints=$hints: $line"
    done
    if [ -n "$base" ]; then
      line=$(cd "$base" && PYTHONPATH=$base python -m kvtier trace simulate "$trace" \
        --tier host=3Mtok --eviction "$eviction" | grep '^replay')
      echo "rep $rep base $eviction hints=none: $line"
    fi
  done
done
