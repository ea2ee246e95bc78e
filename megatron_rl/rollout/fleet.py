"""The rollout side as the driver sees it: data-parallel vLLM groups behind one `generate`, and
what happens when one of their engines dies.

    fleet = RolloutFleet(cfg.rollout, num_groups=2)
    ref = fleet.submit(prompts, n=8, sampling={"seed": s}, info=[...])    # non-blocking (Ray futures)
    samples = fleet.collect(ref)                                          # prompt-major RolloutSamples
    fleet.set_refitter(policy.refit)     # train/policy.py: publishes to the fleet's groups, refits restarted ones

Prompts are split round-robin across groups (each group is one `RolloutWorker` actor with its own
vLLM engine and tensor-parallel size); the result keeps the caller's order.

A group whose engine dies (its vLLM engine-core process killed, or the whole actor) is found by
the generate call that was running on it.  The fleet then:

  1. restarts it: the actor is killed and a new one started in the same placement; its engine loads the
     checkpoint on disk, no version of this run: **stale**, it refuses to generate (version None);
  2. refits it through the refitter the policy gave it (train/policy.py Policy.refit): the publication
     group is formed anew with every group, and the learner publishes the version it published last (or
     the next publication does it).  The group serves again only once that publication committed on it:
     every bucket's checksum verified and the refit check (engine vs learner logprobs) passed;
  3. retries the requests that were in flight on it, with the same seeds, on a serving group (the
     restarted one once it serves), counted in `system/requests_retried`.  Their samples died with
     the engine, so nothing of them reaches the queue; a request that cannot be served after
     `max_retries` tries (or an engine past `max_restarts`) ends the round with RolloutFailed naming
     the group, and the driver exits 75 (rerunning resumes).

A group that stops answering (a stopped process, a severed link) is found by a timeout: a generate
call past rollout.generate_timeout_s (its requests go to a serving group) or a publication past
rollout.publish_timeout_s.  It is marked stale and **unreachable**: left out of generation and of the
publication group (formed anew without it), so the learner and the other groups go on.  A ping
(policy_version) stays queued on it; once that answers, the group is back, still stale, and is refitted
(as above) before it serves again.  Counted in `system/rollout_partitions`, `system/unreachable_rollout_groups`.

The fleet knows its groups, not the learner: which groups a publication reaches and which of them
are stale (publication_members), and what each group serves after it (refitted).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import ray

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.sample import RolloutSample
from megatron_rl.rollout.stream_actor import create_stream_worker
from megatron_rl.rollout.worker import create_rollout_worker, wait_engines_up

logger = logging.getLogger(__name__)

SERVING, STALE = "serving", "stale"


class RolloutFailed(RuntimeError):
    """Requests could not be served: an engine kept dying, or no group came back in time."""


@dataclasses.dataclass
class Chunk:
    index: list[int]  # the prompts (indices into the round) of one generate call
    seed_group: int  # the group whose seed offset its requests keep, wherever they run
    worker: object = None  # the actor it was sent to
    group: int | None = None
    ref: object = None
    tries: int = 0


@dataclasses.dataclass
class PendingRollout:
    chunks: list[Chunk]
    prompts: list[list[int]]
    sampling: dict
    info: list | None  # the prompts' PromptInfos (rollout/sample.py), carried by their samples
    n: int
    env: dict | None = None  # None: prompts are token lists (generate); else examples, played as episodes


def engine_died(err: BaseException) -> bool:
    """Whether a generate call failed because its engine (or its whole actor) is gone."""
    if isinstance(err, ray.exceptions.RayActorError):
        return True
    cause = getattr(err, "cause", None)
    names = {type(e).__name__ for e in (err, cause) if e is not None}
    return "EngineDeadError" in names or "EngineDeadError" in str(err)


def refused_stale(err: BaseException) -> bool:
    """A stale group refused to generate (it holds no complete version), or a streaming group's request
    sampled under weights its refit check then refused (rollout/stream_actor.py): send elsewhere or later."""
    return "holds no complete policy version" in str(err) or "RefusedWeights" in str(err)


class RolloutFleet:
    def __init__(self, cfg: RolloutConfig, num_groups: int, placement=None, *, max_retries: int = 3,
                 max_restarts: int = 3, refit_timeout_s: float = 600.0, wait: bool = True,
                 handed_over: list | None = None):
        """Start the groups' engines; with wait=False return at once (the engines start while the
        caller starts other things, e.g. the learner) and call wait_ready() before using them.
        `handed_over`: running workers of an earlier run (train/engine_pool.py) used instead of new
        ones; they are reset to this config and stale until the first publication refits them."""
        self.cfg, self.placement = cfg, placement
        self.max_retries, self.max_restarts, self.refit_timeout_s = max_retries, max_restarts, refit_timeout_s
        if handed_over is not None and len(handed_over) != num_groups:
            raise ValueError(f"{len(handed_over)} rollout workers handed over for {num_groups} groups")
        self.handed_over = handed_over is not None
        if handed_over is not None:
            self.workers = list(handed_over)
            ray.get([w.reset.remote(dataclasses.asdict(cfg)) for w in self.workers])
        else:
            self.workers = [self._start(g, stale=False) for g in range(num_groups)]
        if wait:
            self.wait_ready()
        self.state = [STALE if self.handed_over else SERVING] * num_groups
        self._lock = threading.RLock()  # membership: workers, state, regroup
        self._regroup = False  # a group was replaced: form the publication group anew before publishing
        self._refitter = None  # publishes the last version again to stale groups (Policy.refit), once set
        self._probe: tuple | None = None  # the last expect_probe arguments (for a restarted group)
        self.restarts = 0
        self.requests_retried = 0
        self.unreachable: dict[int, tuple[object, float]] = {}  # group -> (queued ping, since when)
        self.partitions = 0
        self._closed = threading.Event()  # shutdown(): a request waiting for a serving group gives up

    def wait_ready(self) -> None:
        """Block until every engine is up (raises the actor's error if one failed to start)."""
        wait_engines_up(self.workers)

    def _start(self, g: int, stale: bool):
        opts = self.placement(g) if self.placement is not None else {}
        create = create_stream_worker if self.cfg.streaming else create_rollout_worker
        return create(self.cfg, stale=stale, **opts)

    # ---- generation ------------------------------------------------------------------------------

    def submit(self, prompts: list, *, n: int, sampling: dict, info: list | None = None,
               first_group: int = 0, env: dict | None = None) -> PendingRollout:
        """Send the prompts round-robin over the groups, prompt 0 to `first_group` (a streaming producer
        sends one prompt's group at a time and spreads them with it).  With `env` (an EnvConfig as a dict),
        the prompts are data Examples and each sample is a multi-turn episode (rollout/episodes.py)."""
        self.check_returned()
        self.refit(wait_s=0.0)  # a group that answers again (stale) serves only once refitted
        k = len(self.workers)
        chunks = [Chunk(list(range(j, len(prompts), k)), (first_group + j) % k) for j in range(k)]
        pending = PendingRollout([c for c in chunks if c.index], prompts, dict(sampling), info, n, env)
        for c in pending.chunks:
            self._send(pending, c)
        return pending

    def _send(self, p: PendingRollout, c: Chunk) -> bool:
        """Send chunk `c` to its own group if that serves, else to another serving group; False if none serves."""
        with self._lock:
            serving = [g for g, s in enumerate(self.state) if s == SERVING]
            if not serving:
                c.ref = None
                return False
            g = c.seed_group if c.seed_group in serving else serving[c.tries % len(serving)]
            c.group, c.worker = g, self.workers[g]
        s = dict(p.sampling)
        if s.get("seed") is not None:
            s["seed"] = s["seed"] + 1_000_003 * c.seed_group  # groups never share request seeds
        args = ([p.prompts[i] for i in c.index], s, p.n, [p.info[i] for i in c.index] if p.info else None)
        if p.env is None:
            c.ref = c.worker.generate.remote(*args)
        else:
            c.ref = c.worker.run_episodes.remote(*args, env=p.env)
        return True

    def collect(self, pending: PendingRollout) -> list[RolloutSample]:
        out: list[list[RolloutSample] | None] = [None] * len(pending.prompts)
        for c in pending.chunks:
            samples = self._result(pending, c)
            for j, i in enumerate(c.index):
                out[i] = samples[j * pending.n:(j + 1) * pending.n]
        return [s for group in out for s in group]

    def _result(self, p: PendingRollout, c: Chunk) -> list[RolloutSample]:
        """The chunk's samples; an engine that died under it is restarted and the chunk sent again."""
        while True:
            if c.ref is None:
                self._wait_serving()
                self._send(p, c)
                continue
            try:
                return ray.get(c.ref, timeout=self.cfg.generate_timeout_s)
            except ray.exceptions.GetTimeoutError as err:
                self.mark_unreachable(c.group, c.worker, f"a generate call of {len(c.index)} prompts did not "
                                      f"answer within rollout.generate_timeout_s={self.cfg.generate_timeout_s:g} s")
                try:
                    ray.cancel(c.ref)  # still queued or running there: its samples are never collected
                except Exception as cancel_err:  # noqa: BLE001 -- best effort
                    logger.debug("cancel of a timed-out generate call: %s", cancel_err)
                c.tries += 1
                if c.tries > self.max_retries:
                    raise RolloutFailed(f"{len(c.index)} rollout requests timed out {c.tries} times (last on "
                                        f"rollout group {c.group})") from err
                self.requests_retried += len(c.index)
                c.ref = None
            except ray.exceptions.RayError as err:
                if not (engine_died(err) or refused_stale(err)):
                    raise
                if engine_died(err):
                    self._restart(c.group, c.worker, err)
                c.tries += 1
                if c.tries > self.max_retries:
                    raise RolloutFailed(f"{len(c.index)} rollout requests failed {c.tries} times (last on rollout "
                                        f"group {c.group}): {str(err).strip().splitlines()[-1]}") from err
                self.requests_retried += len(c.index)
                logger.warning("retrying %d rollout requests that were in flight on rollout group %d (try %d); "
                               "their partial samples were discarded", len(c.index), c.group, c.tries + 1)
                c.ref = None

    def generate(self, prompts, *, n, sampling, info=None, first_group: int = 0, env: dict | None = None
                 ) -> list[RolloutSample]:
        return self.collect(self.submit(prompts, n=n, sampling=sampling, info=info, first_group=first_group,
                                        env=env))

    # ---- restart and refit -----------------------------------------------------------------------

    def _restart(self, g: int, dead, err: BaseException, during: str = "generation") -> None:
        """Replace group g's actor (unless another call did already) by a stale one."""
        with self._lock:
            if self.workers[g] is not dead:
                return
            if self.restarts >= self.max_restarts:
                raise RolloutFailed(f"the vLLM engine of rollout group {g} died again after {self.restarts} "
                                    f"restarts this run: {str(err).strip().splitlines()[-1]}") from err
            self.restarts += 1
            kind = type(getattr(err, "cause", err) or err).__name__
            logger.warning("rollout group %d: vLLM engine died during %s (%s); restarting it, it serves "
                           "again once it holds the current policy version", g, during, kind)
            try:
                ray.kill(dead, no_restart=True)
            except Exception as kill_err:  # already gone
                logger.debug("kill of the dead rollout actor: %s", kill_err)
            stale = self._refitter is not None  # without a policy the checkpoint on disk is what it serves
            t0 = time.perf_counter()
            self.workers[g] = self._start(g, stale=stale)
            wait_engines_up([self.workers[g]], first_group=g)
            self.state[g] = STALE if stale else SERVING
            self._regroup = True
            logger.warning("rollout group %d: engine restarted in %.1f s, %s", g, time.perf_counter() - t0,
                           "stale until refitted" if stale else "serving the checkpoint on disk")

    def _wait_serving(self) -> None:
        """Return once some group serves; refit stale groups meanwhile (when the learner allows)."""
        deadline = time.monotonic() + self.refit_timeout_s
        while True:
            with self._lock:
                if SERVING in self.state:
                    return
            if self.refit():
                continue
            if time.monotonic() > deadline or self._closed.is_set():  # (the run ends: its threads must too)
                raise RolloutFailed("the rollout fleet was shut down" if self._closed.is_set() else f"no rollout "
                                    f"group serves a policy version {self.refit_timeout_s:g} s after restarts "
                                    f"(groups: {self.state})")
            self._closed.wait(0.5)

    def restart_dead(self, cause: BaseException, timeout_s: float = 10.0) -> list[int]:
        """Restart every reachable group whose actor or vLLM engine is dead (after a publication failed
        with `cause`); the groups restarted, each stale until the next publication refits it."""
        with self._lock:
            groups = [(g, w) for g, w in enumerate(self.workers) if g not in self.unreachable]
        dead = []
        for g, worker in groups:
            try:
                alive = ray.get(worker.engine_alive.remote(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                continue  # slow, not dead: the publication timeout deals with it
            except ray.exceptions.RayError:
                alive = False
            if not alive:
                dead.append((g, worker))
        for g, worker in dead:
            self._restart(g, worker, cause, during="publication")
        return [g for g, _ in dead]

    def set_refitter(self, refitter) -> None:
        """`refitter(wait_s) -> bool` publishes the last published version again to the stale groups
        (Policy.refit); from now on a restarted group is stale until it is refitted."""
        self._refitter = refitter

    def refit(self, wait_s: float = 1.0) -> bool:
        """Refit stale groups now, through the refitter; False when it cannot happen now (no refitter,
        nothing stale, or the refitter declined: the next publication refits them then)."""
        with self._lock:
            stale = [g for g, s in enumerate(self.state) if s == STALE and g not in self.unreachable]
        if not stale or self._refitter is None:
            return False
        return self._refitter(wait_s)

    # ---- unreachable groups ----------------------------------------------------------------------

    def mark_unreachable(self, g: int, worker, why: str) -> None:
        """Group g stopped answering: stale, left out of generation and publication until it answers."""
        with self._lock:
            if self.workers[g] is not worker or g in self.unreachable:
                return
            self.state[g] = STALE
            self.unreachable[g] = (worker.policy_version.remote(), time.monotonic())
            self._regroup = True
            self.partitions += 1
        logger.warning("rollout group %d did not answer: %s; marked stale and unreachable, the other groups go "
                       "on (it is refitted before it serves again)", g, why)

    def check_returned(self) -> bool:
        """Whether an unreachable group answered its ping since the last check (it is then a stale member
        again: the next publication or refit includes it)."""
        back, dead = [], []
        with self._lock:
            for g, (ping, since) in list(self.unreachable.items()):
                if ray.wait([ping], timeout=0)[0]:
                    del self.unreachable[g]
                    self._regroup = True
                    try:
                        ray.get(ping)
                        back.append((g, time.monotonic() - since))
                    except ray.exceptions.RayError as err:  # it died meanwhile: restarted (stale) instead
                        dead.append((g, self.workers[g], err))
        for g, seconds in back:
            logger.warning("rollout group %d answers again (%.1f s after it was left out); stale until refitted",
                           g, seconds)
        for g, worker, err in dead:
            self._restart(g, worker, err)
        return bool(back or dead)

    # ---- publication -----------------------------------------------------------------------------

    def expect_probe(self, version: int, sequences, logprobs, tolerance: float) -> None:
        """The refit check's reference for `version` (RolloutWorker.expect_probe), kept for restarts."""
        self._probe = (version, sequences, logprobs, tolerance)
        with self._lock:
            workers = [w for g, w in enumerate(self.workers) if g not in self.unreachable]
        ray.get([w.expect_probe.remote(*self._probe) for w in workers], timeout=self.cfg.publish_timeout_s)

    def publication_members(self, version: int) -> tuple[list, list[int], list[int], bool]:
        """Who the publication of `version` reaches: (a snapshot of the workers, the members (groups
        that answer), the stale members, whether the publication group must be formed anew).  The
        stale members get the probe of `version` for their refit check; RolloutFailed when no group answers."""
        self.check_returned()
        with self._lock:
            workers, regroup = list(self.workers), self._regroup
            members = [g for g in range(len(workers)) if g not in self.unreachable]
            stale = [g for g in members if self.state[g] == STALE]
        if not members:
            raise RolloutFailed(f"no rollout group answers: publication of version {version} has no receiver "
                                f"(unreachable: {sorted(self.unreachable)})")
        if stale and self._probe is not None and self._probe[0] == version:
            ray.get([workers[g].expect_probe.remote(*self._probe) for g in stale])
        return workers, members, stale, regroup

    def regrouped(self, workers: list) -> None:
        """The publication group was formed with the members of `workers` (publication_members' snapshot)."""
        with self._lock:
            self._regroup = self.workers != workers  # replaced again meanwhile: once more next time

    def regroup(self) -> None:
        """Form the publication group anew before the next publication (a send broke off)."""
        with self._lock:
            self._regroup = True

    def refitted(self, version: int, workers: list, stale: list[int]) -> None:
        """After a publication of `version`: each stale group that now serves it serves again."""
        versions = ray.get([workers[g].policy_version.remote() for g in stale])
        with self._lock:
            for g, v in zip(stale, versions):
                if v == version and self.workers[g] is workers[g]:
                    self.state[g] = SERVING
                    logger.warning("rollout group %d refitted: serving policy version %d (bytes verified%s)", g, v,
                                   ", refit check passed" if self._probe and self._probe[0] == version else "")

    def counters(self) -> dict[str, float]:
        """Restarts, retried requests and stale groups so far (logged with every step)."""
        with self._lock:
            return {"system/engine_restarts": float(self.restarts),
                    "system/requests_retried": float(self.requests_retried),
                    "system/stale_rollout_groups": float(self.state.count(STALE)),
                    "system/rollout_partitions": float(self.partitions),
                    "system/unreachable_rollout_groups": float(len(self.unreachable))}

    def hand_over(self) -> list | None:
        """The workers, for the next run (train/engine_pool.py), when every group serves and answers;
        None otherwise (shutdown() then ends them).  The fleet holds no worker afterwards."""
        with self._lock:
            if self.state.count(SERVING) != len(self.workers) or self.unreachable:
                return None
            workers, self.workers = self.workers, []
        return workers

    def shutdown(self) -> None:
        self._closed.set()
        for w in self.workers:
            try:
                ray.get(w.shutdown.remote(), timeout=60)
            except (ray.exceptions.RayError, TimeoutError) as err:
                logger.warning("rollout worker shutdown: %s", err)
            ray.kill(w)
