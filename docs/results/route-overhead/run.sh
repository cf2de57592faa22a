#!/usr/bin/env bash
# kvtier bench route: roundrobin (one-line completions) and cache (growing chats opening with
# about 4000 tokens), 200 sequential requests per path and 16 clients for 3 s, three repeats of each, interleaved (rr, cache, rr, cache, rr, cache).
# Usage, from the repository root, the virtualenv's python on PATH:
#   flock /tmp/kvtier-heavy.lock timeout 600 docs/results/route-overhead/run.sh OUT_DIR
set -euo pipefail
out=${1:?an output folder}
mkdir -p "$out"
echo "commit $(git rev-parse --short HEAD), $(date -u '+%F %T') UTC"
for i in 1 2 3; do
  for strategy in roundrobin cache; do
    echo "=== $strategy $i $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    flags=()
    [ "$strategy" = cache ] && flags=(--prompt-tokens 4000)
    PYTHONPATH=$PWD python -m kvtier bench route --strategy "$strategy" "${flags[@]}" \
      --requests 200 --concurrency 16 --duration-s 3 \
      --json "$out/$strategy-$i.json"
  done
done
