#!/usr/bin/env bash
# The router's session hints as it sets them since it is told the model's tool-call tokens
# (--hints session: set at the answer's end by its own kind) and without them (--hints
# session-prev: by the previous answer), on the agentic trace made by run.sh: the full trace
# at 500 Ktok and 1 Mtok, then variants on its tuning slice.
# Usage: run-finish.sh AGENTS_TRACE TUNING_SLICE   (from the repository root, the virtualenv's
# python on PATH; the full-trace points run two at a time, minutes each)
set -euo pipefail
agents=$1
tune=$2
sim() { PYTHONPATH=$PWD python -m kvtier trace simulate "$@"; }

echo "== full agentic trace, LRU"
for host in 500ktok 1Mtok; do
  for hints in session session-prev; do
    sim "$agents" --block-tokens 64 --tier host=$host --hints $hints \
      > "/tmp/finish-$host-$hints.txt" 2>&1 &
  done
  wait
  for hints in session session-prev; do
    echo "-- host=$host --hints $hints"
    tail -3 "/tmp/finish-$host-$hints.txt"
  done
done

echo "== tuning slice, LRU host=500ktok"
for hints in none session session:10,600,35 session:30,600,35 session:45,600,35 \
    session:20,20,80 session:20,600,20 session-prev session-prev:120,600,50; do
  echo "-- --hints $hints: $(sim "$tune" --block-tokens 64 --tier host=500ktok \
    --hints "$hints" | grep 'block hit ratio')"
done
