#!/usr/bin/env bash
# The fault tests (`make faults`): each kills one part of a `kvtier serve --instances 2` stack
# under a two-client request loop and prints how long the part took to come back and what
# the loop saw. -s shows those lines; -rA lists every test's outcome.
# Usage, from the repository root, the virtualenv's python on PATH, with the services the
# tests need installed (`make setup system-deps`):
#   flock /tmp/kvtier-heavy.lock docs/results/faults/run.sh
set -euo pipefail
echo "commit $(git rev-parse --short HEAD), $(date -u '+%F %T') UTC, load $(cut -d' ' -f1-3 /proc/loadavg)"
timeout 2400 python -m pytest -q -m faults -s -rA -p no:cacheprovider \
  tests/vllm/test_e2e_supervise.py tests/vllm/test_e2e_supervise_vllm_router.py
echo "ended $(date -u '+%F %T') UTC"
