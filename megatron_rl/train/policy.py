"""The policy being trained: the learner group (Megatron ranks) and the publication of its weights.

    policy = Policy.create(cfg.learner, cfg.loss, cfg.run, cfg.sampling, weight_transfer=cfg.rollout.weight_transfer,
                           model_dir=d, fleet=fleet, placement=place.learner, vocab_size=v, pad_id=0)
    learn, seconds = policy.learn(taken, version)     # one GRPO step on a taken batch -> version + 1
    seconds = policy.publish(version + 1)             # every reachable rollout group loads all of it

The policy owns publication, at one level (`publish`): which groups it reaches and whether
the publication group must be formed anew (the fleet says: rollout/fleet.py), the send (the learner
group's ranks, over the run's transport: publish/transports.py), and what each outcome costs:
  a group that stopped answering   left out (unreachable, stale); the rest published once more;
  the send broke off               the publication group formed anew, published once more;
  a refit check failed             the group rolled back; published once more, then PublicationError;
  an engine died (any point)       its group restarted (stale), published once more: the refit;
  a dead engine past max_restarts  PublicationError (the driver exits 75: rerun to resume).
A publication is checked twice: bucket checksums (publish/), and a refit probe (rollout/receiver.py)
that compares the engine's logprobs on a fixed batch with the learner's.  Each rollout group
commits all of a version or none of it; the version is committed on the groups that answer.
A restarted group is refitted through `refit` (the fleet's refitter): the last published version,
only if the learner's weights did not change since (LearnerGroup.updates), so a refit never labels
newer weights with an older version.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable

from megatron_rl.grpo.loss import GRPOLossConfig
from megatron_rl.learner.config import LearnerConfig, SamplingConfig
from megatron_rl.rollout.fleet import RolloutFleet
from megatron_rl.rollout.sleep import SleepCycle
from megatron_rl.train.config import RunConfig
from megatron_rl.ranks.group import LearnerGroup, RankSpec
from megatron_rl.ranks.weights import PublishSettings
from megatron_rl.train.probe import probe_sequences, reconcile_sampled

logger = logging.getLogger(__name__)

ENGINE_PROBE_ROWS = 4
"""Probe rows each rollout group scores in its refit check: plenty to catch weights laid out wrongly."""


class PublicationError(RuntimeError):
    """Publishing new weights failed because a rollout group's engine is dead or unreachable."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicySettings:
    """What the policy needs of the run config besides the learner group (Policy.create)."""

    loss: GRPOLossConfig
    sampling: SamplingConfig
    """The distribution the engines sample from; the learner scores exactly it."""
    micro_batch_size: int
    probe_rows: int
    """Rows of the fixed probe batch (micro batch x learner data-parallel size)."""
    refit_tolerance: float | str | None
    """A number, "auto" (the serving dtype's bound: rollout/refit_check.py) or None (no refit check)."""
    vocab_size: int
    pad_id: int
    audit_ring: int = 0
    """Versions of the weights the learner ranks keep for the audit (audit/ring.py; 0: none)."""


@dataclasses.dataclass
class _Tries:
    """What one publication's passes have met so far (Policy.publish)."""

    broke_off: bool = False
    refit_failed: bool = False


class Policy:
    """Owns the learner group and the publication of its weights to the rollout engines."""

    def __init__(self, learner: LearnerGroup, fleet: RolloutFleet, settings: PolicySettings,
                 publishing: PublishSettings, sleep: SleepCycle | None = None):
        self.learner = learner
        self.fleet = fleet
        self.settings = settings
        self.publishing = publishing
        self.sleep = sleep
        """vLLM sleep/wake around learner steps (rollout/sleep.py; None: never)."""
        self.published: tuple[int, int] | None = None
        """(version, learner.updates) of the last committed publication: what a refit may publish again."""
        self.last_publication: dict | None = None
        """The learner's report of the last publication (committed, errors, groups)."""
        self.digests: dict[str, str] = {}
        """Policy version -> digest of what this process published as it (quarantine)."""
        self.probe_rows: list[list[int]] | None = None
        """The refit probe: sampled tokens of the last batch learned (train/probe.py), or of the last one
        before the checkpoint a run resumed from (train/checkpointing.py)."""
        self.kl = settings.loss.kl_controller()
        """β of the KL penalty for the next step: loss.kl_coef, or the adaptive controller's (checkpointed)."""
        self._tolerance: float | None = None  # run.refit_tolerance as the engines resolve it
        learner.connect_rollout(list(fleet.workers), publishing)
        fleet.set_refitter(self.refit)

    @classmethod
    def create(cls, learner: LearnerConfig, loss: GRPOLossConfig, run: RunConfig, sampling: SamplingConfig, *,
               weight_transfer: str, model_dir: Path, fleet: RolloutFleet, placement: Callable[[int], dict] | None,
               vocab_size: int, pad_id: int,
               sleep: tuple[bool, str] = (False, "off"), handed_over: list | None = None,
               audit_ring: int = 0) -> "Policy":
        """The learner group (the learner and loss sections, the run's determinism, timeout and
        publication settings) started from `model_dir`, attached to the fleet it publishes to once
        its engines are up (they may still be starting while the learner does).
        `sleep`: (on, why) of vLLM sleep mode, chosen at start-up (train/placement.py).  `audit_ring`: versions
        of the weights every rank keeps in host memory for the audit (AuditConfig.ring_versions)."""
        spec = RankSpec(learner=learner, loss=loss, hf_dir=str(model_dir), seed=learner.seed,
                        deterministic=run.deterministic, threads=run.torch_threads, sampling=sampling,
                        audit_ring=audit_ring)
        group = LearnerGroup(spec, placement=placement, call_timeout_s=run.learner_timeout_s, handed_over=handed_over)
        fleet.wait_ready()
        publishing = PublishSettings(transport=weight_transfer, bucket_bytes=run.publish_bucket_mib << 20,
                                     timeout_s=fleet.cfg.publish_timeout_s, checksum=run.publish_checksum)
        settings = PolicySettings(loss=loss, sampling=sampling, micro_batch_size=learner.micro_batch_size,
                                  probe_rows=learner.micro_batch_size * learner.data_parallel_size,
                                  refit_tolerance=run.refit_tolerance, vocab_size=vocab_size, pad_id=pad_id,
                                  audit_ring=audit_ring)
        return cls(group, fleet, settings, publishing,
                   SleepCycle(lambda: fleet.workers, enabled=sleep[0], reason=sleep[1]))

    @property
    def engines(self) -> list:
        """The rollout groups' workers now (a restarted engine replaces its group's)."""
        return self.fleet.workers

    def learn(self, taken: list, version: int, lr_scale: float = 1.0) -> tuple[dict, float]:
        """One GRPO step on the taken batch (learned at `version`); its metrics and seconds.

        out["dv"] holds each trajectory's version lag (from its oldest token), out["token_dv"] each token's; D_lag (batch-wide and P50/P95/P99 over
        sequences) comes from the training forward itself (megatron_rl.grpo.step_metrics.grpo_metrics)."""
        from megatron_rl.train.batch import build_batch

        t0 = time.perf_counter()
        check_sampling(taken, self.settings.sampling)
        taken, quarantined = quarantine(taken, self.digests)  # out of the loss, counted
        batch, adv_stats = build_batch(taken, pad_id=self.settings.pad_id, loss_cfg=self.settings.loss,
                                       micro_batch_size=self.settings.micro_batch_size)
        out = {f"adv/{k}": v for k, v in adv_stats.items()}
        out.update(self._reconcile(taken, version))
        self.probe_rows = probe_sequences(taken, self.settings.probe_rows)
        if self.sleep is not None:
            self.sleep.before_learn()                        # colocated GPUs: the engines free their memory
        out.update(self.learner.train_step(batch, lr_scale=lr_scale, kl_coef=self.kl.coef if self.kl.adaptive else None))
        self.kl.update(out.get("kl_ref_estimate"))        # the next step's β (adaptive control only)
        out["dv"] = [version - t.oldest_version for t in taken]
        out["token_dv"] = [version - int(v) for t in taken for v in t.policy_versions]  # a sequence can span versions
        out["quarantined_trajectories"] = float(quarantined)
        return out, time.perf_counter() - t0

    def publish(self, version: int, *, wait_s: float | None = None, updates: int | None = None) -> float | None:
        """Publish the learner's weights as `version` to every rollout group that answers; seconds.  Every
        outcome is handled here, one pass per try (module docstring); each pass either commits or changes what
        the next one does (a group left, the group formed anew, a rollback), so the passes are bounded.
        A refit (`refit`: `updates` given) waits at most `wait_s` for the learner and publishes only if its
        weights are still those `updates` counted; else None."""
        t0, refit = time.perf_counter(), updates is not None
        if not refit:
            if self.sleep is not None:
                self.sleep.before_refit()                    # awake before the refit and its check
            self._expect_probe(version)                      # (a refit's was given with the first publication)
        if not self.learner.lock.acquire(timeout=-1 if wait_s is None else wait_s):
            return None
        try:
            if refit:
                if self.learner.updates != updates:
                    return None
                logger.info("refitting stale rollout group(s) with policy version %d", version)
            tries = _Tries()
            for _ in range(len(self.fleet.workers) + 3):
                workers, members, stale, regroup = self.fleet.publication_members(version)
                if regroup:  # the old group had a dead engine's ranks in it, or an unreachable group's, or lacks one
                    self.learner.connect_rollout([workers[g] for g in members], self.publishing)
                    self.fleet.regrouped(workers)
                try:
                    report = self.learner.publish(version)
                except Exception as err:
                    if self._restarted_dead(version, err, workers):
                        continue
                    self._raise_if_engine_down(version, err)
                    raise
                if self._settled(version, report, workers, members, stale, tries):
                    if self.settings.audit_ring and not refit:  # (a refit's weights are kept already)
                        self.learner.keep_version(version)  # the audit's ring: these weights are `version` now
                    return time.perf_counter() - t0
            raise PublicationError(f"publication of policy version {version} did not settle after "
                                   f"{len(self.fleet.workers) + 3} attempts (groups left or the send kept breaking off)")
        finally:
            self.learner.lock.release()

    def refit(self, wait_s: float = 1.0) -> bool:
        """Publish the last published version again, so restarted groups hold it (the fleet's refitter);
        False when it cannot happen now: nothing published yet, the learner busy for `wait_s`, its
        weights moved on since (the next publication refits then), or the refit failed (logged)."""
        if self.published is None:
            return False
        version, updates = self.published
        try:
            return self.publish(version, wait_s=wait_s, updates=updates) is not None
        except RuntimeError as err:  # PublicationError and RolloutFailed too
            logger.warning("refit with policy version %s failed: %s", version, err)
            return False

    def _settled(self, version: int, report: dict, workers: list, members: list, stale: list, tries: "_Tries") -> bool:
        """Judge one pass's report: True once committed on the groups that answer; False to publish once
        more (a group left, the send broke off, a restarted engine, a first failed refit check); else raise."""
        groups = report.get("groups") or []
        lost = [(members[i], r["error"]) for i, r in enumerate(groups) if r["unresponsive"]]
        for g, why in lost:
            self.fleet.mark_unreachable(g, workers[g], why)
        if lost:
            kept = [r for r in groups if not r["unresponsive"]]
            if not kept or not all(r["committed"] for r in kept):
                return False  # the send broke off: once more without them
            report = dict(report, committed=True, groups=kept, errors=[])
        elif report.get("broken") and not tries.broke_off:  # broke off, yet every group answered (it came back)
            tries.broke_off = True
            self.fleet.regroup()
            logger.warning("publication of version %d broke off; forming the publication group anew and "
                           "publishing it again", version)
            return False
        self.fleet.refitted(version, workers, stale)
        self.last_publication = report
        if report["committed"]:
            self.published = (version, self.learner.updates)
            if report.get("digest"):
                self.digests[str(version)] = report["digest"]
            return True
        if self._restarted_dead(version, report["errors"], workers):
            return False
        self._raise_if_engine_down(version, report["errors"])
        refits = [e for e in report["errors"] if e and e.startswith("refit check")]
        if not refits:
            raise RuntimeError(f"publication of version {version} was refused: {report['errors']}")
        if tries.refit_failed:
            raise PublicationError(f"publication of policy version {version} failed the refit check twice "
                                   f"({refits[0]}); the groups serve version {version - 1}")
        tries.refit_failed = True
        logger.warning("%s; the group rolled back to version %d, publishing version %d again",
                       refits[0], version - 1, version)
        return False

    def _expect_probe(self, version: int) -> None:
        """Give every rollout group the learner's logprobs of the probe for `version` (its refit
        check, rollout/worker.py): tokens the engines sampled in the last batch learned (a resumed run:
        the checkpoint's; uniformly random ones only in a run that learned none, whose bf16 tail tokens may
        exceed the bound: rollout/refit_check.py), scored raw -- temperature 1, no truncation, as the
        engine's teacher-forced logprobs are -- so the check runs whatever the sampling transform."""
        import torch

        from megatron_rl.train.restart import probe_tokens

        tol = self.settings.refit_tolerance
        if tol is None:
            return
        if self.probe_rows is not None:
            tokens_bt = torch.tensor(self.probe_rows, dtype=torch.long)
        else:
            logger.warning("refit check of version %d on uniformly random tokens: no batch sampled yet", version)
            tokens_bt = probe_tokens(self.settings.probe_rows, self.settings.vocab_size, seed=1)
        # The engines score ENGINE_PROBE_ROWS rows; the learner forwards only those, rounded up to a multiple of
        # its data-parallel size (a forward of fewer rows than a micro-batch: learner.forward_logprobs).
        dp = self.settings.probe_rows // self.settings.micro_batch_size
        rows = min(len(tokens_bt), -(-ENGINE_PROBE_ROWS // dp) * dp)
        logprobs_bt = self.learner.forward_logprobs(tokens_bt[:rows], None, True)  # [rows, T-1], raw
        seqs, lps = tokens_bt[:ENGINE_PROBE_ROWS].tolist(), logprobs_bt[:ENGINE_PROBE_ROWS].tolist()
        self.fleet.expect_probe(version, seqs, lps, tol)

    def _reconcile(self, taken: list, version: int) -> dict:
        """With top-k/top-p: the learner's logprobs of on-policy sampled tokens against the engine's
        (train/probe.py reconcile_sampled); {} otherwise."""
        if not self.settings.sampling.truncates or self.settings.refit_tolerance is None:
            return {}
        if self._tolerance is None:
            import ray

            self._tolerance = ray.get(self.fleet.workers[0].refit_tolerance.remote(self.settings.refit_tolerance))
        tol = self._tolerance
        return reconcile_sampled(self.learner.forward_logprobs, taken, version, rows=self.settings.probe_rows,
                                 tolerance=tol, pad_id=self.settings.pad_id)

    def _restarted_dead(self, version: int, cause, workers: list) -> bool:
        """An engine died during the publication (any point: send, verify, commit, refit probe): its group
        is restarted as after a death during generation, and the version published again refits it.  A group
        the generation path restarted meanwhile (its requests in flight failed with the same death: a
        streaming engine dying paused in a refit) counts too: its actor is not the one this pass sent to."""
        restarted = self.fleet.restart_dead(cause if isinstance(cause, BaseException) else RuntimeError(str(cause)))
        restarted += [g for g, w in enumerate(workers) if self.fleet.workers[g] is not w and g not in restarted]
        if restarted:
            logger.warning("publication of version %d failed with the engine of rollout group(s) %s dead; "
                           "restarted, publishing it again (the restarted groups are refitted by it)", version,
                           restarted)
        return bool(restarted)

    def _raise_if_engine_down(self, version: int, cause, timeout_s: float = 10.0) -> None:
        """PublicationError naming the rollout groups whose engine does not answer (dead actor,
        crashed vLLM); returns when every group answers, so the caller reports the original error."""
        import ray

        down = []
        for g, worker in enumerate(self.engines):
            if g in self.fleet.unreachable:  # already left out of publication (rollout/fleet.py)
                continue
            try:
                ray.get(worker.policy_version.remote(), timeout=timeout_s)
            except Exception as err:  # RayActorError, GetTimeoutError, a crashed engine's error
                down.append(f"rollout group {g} ({type(err).__name__})")
        if down:
            first = str(cause).strip().splitlines()
            raise PublicationError(f"publication of policy version {version} failed: the engine of "
                                   f"{', '.join(down)} is dead or unreachable (cause: {first[-1] if first else cause})")

    def close(self) -> None:
        self.learner.shutdown()


def check_sampling(trajs: list, sampling) -> None:
    """Refuse trajectories sampled under settings other than the ones the learner scores.

    The learner's logprobs are taken under `sampling` (TrainConfig.sampling); a trajectory drawn
    with another temperature/top_p/top_k (e.g. queued before a resume with a changed config) has
    behavior logprobs of another distribution, so its importance ratios would be wrong.  This is
    an error rather than a silent exclusion: it means the run's configuration changed under it.
    """
    want = sampling.as_dict()
    for t in trajs:
        got = {k: t.sampling_config.get(k) for k in want}
        if any(got[k] is None or float(got[k]) != float(v) for k, v in want.items()):
            raise RuntimeError(f"trajectory {t.id} was sampled with {got}, but the learner scores {want} "
                               f"(rollout.temperature/top_p/top_k changed within this run?); start a new run.dir "
                               f"or restore the settings it was sampled with")


def quarantine(trajs: list, digests: dict[str, str]) -> tuple[list, int]:
    """The batch with every trajectory whose tokens the engines labelled with weights this policy never
    published under that version (rollout/provenance.py: a version's digest must equal the digest of the
    learner's publication as that version) marked status "quarantined": it stays in the batch (the
    batch keeps its shape) but out of the loss and of its group's baseline, like a verifier error, and
    is counted.  Versions published before this process started (groups a resumed run replays) are not
    known here and pass; a version republished at resume has the same bytes, hence the same digest."""
    out, bad = [], 0
    for t in trajs:
        wrong = [(v, d) for v, d in t.weights.items() if digests.get(v) not in (None, d)]
        if wrong:
            (version, digest), bad = wrong[0], bad + 1
            reason = (f"provenance: its version-{version} tokens were sampled by weights with digest {digest}, "
                      f"but the learner published version {version} as {digests[version]}")
            logger.error("trajectory %s quarantined (not trained on): %s", t.id, reason)
            t = dataclasses.replace(t, status="quarantined", error_code=reason, reward_components={})
        out.append(t)
    return out, bad
