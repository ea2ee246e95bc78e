"""Where learner ranks and rollout groups run: Ray placement groups for both placements.

    place = Placement.create(cfg)                # reserves the bundles (blocks until they fit)
    learner options: place.learner(rank)         # Ray actor options for learner rank `rank`
    rollout options: place.rollout(group)        # Ray actor options for rollout group `group`

disaggregated  every learner rank and every rollout group gets bundles of its own (on GPUs:
               one GPU per learner rank, rollout.tensor_parallel_size GPUs per group), so
               generation and training run at the same time on separate devices.
colocated      learner ranks and rollout groups share bundles (STRICT_PACK on one node's
               devices): rank i and group i sit on bundle i and take turns, each holding half
               of the bundle's GPU share.  vLLM's own TP>1 workers are processes of the
               rollout actor, so colocation needs rollout.tensor_parallel_size 1 on GPUs.
On CPU the same bundles are made with nominal CPU shares, so both placements run (and are
tested) here; the devices they stand for are then the same cores.
"""

from __future__ import annotations

import dataclasses
import logging

from megatron_rl.planner.startability import startability_problem

logger = logging.getLogger(__name__)

CPU_SHARE = 0.25  # nominal CPU per bundle on CPU-only clusters (vLLM/torch threads are not Ray tasks)


@dataclasses.dataclass
class Placement:
    kind: str
    group: object
    learner_ranks: int
    rollout_groups: int
    gpu: bool
    rollout_tp: int

    @classmethod
    def create(cls, cfg, learner_ranks: int, timeout_s: float = 600) -> "Placement":
        import ray
        import torch
        from ray.util.placement_group import placement_group

        gpu = torch.cuda.is_available() and ray.cluster_resources().get("GPU", 0) > 0
        kind, groups, tp = cfg.run.placement, cfg.rollout.data_parallel_size, cfg.rollout.tensor_parallel_size
        problem = startability_problem(kind, tp, gpu)
        if problem is not None:
            raise ValueError(problem)
        if kind == "colocated":
            n = max(learner_ranks, groups)
            bundles = [{"CPU": CPU_SHARE, **({"GPU": 1} if gpu else {})} for _ in range(n)]
            strategy = "STRICT_PACK"
        else:
            bundles = [{"CPU": CPU_SHARE, **({"GPU": 1} if gpu else {})} for _ in range(learner_ranks)]
            bundles += [{"CPU": CPU_SHARE, **({"GPU": tp} if gpu else {})} for _ in range(groups)]
            strategy = "PACK"
        pg = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            raise TimeoutError(f"Ray could not reserve {len(bundles)} bundles {bundles[0]} ({kind}) "
                               f"within {timeout_s:.0f} s: cluster has {ray.cluster_resources()}")
        logger.info("placement %s: %d bundles (%s)", kind, len(bundles), strategy)
        return cls(kind, pg, learner_ranks, groups, gpu, tp)

    def _opts(self, bundle: int, gpus: float) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": CPU_SHARE / 2 if self.kind == "colocated" else CPU_SHARE,
                "num_gpus": gpus if self.gpu else 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=bundle)}

    def learner(self, rank: int) -> dict:
        return self._opts(rank, 0.5 if self.kind == "colocated" else 1)

    def rollout(self, group: int) -> dict:
        if self.kind == "colocated":
            return self._opts(group, 0.5)
        return self._opts(self.learner_ranks + group, self.rollout_tp)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)

    @property
    def device(self) -> str:
        """"cuda" when the roles were given GPUs, else "cpu"."""
        return "cuda" if self.gpu else "cpu"




def gpu_path_choices(cfg, device: str) -> tuple[str, bool, str]:
    """(publication transport, vLLM sleep mode on?, why), decided once at start-up from
    (run.placement, device) and the run mode; ConfigError naming the field for a setting that
    contradicts them (publish/transport.py, rollout/sleep.py)."""
    from megatron_rl.publish.transport import choose_transport
    from megatron_rl.rollout.sleep import choose_sleep

    transport = choose_transport(cfg.run.placement, device, cfg.rollout.weight_transfer)
    sleep_on, why = choose_sleep(placement=cfg.run.placement, device=device, mode=cfg.run.mode,
                                 requested=cfg.rollout.sleep_mode, adapter=cfg.rollout_served.adapter)
    # On GPUs the choice is news (console and driver log); on CPU it is always gloo and no sleep.
    logger.log(logging.INFO if device == "cuda" else logging.DEBUG,
               "%s placement on %s: publication over %s; vLLM sleep mode %s (%s)", cfg.run.placement, device,
               transport, "on" if sleep_on else "off", why)
    return transport, sleep_on, why
