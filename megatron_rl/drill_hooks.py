"""Fault-injection hooks for `megatron-rl drill` (issue #12): the one switch the failing component reads.

    MEGATRON_RL_DRILL='{"fault": "oom", "at_step": 2, "events": "/abs/run/drill_events.jsonl"}' \
        megatron-rl train --config configs/tiny_cpu_scratch.yaml

A drill is declared in the environment variable MEGATRON_RL_DRILL (a JSON object) of the training
process; Ray actors and grader processes started by it inherit it.  Without the variable every
hook is a no-op costing one dict lookup.  The component that fails asks `drill_spec(fault)` and
injects the fault itself, so a drill exercises the real failure path, not a patched one:

    fault             read by                                what happens
    oom               LearnerWorker.train_step (every rank)  torch.OutOfMemoryError raised inside the
                                                             forward/backward of learner step at_step
                                                             (`times`: how many attempts fail, default 1;
                                                             2 makes the half-micro-batch retry fail too)
    learner_kill      LearnerWorker.train_step (rank `rank`) the rank SIGKILLs itself at learner step at_step
    verifier_timeout  reward.pool grader processes           a share `fraction` of grading calls hang
                                                             (chosen by a hash of response and reference)
    permute_load      publish.vllm_engine (engine processes) publication `at_version` is loaded with the
                                                             rows of its first matrix reversed, after its
                                                             bytes verified (`times` loads, default 1)

`at_step` counts learner steps from 0 (the step about to be learned: learner step s produces policy
version s+1).  Each injection appends {"fault", "at_step", "time", "pid"} to the JSON-lines file
`events` (if given), which the drill report reads to time detection and recovery.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib

logger = logging.getLogger(__name__)

ENV = "MEGATRON_RL_DRILL"
FAULTS = ("oom", "learner_kill", "verifier_timeout", "permute_load")


def drill_spec(fault: str) -> dict | None:
    """The active drill's spec if it injects `fault`, else None.  A malformed variable is an error
    naming it (a drill that silently does not inject would report a false recovery)."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{ENV} is not a JSON object: {err}") from err
    if not isinstance(spec, dict) or spec.get("fault") not in FAULTS:
        raise ValueError(f"{ENV}: 'fault' must be one of {FAULTS}, got {raw!r}")
    return spec if spec["fault"] == fault else None


def record_injection(spec: dict, **extra) -> None:
    """Append one injection event to the spec's events file (best effort: a drill log never fails a run)."""
    logger.warning("drill: injecting %s (%s)", spec["fault"], extra or spec.get("at_step"))
    path = spec.get("events")
    if not path:
        return
    row = {"fault": spec["fault"], "at_step": spec.get("at_step"), "time": time.time(), "pid": os.getpid(), **extra}
    try:
        with open(path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    except OSError as err:
        logger.warning("drill: cannot write %s: %s", path, err)


def hangs(spec: dict, response: str, reference: str) -> bool:
    """Whether this grading call is one of the `fraction` that hang (deterministic per input)."""
    share = float(spec.get("fraction", 0.1))
    h = zlib.crc32(f"{response}\x00{reference}".encode()) / 2**32
    return h < share
