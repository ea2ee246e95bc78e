"""megatron-rl: RL post-training of LLMs with Megatron-Core learners and vLLM rollouts.

Run `megatron-rl --help` for the subcommands.
"""

__version__ = "0.1.0"

from megatron_rl import te_import as _te_import

_te_import.install()  # before any Megatron import: a TE that does not load reads as absent (te_import.py)
