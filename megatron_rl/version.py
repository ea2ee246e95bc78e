"""The package version (megatron_rl.__version__; checkpoints and converted models record it)."""

__version__ = "0.1.0"
