"""The rollout side as the driver sees it: data-parallel vLLM groups behind one `generate`.

    fleet = RolloutFleet(cfg.rollout, num_groups=1)
    ref = fleet.submit(prompts, n=8, seed=s, extra=[...])   # non-blocking (Ray futures)
    samples = fleet.collect(ref)                            # prompt-major RolloutSamples

Prompts are split round-robin across groups (each group is one `RolloutWorker` actor with
its own vLLM engine and tensor-parallel size); the result keeps the caller's order.
"""

from __future__ import annotations

import dataclasses
import logging

import ray

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.sample import RolloutSample
from megatron_rl.rollout.worker import create_rollout_worker

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PendingRollout:
    refs: list  # one Ray future per group
    order: list[list[int]]  # prompt indices each group got
    num_prompts: int
    n: int


class RolloutFleet:
    def __init__(self, cfg: RolloutConfig, num_groups: int, placement=None, *, wait: bool = True):
        """Start the groups' engines; with wait=False return at once (the engines start while the
        caller starts other things, e.g. the learner) and call wait_ready() before using them."""
        self.cfg = cfg
        self.workers = []
        for g in range(num_groups):
            opts = placement(g) if placement is not None else {}
            self.workers.append(create_rollout_worker(cfg, **opts))
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until every engine is up (raises the actor's error if one failed to start)."""
        ray.get([w.policy_version.remote() for w in self.workers])

    def submit(self, prompts: list[list[int]], *, n: int, sampling: dict, extra: list[dict]) -> PendingRollout:
        k = len(self.workers)
        order = [list(range(g, len(prompts), k)) for g in range(k)]
        refs = []
        for g, idx in enumerate(order):
            if not idx:
                refs.append(None)
                continue
            s = dict(sampling)
            if s.get("seed") is not None:
                s["seed"] = s["seed"] + 1_000_003 * g  # groups never share request seeds
            refs.append(self.workers[g].generate.remote(
                [prompts[i] for i in idx], s, n, [extra[i] for i in idx]))
        return PendingRollout(refs, order, len(prompts), n)

    def collect(self, pending: PendingRollout) -> list[RolloutSample]:
        out: list[list[RolloutSample] | None] = [None] * pending.num_prompts
        for ref, idx in zip(pending.refs, pending.order):
            if ref is None:
                continue
            samples = ray.get(ref)
            for j, i in enumerate(idx):
                out[i] = samples[j * pending.n:(j + 1) * pending.n]
        return [s for group in out for s in group]

    def generate(self, prompts, *, n, sampling, extra) -> list[RolloutSample]:
        return self.collect(self.submit(prompts, n=n, sampling=sampling, extra=extra))

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.get(w.shutdown.remote(), timeout=60)
            except (ray.exceptions.RayError, TimeoutError) as err:
                logger.warning("rollout worker shutdown: %s", err)
            ray.kill(w)
