"""LearnerConfig validation: every bad value is refused with the field named.

    python -m pytest tests/unit/test_learner_config.py -q
"""

import pytest

from megatron_rl.config import ConfigError, from_dict
from megatron_rl.learner.config import LearnerConfig

pytestmark = pytest.mark.unit


def test_defaults_and_yaml_style_build():
    cfg = from_dict(LearnerConfig, {"tensor_parallel_size": 2, "lr": 1, "global_batch_size": 8,
                                    "micro_batch_size": 2})
    assert cfg.lr == 1.0 and cfg.tensor_parallel_size == 2 and cfg.use_distributed_optimizer


@pytest.mark.parametrize("kwargs,field", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"micro_batch_size": 3, "global_batch_size": 8}, "global_batch_size 8"),
    ({"lr": 0.0}, "lr"),
    ({"min_lr": 1.0, "lr": 0.5}, "min_lr"),
    ({"adam_beta2": 1.0}, "adam_beta2"),
    ({"clip_grad": -1.0}, "clip_grad"),
    ({"lr_decay_style": "cosine"}, "lr_decay_steps"),
    ({"lr_decay_steps": 0}, "lr_decay_steps"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LearnerConfig(**kwargs)


def test_unknown_key_is_a_config_error():
    with pytest.raises(ConfigError, match="tensor_parallel"):
        from_dict(LearnerConfig, {"tensor_parallel": 2})
