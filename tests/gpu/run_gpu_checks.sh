#!/usr/bin/env bash
# GPU checks in one go (TE-vs-local spec parity in bf16, NCCL init + a learner step).
#   bash tests/gpu/run_gpu_checks.sh [pytest args]
# Needs a CUDA machine with the GPU extra installed (bash launch/install.sh picks it).
set -euo pipefail
cd "$(dirname "$0")/../.."
python=".venv/bin/python"
[ -x "$python" ] || python=python3
nvidia-smi -L
"$python" -c "import torch; assert torch.cuda.is_available(), 'CUDA not available'; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
exec "$python" -m pytest tests/gpu -m gpu -q -rs -p no:warnings "$@"
