"""Several one-run drills in one training run: their faults armed together (one start-up), one record each.

    megatron-rl drill together --drills verifier_timeout,bad_refit,coordinator_stop \
        --config configs/tiny_cpu_scratch.yaml --at-step 1 --steps 3

Each drill of TOGETHER injects its fault through its own hook in one training run (MEGATRON_RL_DRILL
holds the list of specs, fault_hooks.py) and is judged on that run by its own rules (drill/faults.py
SINGLE_RUN), its recovery timed from its own injection.  The accounting (lost, duplicated, redone,
versions) is the run's, the same in every record.  Two engine kills in one run restart the group twice
(`engine_restarts` 2.0, one per death).  Each drill runs with its default variant.  Prints
{"together": [...], "records": {drill: record}}; exit 0 when every record is recovered with nothing
lost or duplicated.  A start-up costs ~70 s on 2 CPU cores: the drill tests run their one-run drills
this way.
"""

from __future__ import annotations

import dataclasses
import time

from megatron_rl.drill.accounting import account, recovery_time
from megatron_rl.drill.faults import SINGLE_RUN
from megatron_rl.drill.harness import Drill, DrillConfig

TOGETHER = tuple(SINGLE_RUN)
"""The drills that may share a run: one training attempt, a hook-armed fault, judged on what only it touches."""


def check_names(names: list[str]) -> None:
    """Bad input gets an error naming the problem: unknown, repeated or not one-run drills."""
    if not names:
        raise ValueError("drill together: --drills names no drill")
    wrong = [n for n in names if n not in TOGETHER]
    if wrong:
        raise ValueError(f"drill together: {', '.join(wrong)} cannot share a run; choose from {', '.join(TOGETHER)}")
    if len(set(names)) != len(names):
        raise ValueError(f"drill together: a drill is named twice in {','.join(names)}")


def run_together(names: list[str], cfg: DrillConfig) -> dict:
    """Run `names` in one training run of `cfg` (its name is one of them; its variant is ignored)."""
    check_names(names)
    cfgs = {n: dataclasses.replace(cfg, name=n, variant=None) for n in names}
    drill = Drill(cfgs[names[0]])
    specs, extra = [], []
    for name in names:
        fault, more = SINGLE_RUN[name][0](cfgs[name])
        specs.append(fault)
        extra += [e for e in more if e not in extra]
    t0 = time.time()
    run = drill.train(fault=specs, extra=tuple(extra))
    common = account(drill)
    records = {}
    for name, spec in zip(names, specs):
        record = {"fault": name, "injected_at": {"step": cfg.at_step}}
        record.update(SINGLE_RUN[name][1](drill, run, cfgs[name]))
        record.update(common)
        record["time_to_recover_s"] = recovery_time(drill, spec["fault"]) if record.get("recovered") else None
        record["attempts"] = [{"exit": a.returncode, "seconds": round(a.ended - a.started, 1)} for a in drill.attempts]
        record["together_with"] = [n for n in names if n != name]
        record["wall_s"] = round(time.time() - t0, 1)
        record["run_dir"] = str(drill.run_dir)
        records[name] = record
    return {"together": list(names), "records": records}


def all_recovered(result: dict) -> bool:
    return all(r.get("recovered") and r["trajectories_lost"] == 0 and r["trajectories_duplicated"] == 0
               for r in result["records"].values())
