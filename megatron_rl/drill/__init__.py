"""Fault drills (issue #12): a real training run, one injected fault, one JSON record of what happened.

    megatron-rl drill oom --config configs/tiny_cpu_scratch.yaml [--at-step 1] [run.steps=4 ...]
    python -m benchmarks.drills                                     # every drill, one table

Each drill runs `megatron-rl train` in subprocesses (shortened: DEFAULT_OVERRIDES), injects its
fault through the documented hook (fault_hooks.py, the MEGATRON_RL_DRILL variable) or
by damaging files between two attempts, reruns the same command where the protocol says so, and
reports (Record): what was detected, by what, the action taken, whether the run recovered, the
steps redone, the trajectories lost and duplicated, policy-version continuity and the time from
injection to the first step learned after it.

Accounting (`account`): every learner step appends the ids it learned from to RUN_DIR/consumed.jsonl
(Reporter.record_consumed), the last line of a step being the attempt that counts.  An id is
*acknowledged* once a queue (any attempt's WAL, copied before a rerun replaces it) accepted it or a
learner took it; it is *accounted* if a final step learned from it, the final WAL still holds it, or
the final WAL dropped it with a reason.  lost = acknowledged - accounted; duplicated = ids learned
by two final steps.

Modules: harness.py (DrillConfig, a drill's training attempts and evidence), faults.py (how each drill
injects its fault and what counts as recovered), accounting.py (lost, duplicated, redone, versions),
cli.py (`megatron-rl drill`); the switch the failing component reads is megatron_rl/fault_hooks.py.
"""
