"""GRPO training: the root config, the learner group, the driver loop and the `train` command.

This package is also the Python API's `train` (megatron_rl/api.py): `from megatron_rl import train` gives
this package whether or not it was imported before, so calling it runs a training run.

    from megatron_rl import train
    summary = train("configs/tiny_cpu.yaml", overrides=["run.steps=10"], reward_function=my_reward)
"""

import sys as _sys
import types as _types


class _CallableModule(_types.ModuleType):
    def __call__(self, *args, **kwargs):
        """megatron_rl.api.train: `megatron-rl train` from Python; returns the run's summary."""
        from megatron_rl.api import train as _train

        return _train(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
