#!/usr/bin/env bash
# kvtier bench agents: agent sessions through one vLLM instance behind kvtier route, retention
# hints on against off, three interleaved repeats (on, off, on, off, on, off). Each repeat's
# pair runs under the machine's heavy-work lock of its own, released between repeats.
# Usage: run.sh [OUT]   (from the repository root, the virtualenv's python on PATH)
set -euo pipefail
out=${1:-/tmp/retention-e2e}
flags=(--sessions 32 --turns 8 --system-prompt 256 --context-len 1024 --tool-result-len 128
       --user-message-len 48 --answer-len 8 --tool-call-share 0.8 --time-scale 0.05
       --arrival-window 120 --seed 0 --arena-size 20MiB --device-blocks 33
       --max-model-len 4096 --dtype float32)
for rep in 1 2 3; do
  flock /tmp/kvtier-heavy.lock timeout 900 env PYTHONPATH="$PWD" \
    python -m kvtier bench agents --out "$out" --retention on,off "${flags[@]}"
done
PYTHONPATH="$PWD" python -m kvtier bench agents --out "$out" --report
