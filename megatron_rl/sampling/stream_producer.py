"""Streaming rollouts: prompt groups generated continuously, a batch = the first groups that finish.

    producer = StreamProducer(coordinator, prepare_group, grade, steps=100, groups_per_step=8, group_size=4,
                              max_groups_in_flight=16)
    # prepare_group(serial, indices=None): draws the group's prompt (in serial order; with `indices`, those
    # examples again) and returns (its examples' indices, a call that generates its G samples, run on a thread
    # of the producer's pool); grade(samples) -> their verifier Scores
    producer.start(state); rnd = producer.next(step)
    rounds = producer.pause(); groups = producer.in_flight(); producer.unpause()   # a checkpoint
    producer.stop()

The round producer (producer.py) generates one batch per generate call, so every batch waits for its
longest sample.  Here each prompt group is admitted by the coordinator (G leases; one call asks for as
many groups as may start now, up to a batch, and takes the whole groups granted), sent to a
streaming rollout group (rollout/stream_actor.py, where it joins the engine's continuous batch), graded
the moment its last sample ends (with the groups that finished while the verifier was busy: one call,
sampling/batch_grading.py), and kept ready; `next(step)` hands the learner the first
`groups_per_step` groups that finished, in the order they finished, while the rest keep generating.
So the admission rule still bounds how far generation runs ahead ((eta + v + 1) x B rollouts
admitted at most), and publications land while groups are in flight (rollout.inflight_refit): a
group's tokens can span versions, each one stamped with the version that sampled it; the coordinator
judges a trajectory by its oldest token (trajectory.Trajectory.policy_version: the minimum), so a
sequence that spans versions counts as old as its first tokens.

A checkpoint does not drain the engines: `pause` stops admission only (it waits while a call to the
coordinator or a prompt draw is under way, so the data cursor, the queue and the groups agree) and the
groups in flight go on generating through the checkpoint and after it; publications keep landing in them.
The checkpoint saves the finished groups not yet taken and, for each group still generating, its serial,
its examples' indices and its leases (`in_flight`).  A run resumed from it hands out the finished groups
first and generates the groups that were in flight again from the start -- the same prompts, serials and
sampling seeds, under the resumed weights (their first tokens then carry the resumed version), holding the
same leases -- so nothing admitted is lost or trained twice.

Dynamic sampling (sampling/dynamic_sampling.py) filters here as groups finish: a graded group whose rewards do
not vary is discarded at once -- its leases given back, so admission lets a fresh group in -- and every
discarded group lets the loop draw one more prompt.  A batch may discard at most the rounds' bound
(`DynamicSamplingConfig.discard_budget`); past it, uninformative groups are kept (counted as filled), so
a policy that answers everything the same way still trains.  Its account rides with each batch
(groups sampled, informative, filled, discarded tokens: ESR counts the discarded tokens as generated).
A group discarded while a checkpoint is being written keeps its leases until the checkpoint is written.

Groups are numbered in the order their prompts are drawn (a group's `round` in its trajectory ids and its
sampling seed derive from that serial), and a batch learns its groups in serial order.  Which groups form
which batch depends on timing when more than a batch's groups may be in flight (async), so such a run is
not bit-reproducible, and resume is exact only in what it keeps (above); a sync run's batches are its
serials in order, and it repeats bit for bit (measured: the session 32 differential runs).
"""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from megatron_rl.coordinator.client import Coordinator
from megatron_rl.rollout.sample import reset_failure
from megatron_rl.sampling.batch_grading import GradeBatcher
from megatron_rl.sampling.dynamic_sampling import DynamicSamplingConfig, is_informative
from megatron_rl.sampling.producer import Round, TrainState
from megatron_rl.sampling.producer_parts import Leases, ProducerThread

logger = logging.getLogger(__name__)


class StreamProducer:
    """Admits, generates and grades prompt groups concurrently; rounds are formed from finished groups."""

    def __init__(self, coordinator: Coordinator, prepare_group: Callable[[int], Callable[[], list]],
                 grade: Callable[[list], list], *, steps: int, groups_per_step: int, group_size: int,
                 max_groups_in_flight: int, engine_stats: Callable[[], dict] | None = None,
                 dynamic: DynamicSamplingConfig | None = None):
        self.coordinator, self.steps = coordinator, steps
        self.loop = ProducerThread("stream-producer")
        self.leases = Leases(coordinator, quit=self.loop.quit_asked)
        self.prepare_group, self.grade = prepare_group, GradeBatcher(grade)
        self.engine_stats = engine_stats
        """The engines' occupancy since the last batch, as metrics (RolloutSource.engine_occupancy), or None."""
        self.groups_per_step, self.group_size = groups_per_step, group_size
        self.max_in_flight = max(1, max_groups_in_flight)
        # The groups below are guarded by the loop's condition (self.loop.cond), as the loop's own state is.
        self._groups: collections.deque = collections.deque()  # finished: (serial, samples, leases, seconds)
        self._in_flight: dict[int, tuple[list[int], list[str]]] = {}  # serial generating -> examples' indices, leases
        self._paused_in_flight: list[dict] = []  # what `pause` found generating (in_flight)
        self._pool = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="stream-group")
        self._last_handed = time.perf_counter()
        self.groups_done = 0
        self._spent: collections.Counter = collections.Counter()  # seconds per phase since the last batch
        self._floor: dict[int, int] = {}  # serial -> version published when the group was admitted (<= its tokens')
        self._published = self._offset = 0  # the version published (at least); version - step of the run
        self.groups_dropped = 0  # multi-turn groups whose environment failed at reset (released, counted)
        self.dynamic = dynamic if dynamic is not None and dynamic.enabled else None
        self._discard_budget = self.dynamic.discard_budget(groups_per_step) if self.dynamic else 0
        self.groups_discarded = 0  # dynamic sampling: uninformative groups thrown away (released, counted)
        self._skipped_before = 0  # groups that produced no batch before the checkpoint this run resumed from
        self._next_serial = 0  # the serial the next admitted group gets
        self._paused_serials: dict[str, int] = {}
        self._discards = collections.Counter()  # since the last batch: groups discarded, their tokens
        self._held_back: list[str] = []  # leases of groups skipped while paused: given back at unpause

    def start(self, state: TrainState) -> None:
        first = 0
        for rnd in state.rounds:  # finished groups a checkpoint saved, handed out first
            for k in range(0, len(rnd.samples), self.group_size):
                self._groups.append((rnd.index, rnd.samples[k:k + self.group_size],
                                     rnd.leases[k:k + self.group_size], rnd.seconds))
            first = max(first, rnd.index + 1)
            self.leases.hold(rnd.leases)
        if state.rounds:
            logger.info("handing out first the %d finished prompt groups the checkpoint saved", len(self._groups))
        first = max(first, state.step * self.groups_per_step, int(state.serials.get("next_serial", 0)))
        self._skipped_before = int(state.serials.get("groups_skipped", 0))  # keeps _last_serial's count right
        self._published, self._offset = state.version, state.version - state.step
        for group in state.in_flight:  # generating when the checkpoint was written: generated again, first
            serial, leases = int(group["serial"]), list(group["leases"])
            self.leases.hold(leases)
            indices, generate = self.prepare_group(serial, list(group["indices"]))
            self._submit(serial, indices, leases, generate)
            first = max(first, serial + 1)
        if state.in_flight:
            logger.info("generating again the %d prompt groups the checkpoint saw in flight", len(state.in_flight))
        self._next_serial = first
        self.loop.start(self._run, first)
        self.leases.keep_alive(self.loop.stopping)

    def _last_serial(self) -> int:
        """One past the last group to draw (under the lock): the groups of run.steps + lookahead batches, and one
        more for every group that produced no batch (dropped at reset, discarded as uninformative)."""
        return (self.steps + self.coordinator.lookahead) * self.groups_per_step + self._skipped()

    def _skipped(self) -> int:
        return self._skipped_before + self.groups_dropped + self.groups_discarded

    def _run(self, serial: int) -> None:
        loop = self.loop
        try:
            while True:
                with self.loop.cond:
                    while not loop.stopping.is_set() and loop.error is None:
                        if serial >= self._last_serial():
                            if not self._in_flight:  # a group still generating may yet be discarded
                                return
                        elif not loop.paused and len(self._in_flight) < self.max_in_flight:
                            break
                        self.loop.cond.wait(0.1)
                    if loop.stopping.is_set() or loop.error is not None:
                        return
                    free = min(self.max_in_flight - len(self._in_flight), self._last_serial() - serial)
                    loop.busy = True  # a checkpoint's pause waits until these groups are submitted or given back
                try:
                    t0 = time.perf_counter()
                    leases = self._admit_groups(min(free, self.groups_per_step), serial)
                    with self.loop.cond:
                        self._spent["admit"] += time.perf_counter() - t0
                    for k in range(0, len(leases or []), self.group_size):
                        indices, generate = self.prepare_group(serial)  # the data cursor moves in serial order
                        self._submit(serial, indices, leases[k:k + self.group_size], generate)
                        serial += 1
                        with self.loop.cond:
                            self._next_serial = serial
                finally:
                    loop.idle()
        except BaseException as err:  # surfaced to the driver on its next call
            loop.fail(err)

    def _submit(self, serial: int, indices: list[int], leases: list[str], generate: Callable[[], list]) -> None:
        # The group's tokens are sampled after this, under the version the driver announced last or a later one:
        # admission opens with that announcement, before the driver asks for its next batch (`next` learns it).
        announced = self.coordinator.published
        with self.loop.cond:
            self._floor[serial] = self._published if announced is None else max(self._published, announced)
            self._in_flight[serial] = (indices, leases)
            self._pool.submit(self._one_group, serial, leases, generate)

    def _admit_groups(self, groups: int, serial: int) -> list[str] | None:
        """Leases for 1 to `groups` prompt groups (from `serial` on), asked for in one coordinator call:
        whatever whole groups admission grants now (a grant short of one group waits for the rest);
        None if paused or stopped first (a partial grant is given back)."""
        leases = self.leases.admit(groups * self.group_size, serial, at_least=self.group_size)
        if leases is None:
            return None
        whole = len(leases) - len(leases) % self.group_size
        if whole < len(leases):  # part of a group: given back (grants come in whole groups unless leases expire)
            self.leases.give_back(leases[whole:])
        return leases[:whole]

    def _one_group(self, serial: int, leases: list[str], generate: Callable[[], list]) -> None:
        t0 = time.perf_counter()
        try:
            samples = generate()
            t1 = time.perf_counter()
            failed = reset_failure(samples)
            if failed is not None:
                self._skip(serial, leases, samples, dropped=True)
                logger.warning("prompt group %d dropped: its environment failed at reset (%s)", serial, failed)
                return
            scores = self.grade(samples)  # with the groups that finished meanwhile, in one call (batch_grading.py)
            t2 = time.perf_counter()
            for sample, score in zip(samples, scores, strict=True):
                sample.score = score
            if self._discardable(scores):
                self._skip(serial, leases, samples, dropped=False)
                return
            with self.loop.cond:
                self._groups.append((serial, samples, leases, time.perf_counter() - t0))
                self.groups_done += 1
                self._spent["generate"] += t1 - t0
                self._spent["grade"] += t2 - t1
        except BaseException as err:
            self.loop.fail(err)
            raise
        finally:
            with self.loop.cond:
                self._in_flight.pop(serial, None)
                self.loop.cond.notify_all()

    def _discardable(self, scores: list) -> bool:
        """Dynamic sampling: this group's rewards do not vary and this batch may still discard one (counted)."""
        if self.dynamic is None or is_informative(scores, self.dynamic.min_reward_std):
            return False
        with self.loop.cond:
            if self._discards["groups"] >= self._discard_budget:
                return False  # kept: the batch takes it as a filled group
            self._discards["groups"] += 1
            return True

    def _skip(self, serial: int, leases: list[str], samples: list, *, dropped: bool) -> None:
        """A group that goes into no batch: out of the in-flight set and its leases given back (held back until
        the checkpoint under way is written); the loop draws one more group instead."""
        with self.loop.cond:
            self._in_flight.pop(serial, None)
            self._floor.pop(serial, None)
            if dropped:
                self.groups_dropped += 1
            else:
                self.groups_discarded += 1
                self._discards["tokens"] += sum(s.generated_tokens for s in samples)  # not observations
            if self.loop.paused:
                self._held_back += leases
                leases = []
        if leases:
            self.leases.give_back(leases)  # out of the keep-alive's renewals too

    def _oldest(self, group: tuple) -> int:
        """The oldest version among a finished group's tokens (a group without tokens: its admission's)."""
        versions = [v for s in group[1] for v in s.policy_versions]
        return min(versions) if versions else self._floor.get(group[0], self._published)

    def _take(self, step: int) -> list[tuple]:
        """Batch `step`'s groups (under the lock): the first `groups_per_step` that finished, except that a group
        batch `step + 1` could no longer take (its oldest tokens would fall out of the coordinator's version
        window) goes into this batch first, and the batch waits for such a group while it generates; so a
        long group is never starved into the TTL by shorter ones that keep finishing first."""
        limit = step + self._offset + 1 - self.coordinator.lookahead  # older groups: now or never
        while True:
            short = len(self._groups) < self.groups_per_step
            if not short and not any(self._floor.get(g, limit) < limit for g in self._in_flight):
                break
            self.loop.raise_if_failed()
            if self.loop.thread is None or (not self.loop.alive() and not self._in_flight):
                raise RuntimeError(f"rollout producer stopped without producing batch {step}")
            t0 = time.perf_counter()
            self.loop.cond.wait(1.0)
            # the learner's wait for this batch: too few groups finished, or enough but one must come first
            self._spent["wait_groups" if short else "wait_window"] += time.perf_counter() - t0
        ordered = sorted(self._groups, key=lambda g: min(self._oldest(g), limit))  # the oldest of those first;
        # the others in the order they finished (a stable sort)
        taken = sorted(ordered[:self.groups_per_step], key=lambda g: g[0])  # learned in serial order
        self._groups = collections.deque(g for g in self._groups if not any(g is t for t in taken))
        for g in taken:
            self._floor.pop(g[0], None)
        return taken

    def next(self, step: int) -> Round:
        """The first `groups_per_step` groups that finished (waiting for them; those that cannot wait longer
        first, see _take), as round `step`."""
        with self.loop.cond:
            self._published = max(self._published, step + self._offset)
            taken = self._take(step)
            samples = [s for g in taken for s in g[1]]
            leases = [lease for g in taken for lease in g[2]]
            self.leases.hand_out(leases)
            in_flight = len(self._in_flight)
            spent, self._spent = self._spent, collections.Counter()
            discards, self._discards = self._discards, collections.Counter()
        now = time.perf_counter()
        seconds, self._last_handed = now - self._last_handed, now
        spans = [1 + sum(a != b for a, b in zip(s.policy_versions, s.policy_versions[1:])) for s in samples]
        stats = {"system/stream_groups_in_flight": in_flight, "system/stream_group_seconds_max": max(g[3] for g in taken),
                 "system/stream_segments_per_sample": sum(spans) / max(len(spans), 1),
                 "system/stream_multi_version_fraction": sum(n > 1 for n in spans) / max(len(spans), 1),
                 **{f"system/stream_{k}_s": v for k, v in spent.items()}}
        calls, graded = self.grade.take_calls()
        if graded:  # verifier calls per graded group since the last batch: 1 = none shared a call
            stats["system/stream_grade_calls_per_group"] = calls / graded
        if self.engine_stats is not None:
            stats.update(self.engine_stats())
        if self.dynamic is not None:
            stats.update(self._account(taken, discards))
        if samples and samples[0].episode is not None:  # multi-turn (the episodes' own metrics: reporting/telemetry.py)
            stats["env/dropped_groups"] = self.groups_dropped
        return Round(step, samples, leases, seconds, stats)

    def _account(self, taken: list[tuple], discards: collections.Counter) -> dict:
        """Dynamic sampling's account of a batch (the keys of rollout_source's rounds): its groups and the ones
        discarded since the last batch; a taken group whose rewards do not vary was kept to fill the batch."""
        informative = sum(is_informative([s.score for s in g[1]], self.dynamic.min_reward_std) for g in taken)
        return {"sampled_groups": len(taken) + discards["groups"], "informative_groups": informative,
                "filled_groups": len(taken) - informative, "discarded_tokens": discards["tokens"]}

    def pause(self) -> list[Round]:
        """Admit nothing more (waiting for an admission or a prompt draw under way); the finished groups not
        yet taken.  The groups in flight go on generating (`in_flight` names them as they were now)."""
        self.loop.pause(self.coordinator.wake_admission, busy=lambda: self.loop.busy and self.loop.alive())
        with self.loop.cond:
            finished = [Round(serial, samples, leases, seconds) for serial, samples, leases, seconds in self._groups]
            done = {r.index for r in finished}  # a group that just finished is in both until its thread ends
            self._paused_in_flight = [{"serial": serial, "indices": list(indices), "leases": list(leases)}
                                      for serial, (indices, leases) in sorted(self._in_flight.items())
                                      if serial not in done]
            self._paused_serials = {"next_serial": self._next_serial, "groups_skipped": self._skipped()}
            return finished

    def in_flight(self) -> list[dict]:
        """The prompt groups that were generating at the last `pause`: serial, examples' indices, leases."""
        return list(self._paused_in_flight)

    def serials(self) -> dict[str, int]:
        """Where the serials stood at the last `pause` (a checkpoint records it): the next one to give, and how
        many groups produced no batch.  A resumed run goes on from there: no serial, hence no sampling seed,
        is given twice, and the last batch still gets its groups."""
        return dict(self._paused_serials)

    def unpause(self) -> None:
        with self.loop.cond:
            held, self._held_back = self._held_back, []
        if held:
            self.leases.give_back(held)
        self.loop.unpause()

    def stop(self) -> None:
        self.loop.stop(self.coordinator.wake_admission, self.leases.keepalive)
        self._pool.shutdown(wait=False, cancel_futures=True)
