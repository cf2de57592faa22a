#!/usr/bin/env bash
# Block hit ratio against host size, per eviction policy, on the two traces of docs/trace.md:
# the generated one (kvtier trace generate, seed 1) and the Mooncake conversation trace.
# The simulator is deterministic: one run of each.
# Usage, from the repository root, the virtualenv's python on PATH:
#   docs/results/trace-sweeps/run.sh WORK_DIR CONVERSATION_TRACE
set -euo pipefail
work=${1:?a work folder (the generated trace goes there)}
conversation=${2:?conversation_trace.jsonl (kept outside the repository)}
mkdir -p "$work"
export PYTHONPATH=$PWD
echo "commit $(git rev-parse --short HEAD), $(date -u '+%F %T') UTC"
python -m kvtier trace generate --sessions 27000 --seed 1 -o "$work/gen1m.jsonl"
echo "== generated trace"
python -m kvtier trace simulate "$work/gen1m.jsonl" --sweep 64ktok,128ktok,256ktok,512ktok,1Mtok,inf
echo "== conversation trace"
python -m kvtier trace simulate "$conversation" --sweep 1Mtok,3Mtok,10Mtok,30Mtok,inf
