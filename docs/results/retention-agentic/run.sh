#!/usr/bin/env bash
# Router-derived retention hints on public Claude Code agent traces, and on the Mooncake
# conversation trace. Usage: run.sh TRACES_DIR CONVERSATION_TRACE WORK_DIR
#   TRACES_DIR          callanjfox/kv-cache-tester's traces/ (commit 94f6046), kept outside
#   CONVERSATION_TRACE  Mooncake FAST25-release/traces/conversation_trace.jsonl
#   WORK_DIR            where the merged trace, its tuning slice and the outputs go
# Run from the repository root with the virtualenv's python on PATH. The points are
# independent; each full-trace replay takes minutes, so they run side by side.
set -euo pipefail
traces=$1
conv=$2
work=$3
sim() { PYTHONPATH=$PWD python -m kvtier trace simulate "$@"; }
agents=$work/agents.jsonl
PYTHONPATH=$PWD python -m kvtier trace agents "$traces" --stagger-s 600 --seed 0 -o "$agents"
sed -n 8001,11000p "$agents" > "$work/tune.jsonl"   # the tuning slice (12 h, 7.4 M accesses)
X

echo "== tuning slice, LRU host=500ktok"
for hints in none session session:120,600,35 session:60,600,50 session:120,600,20 router:120 \
    session:30,600,35 session:60,900,40; do
  echo "-- --hints $hints: $(sim "$work/tune.jsonl" --block-tokens 64 --tier host=500ktok \
    --hints "$hints" | grep 'block hit ratio')"
done
echo "-- --hints session:120,600,20 --hint-priority 35: $(sim "$work/tune.jsonl" \
  --block-tokens 64 --tier host=500ktok --hints session:120,600,20 --hint-priority 35 \
  | grep 'block hit ratio')"

echo "== full agentic trace"
sim "$agents" --block-tokens 64 --tier host=500ktok --hints none > "$work/p-lru-500ktok-none.txt" 2>&1 &
sim "$agents" --block-tokens 64 --tier host=1Mtok --hints none > "$work/p-lru-1Mtok-none.txt" 2>&1 &
PYTHONPATH=$PWD python - "$agents" > "$work/infinite.txt" <<'PY' &
import sys
from kvtier.trace.formats import load_trace
trace = load_trace(sys.argv[1], block_tokens=64)
seen, hits, total = set(), 0, 0
for r in trace.requests:  # an infinite host: the leading run of blocks seen before
    k = 0
    for b in r.blocks:
        if b not in seen:
            break
        k += 1
    hits += k
    total += len(r.blocks)
    seen.update(r.blocks)
print(f"infinite host: block hit ratio {hits / total:.4f} ({hits:,} of {total:,})")
PY
for point in "500ktok lru session" "500ktok lru session:30,600,35" "1Mtok lru session" \
    "1Mtok lru session:30,600,35" "1Mtok lru continues:60" "1Mtok prefix none" \
    "1Mtok prefix session"; do
  set -- $point
  sim "$agents" --block-tokens 64 --tier host=$1 --eviction "$2" --hints "$3" \
    > "$work/p-$2-$1-$3.txt" 2>&1 &
done
wait
for f in "$work"/infinite.txt "$work"/p-*.txt; do echo "-- $f"; cat "$f"; done

echo "== conversation trace: hints the router derives (it has no stop reasons) and none"
for hints in session none; do
  echo "-- --hints $hints"
  sim "$conv" --sweep 1Mtok,3Mtok --eviction lru,s3fifo,prefix --hints "$hints" 2>/dev/null
done
echo "done $(date -u)"
