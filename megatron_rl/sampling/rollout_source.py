"""Where the learner's batches come from: prompts from the data cursor, generated on the rollout
fleet, one round per learner step, as far ahead as the coordinator admits.

    fleet = start_fleet(cfg.rollout, model_dir, placement.rollout)
    source = RolloutSource(fleet, PromptStream(train, template, tokenizer, cursor), coordinator, scorer,
                           spec=RoundSpec.from_sections(cfg.run, cfg.dynamic_sampling))
    source.start(state)              # replays the rounds a checkpoint saved, then samples new ones
    rnd = source.next(step)          # Round: samples (prompt-major groups of G), leases, seconds, stats
    rounds = source.pause(); source.in_flight(); ...; source.unpause()  # a checkpoint (admission stopped)
    source.stop(); source.close()

Owns the producer thread (producer.py), the rollout fleet (rollout/fleet.py), the prompts (the data
cursor and their encoding: prompt_stream.py), and dynamic sampling (dynamic_sampling.py: oversample
prompts, grade each group as it arrives, keep groups whose rewards vary).  Per-request sampling
seeds derive from the run seed and the round, so a round is the same in every run of a seed.

One path for single-turn and multi-turn samples: `_draw` takes prompts from the cursor (token ids, or the
Examples episodes start from when the run has an environment) and `_play` sends them to the fleet (the
rollout groups generate responses, or play episodes: rollout/episodes.py on either engine); rounds, dynamic
sampling and streaming groups all go through the two.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from megatron_rl.coordinator.client import Coordinator
from megatron_rl.data.cursor import DataCursor
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.sampling.dynamic_sampling import DynamicSamplingConfig
from megatron_rl.sampling.producer import Producer, Round, TrainState
from megatron_rl.sampling.prompt_stream import PromptStream
from megatron_rl.rollout.fleet import RolloutFleet
from megatron_rl.rollout.sample import reset_failure
from megatron_rl.sampling.scoring import Scorer

if TYPE_CHECKING:
    from megatron_rl.train.config import RunConfig

logger = logging.getLogger(__name__)

MAX_ENV_REDRAWS = 3
"""Multi-turn rounds: fresh prompt groups drawn, per round, for groups whose environment failed at reset."""
ATTEMPT_SEED_STRIDE = 104_729
"""A round's later draws (a redraw, a dynamic sampling attempt) are seeded the round's seed + attempt x this."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoundSpec:
    """The shape of a rollout round: what the source reads of the run config, nothing else."""

    prompts_per_step: int
    group_size: int
    steps: int
    seed: int
    dynamic: DynamicSamplingConfig
    env: dict | None = None
    """The `env:` section as a dict when samples are multi-turn episodes (envs/config.py), else None."""

    @classmethod
    def from_sections(cls, run: RunConfig, dynamic: DynamicSamplingConfig, env=None) -> "RoundSpec":
        return cls(prompts_per_step=run.prompts_per_step, group_size=run.group_size, steps=run.steps, seed=run.seed,
                   dynamic=dynamic, env=dataclasses.asdict(env) if env is not None and env.enabled else None)


def start_fleet(rollout: RolloutConfig, model_dir: Path,
                placement: Callable[[int], dict] | None = None, *, wait: bool = True,
                handed_over: list | None = None) -> RolloutFleet:
    """rollout.data_parallel_size vLLM groups (the `rollout:` section), serving the run's model as version 0.
    wait=False returns while the engines start (call the fleet's wait_ready() before using them).
    `handed_over`: an earlier run's engines (train/engine_pool.py), refitted by the first publication."""
    return RolloutFleet(dataclasses.replace(rollout, model=str(model_dir)), num_groups=rollout.data_parallel_size,
                        placement=placement, wait=wait, handed_over=handed_over)


class RolloutSource:
    """Owns the producer, the fleet, the prompts; yields one Round per learner step."""

    def __init__(self, fleet: RolloutFleet, prompts: PromptStream, coordinator: Coordinator, scorer: Scorer, *,
                 spec: RoundSpec):
        self.fleet, self.prompts, self.scorer, self.spec = fleet, prompts, scorer, spec
        if fleet.cfg.streaming:  # groups stream into batches as they finish (stream_producer.py)
            from megatron_rl.sampling.stream_producer import StreamProducer

            self.producer = StreamProducer(coordinator, self.prepare_group, scorer.grade, steps=spec.steps,
                                           groups_per_step=spec.prompts_per_step, group_size=spec.group_size,
                                           max_groups_in_flight=(coordinator.lookahead + 1) * spec.prompts_per_step,
                                           engine_stats=self.engine_occupancy, dynamic=spec.dynamic)
        else:
            self.producer = Producer(coordinator, self.sample_round, steps=spec.steps)
        self._started = False

    @property
    def cursor(self) -> DataCursor:
        return self.prompts.cursor

    # ---- the producer -----------------------------------------------------------------------------

    def start(self, state: TrainState) -> None:
        self.producer.start(state)
        self._started = True

    def next(self, step: int) -> Round:
        return self.producer.next(step)

    def pause(self) -> list[Round]:
        return self.producer.pause()

    def in_flight(self) -> list[dict]:
        """The prompt groups generating when the producer paused (streaming; a checkpoint records them)."""
        return self.producer.in_flight()

    def serials(self) -> dict[str, int]:
        """Streaming: where the prompt groups' serials stood at the pause (a checkpoint records it)."""
        return self.producer.serials()

    def unpause(self) -> None:
        self.producer.unpause()

    def stop(self) -> None:
        if self._started:
            self.producer.stop()

    def close(self) -> None:
        self.stop()
        self.fleet.shutdown()

    def engine_occupancy(self) -> dict[str, float]:
        """The streaming engines' occupancy and idle fraction since the last step, averaged over the groups
        (rollout/occupancy.py), and the refits they committed meanwhile with the requests those kept in flight,
        summed; {} when a group does not answer (a restart under way: the next step has it)."""
        import ray

        try:
            got = ray.get([w.occupancy.remote() for w in self.fleet.workers], timeout=30)
        except Exception as err:  # noqa: BLE001 -- a dead or restarting engine: the fleet handles it
            logger.warning("engine occupancy not read this step: %s", err)
            return {}
        return {"system/engine_occupancy": sum(g["occupancy"] for g in got) / len(got),
                "system/engine_idle_fraction": sum(g["idle_fraction"] for g in got) / len(got),
                "system/engine_refits": float(sum(g["refits"] for g in got)),  # committed, summed over groups
                "system/engine_refit_requests_kept": float(sum(g["requests_kept"] for g in got))}

    # ---- one round --------------------------------------------------------------------------------

    def round_seed(self, r: int) -> int:
        return self.spec.seed * 1_000_000_007 + r * 7919  # per-request seeds derive from (run seed, round)

    def sample_round(self, r: int) -> tuple[list, dict]:
        """The samples of round r (prompt-major groups) and, with dynamic sampling, its account."""
        if self.spec.dynamic.enabled:
            return self._sample_informative(r, self.round_seed(r))
        return self._play_round(r, self.round_seed(r))

    def _draw(self, r: int, k: int) -> tuple[list, list]:
        """k prompts from the data cursor: token ids, or with an environment the Examples episodes start from."""
        return self.prompts.next(r, k, examples=self.spec.env is not None)

    def _play(self, prompts: list, info: list, seed: int, first_group: int = 0) -> list:
        """The G samples of every prompt, prompt-major: single-turn responses, or episodes of the run's environment
        (the rollout groups' run_episodes: rollout/episodes.py on either engine)."""
        return self.fleet.generate(prompts, n=self.spec.group_size, info=info, sampling={"seed": seed},
                                   first_group=first_group, env=self.spec.env)

    def _play_round(self, r: int, seed: int) -> tuple[list, dict]:
        """Round r's groups.  A group whose environment failed at reset (multi-turn: its episodes have no tokens)
        has nothing to train on: it is replaced by a fresh prompt's group, at most MAX_ENV_REDRAWS times a round,
        and counted (a single-turn group always has tokens)."""
        G, kept, dropped = self.spec.group_size, [], 0
        for attempt in range(MAX_ENV_REDRAWS + 1):
            missing = self.spec.prompts_per_step - len(kept) // G
            if not missing:
                break
            prompts, info = self._draw(r, missing)
            samples = self._play(prompts, info, seed + attempt * ATTEMPT_SEED_STRIDE)
            for k in range(0, len(samples), G):
                group = samples[k:k + G]
                failed = reset_failure(group)
                if failed is None:
                    kept += group
                else:
                    dropped += 1
                    logger.warning("round %d: prompt group %s dropped: its environment failed at reset (%s)", r,
                                   group[0].prompt.id, failed)
        if len(kept) < self.spec.prompts_per_step * G:
            raise RuntimeError(f"round {r}: the environment failed at reset for {dropped} prompt groups; "
                               f"{MAX_ENV_REDRAWS} redraws could not fill the round (see the warnings above)")
        return kept, ({"env/dropped_groups": dropped} if self.spec.env is not None else {})

    def prepare_group(self, serial: int, indices: list[int] | None = None) -> tuple[list[int], Callable[[], list]]:
        """Streaming: draw prompt group `serial`'s prompt now (with `indices`, those examples again: a group in
        flight at a checkpoint, at resume); its examples' indices and the call that generates its G samples (on
        the rollout groups in turn, seeded like a round of that number)."""
        indices = self.cursor.next_indices(1) if indices is None else list(indices)
        prompts, info = self.prompts.at(indices, serial, examples=self.spec.env is not None)
        seed, k = self.round_seed(serial), len(self.fleet.workers)
        return indices, lambda: self._play(prompts, info, seed, first_group=serial % k)

    def _sample_informative(self, r: int, seed: int) -> tuple[list, dict]:
        """Dynamic sampling (sampling/dynamic_sampling.py): oversample prompts, grade each group as it
        arrives and keep only groups whose rewards vary, for at most max_attempts attempts; the
        grades travel with the samples (sample.score) so nothing is graded twice."""
        from megatron_rl.sampling.dynamic_sampling import Group, fill, select_groups

        ds, G, need = self.spec.dynamic, self.spec.group_size, self.spec.prompts_per_step
        kept: list[Group] = []
        taken: set[str] = set()
        sampled = discarded_tokens = attempts = dropped = 0
        leftovers: list[Group] = []
        while len(kept) < need and attempts < ds.max_attempts:
            prompts, info = self._draw(r, ds.prompts_to_draw(need - len(kept)))
            samples = self._play(prompts, info, seed + attempts * ATTEMPT_SEED_STRIDE)
            scores = self.scorer.grade(samples)
            groups = []
            for i in range(len(prompts)):
                group = samples[i * G:(i + 1) * G]
                failed = reset_failure(group)
                if failed is None:
                    groups.append(Group(group[0].prompt.id, group, scores[i * G:(i + 1) * G]))
                else:  # nothing to train on, as in a round without dynamic sampling: counted, not kept
                    dropped += 1
                    logger.warning("round %d: prompt group %s dropped: its environment failed at reset (%s)", r,
                                   group[0].prompt.id, failed)
            new, leftovers = select_groups(groups, need=need - len(kept), taken=taken,
                                           min_reward_std=ds.min_reward_std)
            kept += new
            sampled += len(groups)
            discarded_tokens += sum(g.tokens for g in leftovers)
            attempts += 1
        informative = len(kept)
        if len(kept) < need:
            filler = fill(kept, leftovers, need=need, taken=taken)
            discarded_tokens -= sum(g.tokens for g in filler)
            kept += filler
            logger.warning("round %d: dynamic sampling found %d of %d informative groups in %d attempts; "
                           "filled with %d groups of equal rewards", r, informative, need, attempts, len(filler))
        out = []
        for g in kept:
            for sample, score in zip(g.samples, g.scores, strict=True):
                sample.score = score
                out.append(sample)
        stats = {"sampled_groups": sampled, "informative_groups": informative,
                 "filled_groups": need - informative, "discarded_tokens": discarded_tokens, "attempts": attempts}
        return out, stats | ({"env/dropped_groups": dropped} if self.spec.env is not None else {})
