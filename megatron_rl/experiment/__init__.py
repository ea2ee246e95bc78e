"""Experiments: arms x seeds of real runs, pre-registered, judged by a paired bootstrap.

    megatron-rl experiment --config experiments/grpo_vs_sft.yaml [--dry-run]

runner.py runs them, inprocess.py inside the runner's process, slurm.py as array jobs; report.py
analyses them; cli.py is the command.
"""
