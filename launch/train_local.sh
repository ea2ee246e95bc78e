#!/usr/bin/env bash
# Install into .venv and run GRPO training on this machine (no Slurm): Ray is started locally.
#   bash launch/train_local.sh [CONFIG] [dotted.key=value ...]     # default configs/tiny_cpu.yaml
# On a machine with a GPU the installer picks the CUDA build; the same config runs there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
config="${1:-configs/tiny_cpu.yaml}"
shift || true
exec .venv/bin/megatron-rl train --config "$config" "$@"
