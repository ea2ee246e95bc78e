"""megatron-rl: RL post-training of LLMs with Megatron-Core learners and vLLM rollouts.

Run `megatron-rl --help` for the subcommands; from Python (megatron_rl/api.py):

    from megatron_rl import train, evaluate
    summary = train("configs/tiny_cpu.yaml", overrides=["run.steps=10"], reward_function=my_reward)
"""

from megatron_rl.version import __version__  # noqa: F401  (written in version.py)

from megatron_rl import te_import as _te_import

_te_import.install()  # before any Megatron import: a TE that does not load reads as absent (te_import.py)


def evaluate(*args, **kwargs):
    """megatron_rl.api.evaluate: `megatron-rl eval` from Python."""
    from megatron_rl.api import evaluate as _evaluate

    return _evaluate(*args, **kwargs)
