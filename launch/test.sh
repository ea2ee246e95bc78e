#!/usr/bin/env bash
# Install into .venv and run the test suite (unit, dist, e2e, security; gpu tests skip without CUDA).
#   bash launch/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
# With no arguments: every tier, two tests at a time (pytest-xdist; tests/lanes.py keeps a module on one worker and
# runs `alone` tests with no engine beside them): on this suite's 2 cores, same day and machine, 46.3 min against
# 61.6 one at a time (tests/README.md).  MEGATRON_RL_TEST_WORKERS=1: one at a time, plain pytest.
if [ $# -eq 0 ]; then
  workers="${MEGATRON_RL_TEST_WORKERS:-2}"
  if [ "$workers" -gt 1 ]; then set -- tests -n "$workers" --dist loadfile --no-loadscope-reorder; else set -- tests; fi
fi
exec .venv/bin/python -m pytest "$@"
