# Sourced by launch/install.sh on GPU installs (issue 31, item 1): where Transformer Engine's build
# finds nvcc and the cuDNN headers, and whether the installed torch sees the GPU.
#   source launch/cuda_toolkit.sh
#   home=$(cuda_home_for_te SITE_PACKAGES) || exit 1   # CUDA_HOME to export ("" = TE finds nvcc itself)
#   cudnn=$(cudnn_path_for_te SITE_PACKAGES)            # CUDNN_PATH to export ("" = leave it)
#   torch_sees_gpu .venv/bin/python || exit 1
# Each prints one message on stderr when it fails.

# cuda_home_for_te SITE_PACKAGES [SYSTEM_CUDA (default /usr/local/cuda)]
# TE's build (2.11) looks for nvcc in $CUDA_HOME/bin, then on PATH, then in /usr/local/cuda/bin, and
# failing those for a CUDA 12 runtime wheel; the CUDA 13 wheels torch 2.13 brings are named otherwise,
# so it stops with a RuntimeError of its own.  Those wheels hold nvcc (nvidia-cuda-nvcc): CUDA 13
# unpacks every component into SITE/nvidia/cu13/{bin,include,lib}; CUDA 12 gives each its own folder
# (SITE/nvidia/cuda_nvcc/bin/nvcc).
cuda_home_for_te() {
  local site=$1 system=${2:-/usr/local/cuda} dir
  if [ -n "${CUDA_HOME:-}" ]; then
    if [ -x "$CUDA_HOME/bin/nvcc" ]; then echo "$CUDA_HOME"; return 0; fi
    echo "install.sh: CUDA_HOME=$CUDA_HOME has no bin/nvcc, where Transformer Engine's build looks for it; point CUDA_HOME at a CUDA toolkit, or unset it to let install.sh look on PATH, in $system and in the venv's CUDA wheels." >&2
    return 1
  fi
  if command -v nvcc >/dev/null 2>&1 || [ -x "$system/bin/nvcc" ]; then echo ""; return 0; fi
  for dir in "$site/nvidia/cu13" "$site/nvidia/cuda_nvcc"; do
    if [ -x "$dir/bin/nvcc" ]; then echo "$dir"; return 0; fi
  done
  echo "install.sh: no nvcc found (not in CUDA_HOME, on PATH, in $system/bin, or in the venv's CUDA wheels $site/nvidia/cu13/bin and $site/nvidia/cuda_nvcc/bin); Transformer Engine's PyTorch part is compiled with it. Install the CUDA toolkit (or '.venv/bin/pip install nvidia-cuda-nvcc'), or install a prebuilt Transformer Engine wheel into .venv (README: GPU install), then rerun this script." >&2
  return 1
}

# cudnn_path_for_te SITE_PACKAGES: the pip cuDNN (nvidia-cudnn-cu13) when CUDNN_PATH/CUDNN_HOME are unset.
cudnn_path_for_te() {
  local site=$1
  if [ -z "${CUDNN_PATH:-}${CUDNN_HOME:-}" ] && [ -f "$site/nvidia/cudnn/include/cudnn.h" ]; then
    echo "$site/nvidia/cudnn"
  fi
}

# torch_sees_gpu PYTHON: torch.cuda.is_available() after the GPU install.  A CUDA 13 torch on an older
# driver installs without complaint and then sees no GPU, and every platform check would say "cpu".
torch_sees_gpu() {
  local python=$1 seen build driver
  seen="$("$python" -c 'import torch; print(torch.cuda.is_available())' 2>/dev/null | tail -n 1)"
  [ "$seen" = True ] && return 0
  build="$("$python" -c 'import torch; print(torch.__version__, "built for CUDA", torch.version.cuda)' 2>&1 | tail -n 1)"
  driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
  echo "install.sh: torch.cuda.is_available() is False after the GPU install (torch: ${build:-?}; NVIDIA driver: ${driver:-not reported by nvidia-smi}). A driver older than torch's CUDA build cannot run it: update the driver or install a torch built for the driver's CUDA; also check CUDA_VISIBLE_DEVICES. MEGATRON_RL_SKIP_CUDA_CHECK=1 installs without this check (e.g. on a node without a GPU)." >&2
  return 1
}
