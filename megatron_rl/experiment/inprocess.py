"""An experiment's runs inside the runner's own process, one after another (`runner: in_process | pooled`).

    megatron-rl experiment --config experiments/grpo_vs_sft.yaml       # runner: pooled (the default)

A run launched as its own process (runner.launch_process) pays Python's start-up and the driver's
imports (torch, transformers, Ray's client, the project) and a Ray connect before it does anything;
here the runner, which already holds the experiment's shared Ray cluster (shared_ray), calls
`train.cli.run_one(command, cfg, pool)` with the run's config, loaded from its overrides (no command
line is built or parsed), so the runs after the first find all of that done.  `pool` is the
runner's EnginePool for `runner: pooled` (train/engine_pool.py), None for `in_process`.

Each run is still its own run: the same config (run dir, seeds, queue/WAL, checkpoints, metrics,
run_manifest), its own console session (RUN_DIR/logs/, its output and final JSON line in the
experiment's log for it), its exit code the one its process would have had, and its own actors
(engines, learners, coordinator), which it closes (or parks in the pool) before it returns.  Its
summary is the value run_one returns.  What it leaves in this process are imported modules and warm
caches, nothing of the run's state.  Before each run the cluster must be free again but for what the
pool keeps (a run whose actors did not all let go of their resources is logged); a failed run ends
the experiment (its cluster goes down with the runner), so nothing of it reaches the next run.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
import traceback
from pathlib import Path

from megatron_rl.experiment.runs import Outcome, Run

logger = logging.getLogger(__name__)

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGINT") if hasattr(signal, name))


def exit_code(err: SystemExit) -> int:
    """What the process would have exited with (sys.exit semantics)."""
    if err.code is None:
        return 0
    return err.code if isinstance(err.code, int) else 1


def launch_in_process(run: Run, log: Path, pool=None) -> Outcome:
    """Run `run` in this process, its output to `log`, with the experiment runner's EnginePool `pool` (or
    None); its exit code is the one its process would have had (0 done, 2 bad input, 75 requeue, 81-87 stop
    conditions, 1 a bug), its summary the one run_one returned."""
    from megatron_rl.cli import run_command
    from megatron_rl.train.cli import plan_or_attach, print_summary, run_one

    if run.faults:  # its fault would reach this process's later runs too (experiment/config.py Arm.faults)
        raise ValueError(f"run {run.arm} seed {run.seed} injects faults and must run as its own process")
    check_released(pool)  # the previous run's actors have let go (counted in this run's start-up, not the last's work)
    log.parent.mkdir(parents=True, exist_ok=True)
    handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}  # the run's StopFlag installs its own
    summary: dict = {}

    def body() -> int:
        cfg = run.config()
        plan_or_attach(cfg, dry_run=False)
        summary.update(run_one(run.command, cfg, pool))
        print_summary(summary)
        return 0

    t0 = time.time()
    with log.open("w", buffering=1) as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            rc = run_command(run.command, body)
        except SystemExit as err:  # StopConditionMet, requeue (75): their code, as the process's
            rc = exit_code(err)
        except KeyboardInterrupt:
            raise
        except Exception:  # a bug: its traceback where the process would have printed it
            traceback.print_exc(file=f)
            rc = 1
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    logger.info("in-process run %s %s seed %d: exit %d after %.1f s", run.command, run.arm, run.seed, rc,
                time.time() - t0)
    return Outcome(rc, summary if rc == 0 else {})


def check_released(pool=None, timeout_s: float = 20.0) -> bool:
    """True once every CPU/GPU of the cluster is free (the previous run closed its actors) but what the
    experiment's EnginePool `pool` keeps (train/engine_pool.py); a warning naming what is still held
    otherwise (this run may not be placed)."""
    import ray

    if not ray.is_initialized():
        return True
    kept = pool.reserved() if pool is not None else {}
    deadline = time.monotonic() + timeout_s
    held: dict = {}
    while time.monotonic() < deadline:
        total, free = ray.cluster_resources(), ray.available_resources()
        # Held beyond what the pool keeps; below it (negative): Ray's resource view does not show the pool's
        # reservation yet (it lags a new placement group), so nothing can be said of the rest yet either.
        held = {k: total.get(k, 0.0) - free.get(k, 0.0) - kept.get(k, 0.0) for k in ("CPU", "GPU")}
        held = {k: v for k, v in held.items() if abs(v) > 1e-6}
        if not held:
            return True
        time.sleep(0.5)
    logger.warning("after an in-process run the cluster still holds %s beyond the engine pool's reservation "
                   "(negative: the reservation not yet seen): an actor of it did not end", held)
    return False
