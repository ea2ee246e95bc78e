"""Whether a placement can start at all, whatever its memory: the one rule for the start-up and the planner.

    problem = startability_problem("colocated", rollout_tp=2, gpu=True)   # a sentence naming both fields, or None

Asked by train/placement.py `Placement.create` (at start, when the device is known) and by the capacity
planner's placement verdicts (planner/ledger.py `compare_placements`, which plans for GPUs).
"""

from __future__ import annotations


def startability_problem(placement: str, rollout_tp: int, gpu: bool) -> str | None:
    """Why (run.placement, rollout.tensor_parallel_size) cannot start, naming both fields; None when
    it can.  The one rule for Placement.create (at start, when the device is known) and the
    capacity planner (which plans for GPUs): on GPUs a colocated rollout group lives in one bundle
    of one GPU, and vLLM's TP>1 workers are processes of the rollout actor that cannot span Ray
    bundles.  On CPU the bundles are nominal shares of the same cores, so any TP starts."""
    if placement == "colocated" and gpu and rollout_tp != 1:
        return (f"run.placement 'colocated' on GPUs needs rollout.tensor_parallel_size 1 (got {rollout_tp}): "
                "vLLM's TP>1 workers are processes of the rollout actor and cannot span Ray bundles; "
                "use rollout.tensor_parallel_size 1 with more rollout.data_parallel_size, or run.placement "
                "'disaggregated' for TP>1 rollout groups")
    return None
