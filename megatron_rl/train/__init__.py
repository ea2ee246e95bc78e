"""GRPO training: the root config, the learner group, the driver loop and the `train` command."""
