#!/usr/bin/env bash
# kvtier bench agents: agent sessions through one vLLM instance behind kvtier route, retention
# hints on against off, three interleaved repeats (on, off, on, off, on, off), each run on a
# fresh stack. Each repeat's pair runs under the machine's heavy-work lock (about 9 minutes),
# released between repeats.
# Usage: run.sh [OUT [FIRST_REPEAT]]   (from the repository root, the virtualenv's python on
# PATH; FIRST_REPEAT resumes a folder whose earlier repeats ran)
set -euo pipefail
out=${1:-/tmp/retention-e2e}
first=${2:-1}
flags=(--sessions 32 --turns 8 --system-prompt 256 --context-len 1024 --tool-result-len 128
       --user-message-len 48 --answer-len 8 --tool-call-share 0.8 --time-scale 0.05
       --arrival-window 120 --seed 0 --arena-size 20MiB --device-blocks 33
       --max-model-len 4096 --dtype float32)
for rep in $(seq "$first" 3); do
  flock /tmp/kvtier-heavy.lock timeout 900 env PYTHONPATH="$PWD" \
    python -m kvtier bench agents --out "$out" --retention on,off "${flags[@]}"
done
PYTHONPATH="$PWD" python -m kvtier bench agents --out "$out" --report
