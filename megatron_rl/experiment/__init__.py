"""Experiments: arms x seeds of real runs, registered before they run, judged by a paired bootstrap.

    megatron-rl experiment --config experiments/grpo_vs_sft.yaml [--dry-run]    # cli.py

An experiment file (config.py) names a base training config, the arms (each a command -- `sft` or
`train` -- with dotted overrides, optionally starting from another arm's run of the same seed),
the seeds, and the pre-registration: hypothesis, primary metric (hidden-test correctness),
baseline arm, minimal effect and alpha.  Before the first run the pre-registration is written
to `DIR/preregistration.json`; a later invocation whose pre-registration differs is refused,
so the claim cannot move after the data are in.  Then every (arm, seed) runs (`DIR/runs/<arm>/seed_<s>`),
in dependency order, one after another (runner.py); a run whose `result.json` exists is skipped, so
an interrupted experiment resumes where it stopped.

How the runs run is one field, `runner` (default `pooled`): `process`, each its own `megatron-rl`
process; `in_process`, inside the runner's process (inprocess.py); `pooled`, in_process and a
finished run's rollout engines, learner actors and placement group handed to the next run of the
same shapes (train/engine_pool.py: engines refitted with the run's initial weights through a checked
publication, learners rebuilt in their processes; dropped after a failed run).  What else the runs
share, to cut each run's start-up (benchmarks/bench_experiment_overhead.py): `shared_ray` (default
on) starts one Ray cluster in the runner and the runs connect to it (run.use_existing_ray,
RAY_ADDRESS) instead of each starting its own; every run is still its own Ray job with its own
actors (engine, learner, coordinator and its WAL queue in its run dir).  `engine_in_process`
(default on) runs each vLLM engine inside its rollout actor (rollout.engine_in_process).
`budget_generated_tokens` gives every `train` run the same generated-token budget
(stop.max_generated_tokens): arms are compared at equal generated tokens, and each run's
result.json records the tokens it generated and the budget that stopped it.  Under Slurm,
`--slurm` submits the runs as array jobs instead (slurm.py).

The analysis (report.py) pairs runs on (seed, test example): every arm's per-example correctness on the
hidden test split (written by each run's final eval) against the baseline arm's on the same
seed and example.  The 95% CI of the mean difference comes from SciPy's paired bootstrap
(`scipy.stats.bootstrap(..., paired=True)`, resampling (seed, example) pairs).  The verdict, by the
registered test (preregistration.test): superiority (the default) is "supported" when the CI's lower
bound is above 0 and the mean difference reaches the minimal effect, "contradicted" when the CI's upper
bound is below 0; non_inferiority is "supported" when the lower bound is above -minimal_effect,
"contradicted" when the upper bound is below it; else "inconclusive"; fewer than 3 seeds is
"exploratory" (no verdict).  `report.json`, `report.md` and PNG plots (test
correctness per arm with its CI, dev correctness curves with seed bands) land in DIR.
"""
