#!/usr/bin/env bash
# Install into .venv and run the test suite (unit, dist, e2e; gpu tests skip without CUDA).
#   bash launch/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
exec .venv/bin/python -m pytest "${@:-tests}"
