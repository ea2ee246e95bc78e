"""The audit: re-score sequences whose response spans several policy versions under the weights of each
segment's version, and compare with the logprobs the sampler recorded (issue 27, item 4).

    megatron-rl audit RUN_DIR [--sequences N] [--json]      # offline, from what a run directory keeps
    audit.every: N                                         # inside training (train/driver.py)

    config.py     AuditConfig (the `audit:` section) and the size of the learner's weight ring
    compare.py    the rule: per segment max |Δ logprob|, which segments are judged, the verdict
    rescore.py    teacher-forced logprobs of trajectories' responses, one scoring call per version
    ring.py       the learner rank's host ring of recent versions' weights
    auditor.py    the in-training check (every N steps, the batch just taken)
    run_dir.py    what a run directory keeps: trajectories, weights of version 0 and checkpoints
    offline.py    a one-rank learner that re-scores with those weights

`megatron-rl audit RUN_DIR` itself is megatron_rl/audit_cli.py (it reads the run's TrainConfig, train/).
"""
