"""megatron-rl: RL post-training of LLMs with Megatron-Core learners and vLLM rollouts.

Run `megatron-rl --help` for the subcommands.
"""

__version__ = "0.1.0"
