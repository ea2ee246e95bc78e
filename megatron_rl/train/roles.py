"""The roles of a training run and the one method per phase the driver calls.

    roles = Roles.build(cfg)        # Ray, model, tokenizer, data, coordinator, rollout, verifier, learner
    state = roles.resume()          # newest COMMITTED checkpoint, or step 0
    ... the loop in driver.py ...
    roles.close()

Who owns what: the coordinator owns the queue and admission; the rollout fleet owns the vLLM
engines; the learner group owns the Megatron ranks and publishes from rank 0; the verifier pool
owns grading; this module only moves data between them and reports what happened.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sqlite3
import time
from pathlib import Path


from megatron_rl import __version__
from megatron_rl.config import config_hash
from megatron_rl.console import progress
from megatron_rl.train.config import TrainConfig, data_order_seed, resolved_dict
from megatron_rl.train.producer import Producer, Round, TrainState
from megatron_rl.train.stop import STOP_FILE, StopCondition, StopRules
from megatron_rl.train.telemetry import Telemetry, progress_line

logger = logging.getLogger(__name__)

QUEUE_DB = "queue.db"
QUEUE_SNAPSHOT = "queue_snapshot.db"
PENDING_ROUNDS = "rollout_rounds.json"  # rounds generated before a checkpoint, not yet learned from
CONSUMED_LOG = "consumed.jsonl"  # the trajectory ids each learner step learned from


class PublicationError(RuntimeError):
    """Publishing new weights failed because a rollout group's engine is dead or unreachable."""


@dataclasses.dataclass
class Roles:
    cfg: TrainConfig
    run_dir: Path
    model_dir: Path
    tokenizer: object
    tokenizer_hash: str
    splits: dict
    template: object
    cursor: object
    coordinator: object
    fleet: object
    verifier: object
    learner: object
    metrics: object
    own_ray: bool
    placement: object
    telemetry: Telemetry = dataclasses.field(default_factory=Telemetry)
    initial_eval: dict | None = None
    """The step-0 eval of the hidden test split: {"reward", "correctness", "format"}."""
    last_eval: dict | None = None
    resume_from: Path | None = None
    """The checkpoint restore_queue_snapshot verified and took the queue from; resume() loads it."""
    stop_rules: StopRules | None = None
    """The stop conditions (train/stop.py), fed every metrics dict this run logs."""
    _producer: Producer | None = None
    _step_seconds: list = dataclasses.field(default_factory=list)

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def build(cls, cfg: TrainConfig) -> "Roles":
        import ray

        from megatron_rl.coordinator import start_coordinator
        from megatron_rl.data.cursor import DataCursor
        from megatron_rl.metrics import MetricsLogger
        from megatron_rl.reward.pool import VerifierPool
        from megatron_rl.train.learner_group import LearnerGroup
        from megatron_rl.train.placement import Placement
        from megatron_rl.train.rollout_fleet import RolloutFleet

        run_dir, model_dir, tokenizer, tok_hash, splits, template = open_run_dir(cfg, kind="train")
        cursor = DataCursor(len(splits["train"]), seed=data_order_seed(cfg),
                            dataset_version=splits["train"].dataset_version)

        own_ray = not ray.is_initialized()
        if own_ray:
            if cfg.run.use_existing_ray:
                ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.WARNING)
            else:
                ray.init(num_cpus=cfg.run.ray_num_cpus, include_dashboard=False, logging_level=logging.WARNING)
        resume_from = restore_queue_snapshot(run_dir, cfg, tok_hash)
        coord_cfg = dataclasses.replace(cfg.coordinator, wal_path=str(run_dir / QUEUE_DB))
        coordinator = start_coordinator(coord_cfg, tokenizer_hash=tok_hash)
        lc = cfg.learner
        ranks = lc.tensor_model_parallel_size * lc.pipeline_model_parallel_size * cfg.run.learner_data_parallel_size
        place = Placement.create(cfg, ranks)
        rollout_cfg = dataclasses.replace(cfg.rollout, model=str(model_dir))
        fleet = RolloutFleet(rollout_cfg, num_groups=cfg.run.rollout_groups, placement=place.rollout)
        learner = LearnerGroup(learner_cfg=lc, loss_cfg=cfg.loss, hf_dir=str(model_dir),
                               data_parallel_size=cfg.run.learner_data_parallel_size, seed=lc.seed,
                               deterministic=cfg.run.deterministic, threads=cfg.run.torch_threads,
                               placement=place.learner, sampling=cfg.sampling,
                               call_timeout_s=cfg.run.learner_timeout_s)
        fleet.attach(learner, bucket_bytes=cfg.run.publish_bucket_mib << 20, transport=cfg.rollout.weight_transfer)
        verifier = VerifierPool(cfg.reward)
        metrics = MetricsLogger(run_dir / "metrics")
        return cls(cfg=cfg, run_dir=run_dir, model_dir=model_dir, tokenizer=tokenizer, tokenizer_hash=tok_hash,
                   splits=splits, template=template, cursor=cursor, coordinator=coordinator, fleet=fleet,
                   verifier=verifier, learner=learner, metrics=metrics, own_ray=own_ray, placement=place,
                   resume_from=resume_from)

    def __post_init__(self) -> None:
        if self.stop_rules is None:
            self.stop_rules = StopRules(self.cfg.stop)

    def producer(self) -> Producer:
        self._producer = Producer(self)
        return self._producer

    # ---- resume and checkpoint -------------------------------------------------------------------

    def resume(self) -> TrainState:
        import ray

        from megatron_rl.checkpoint import load_checkpoint, load_rng_state, quarantine_newer
        from megatron_rl.train.restart import shadow_forward

        state = TrainState(step=0, version=0)
        ckpt = self.resume_from  # verified (sha256) before anything was restored from it
        if ckpt is not None:
            manifest = load_checkpoint(ckpt, tokenizer_hash=self.tokenizer_hash, verify=False)
            if manifest["config_hash"] != config_hash(self.cfg):
                logger.warning("resuming %s written with a different config (hash %s, now %s)",
                               ckpt, manifest["config_hash"][:12], config_hash(self.cfg)[:12])
            self.learner.load(str(ckpt / "weights"))
            self.learner.set_rng_states({r: load_rng_state(ckpt, r) for r in manifest["rng"]["ranks"]})
            shadow_forward(self.learner, ckpt, self.cfg.run.shadow_tolerance)  # refuses altered weights
            self.cursor.load_state_dict(manifest["data_cursor"])
            rounds = [Round.from_dict(d) for d in json.loads((ckpt / PENDING_ROUNDS).read_text())] \
                if (ckpt / PENDING_ROUNDS).is_file() else []
            state = TrainState(step=int(manifest["step"]), version=int(manifest["policy_version"]), rounds=rounds)
            self.initial_eval = manifest.get("extra", {}).get("initial_test_eval")
            logger.info("resumed from %s: step %d, policy version %d", ckpt, state.step, state.version)
            self.publish(state.version)
            quarantine_newer(ckpt.parent, state.step)  # newer step dirs failed verification
        else:
            ray.get(self.coordinator.set_version.remote(state.version))
        return state

    def checkpoint(self, state: TrainState) -> Path:
        """Save weights, optimizer, RNG, queue (with admission leases and sampler RNG), data cursor and
        the rollout rounds generated ahead of the learner; COMMITTED is written last."""
        import ray

        from megatron_rl.checkpoint import rotate, save_checkpoint
        from megatron_rl.train.restart import save_probe

        probe_rows = self.cfg.learner.micro_batch_size * self.cfg.run.learner_data_parallel_size
        rounds = self._producer.pause()  # nothing in flight: cursor, queue and rounds agree
        try:
            position = ray.get(self.coordinator.position.remote())
            ckpts = self.run_dir / "checkpoints"

            def save_fn(tmp: Path) -> None:
                self.learner.save(str(tmp / "weights"))
                save_probe(self.learner, rows=probe_rows, vocab_size=self._vocab_size(), ckpt_dir=tmp)
                snapshot_queue(self.run_dir / QUEUE_DB, tmp / QUEUE_SNAPSHOT)
                (tmp / PENDING_ROUNDS).write_text(json.dumps([r.to_dict() for r in rounds]))

            lc = self.cfg.learner
            path = save_checkpoint(
                ckpts, state.step, policy_version=state.version, config_hash=config_hash(self.cfg),
                save_fn=save_fn, tokenizer_hash=self.tokenizer_hash, data_cursor=self.cursor.state_dict(),
                coordinator_log_position=position, rng_states=self.learner.rng_states(),
                extra={"initial_test_eval": self.initial_eval, "package_version": __version__,
                       "pending_rounds": [r.index for r in rounds],
                       "learner_world": {"tensor": lc.tensor_model_parallel_size,
                                         "pipeline": lc.pipeline_model_parallel_size,
                                         "data": self.cfg.run.learner_data_parallel_size}},
            )
        finally:
            self._producer.unpause()
        rotate(ckpts, self.cfg.run.keep_checkpoints)
        logger.debug("checkpoint %s committed", path)  # checkpoint.py says it on the console
        return path

    def _vocab_size(self) -> int:
        return int(json.loads((self.model_dir / "config.json").read_text())["vocab_size"])

    # ---- the phases ------------------------------------------------------------------------------

    def next_prompts(self, round_: int, n: int | None = None) -> tuple[list[list[int]], list[dict]]:
        """The next n prompts (run.prompts_per_step by default) of one rollout round (advances the data cursor)."""
        ds = self.splits["train"]
        prompts, extra = [], []
        for idx in self.cursor.next_indices(self.cfg.run.prompts_per_step if n is None else n):
            ex = ds[idx]
            prompts.append(self.template.encode(ex, self.tokenizer))
            extra.append({"prompt_id": ex.id, "answer": ex.reference, "round": round_})
        return prompts, extra

    def score(self, step: int, samples: list) -> tuple[list, float]:
        """Grade every sample in the verifier pool; build contract-complete trajectories."""
        from megatron_rl.reward.math_verifier import Score

        t0 = time.perf_counter()
        if samples and all("score" in s.extra for s in samples):  # graded by dynamic sampling already
            scores = [Score(**s.extra["score"]) for s in samples]
        else:
            scores = self.grade(samples)
        trajs = to_trajectories(samples, scores, tokenizer_hash=self.tokenizer_hash,
                                dataset_version=self.splits["train"].dataset_version)
        return trajs, time.perf_counter() - t0

    def grade(self, samples: list) -> list:
        """The verifier pool's Score of every sample (decoded response vs the prompt's answer)."""
        texts = [self.tokenizer.decode(s.response_tokens, skip_special_tokens=True) for s in samples]
        return self.verifier.score(texts, [s.extra["answer"] for s in samples], [len(s.response_tokens) for s in samples])

    def enqueue(self, trajs: list, leases: list[str] | None = None) -> dict:
        import ray

        result = ray.get(self.coordinator.put_many.remote(trajs, leases))
        if result.rejected:
            logger.warning("coordinator rejected %d trajectories, e.g. %s", len(result.rejected),
                           next(iter(result.rejected.values())))
        if result.conflicts:
            logger.error("coordinator refused %d trajectories whose ids it already holds with other content, e.g. %s",
                         len(result.conflicts), result.conflicts[0])
        return {"accepted": len(result.accepted), "rejected": len(result.rejected), "dropped": len(result.dropped),
                "conflicts": len(result.conflicts)}

    def take(self, step: int, version: int) -> list:
        """One batch inside the version window [v - max_staleness, v], waiting for it if needed."""
        import ray

        window_lo = version - self.cfg.coordinator.max_staleness
        need = self.cfg.samples_per_step
        deadline = time.monotonic() + self.cfg.run.take_timeout_s
        while True:
            batch = ray.get(self.coordinator.take.remote(need, min_version=window_lo, max_version=version,
                                                         request_id=f"step-{step}"))
            if len(batch) == need:
                check_sampling(batch, self.cfg.sampling)
                return batch
            if batch:
                # Rounds are produced B at a time inside the window, so a short batch means the
                # coordinator dropped some (TTL, quota): say so rather than train on a partial step.
                raise RuntimeError(f"step {step}: the coordinator returned {len(batch)} of {need} trajectories "
                                   f"in versions [{window_lo}, {version}]; see queue/dropped_* metrics")
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step}: no trajectories within versions [{window_lo}, {version}] "
                                   f"after {self.cfg.run.take_timeout_s} s")
            time.sleep(0.05)

    def record_consumed(self, step: int, taken: list) -> None:
        """Append the ids learner step `step` learned from to RUN_DIR/consumed.jsonl (one line per
        step and attempt; after a resume the last line of a step is the one that counts).  The
        drills count lost and duplicated trajectories from it and the WAL (megatron_rl/drill.py)."""
        row = {"step": step, "pid": os.getpid(), "time": time.time(), "ids": [t.id for t in taken]}
        with open(self.run_dir / CONSUMED_LOG, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def learn(self, taken: list, version: int, lr_scale: float = 1.0) -> tuple[dict, float]:
        from megatron_rl.train.batch import build_batch

        t0 = time.perf_counter()
        batch, adv_stats = build_batch(taken, pad_id=self.tokenizer.pad_token_id or 0, loss_cfg=self.cfg.loss,
                                       micro_batch_size=self.cfg.learner.micro_batch_size)
        out = {f"adv/{k}": v for k, v in adv_stats.items()}
        # D_lag (batch-wide and P50/P95/P99 over sequences) comes from the training forward itself:
        # its logprobs are the learner's before this update (megatron_rl.grpo.loss.grpo_metrics).
        out.update(self.learner.train_step(batch, lr_scale=lr_scale))
        out["dv"] = [version - t.oldest_version for t in taken]
        self._report_lag(out)
        return out, time.perf_counter() - t0

    def _report_lag(self, learn: dict) -> None:
        """Tell the coordinator the lag this batch showed; its admission slows the producer past the
        coordinator.backpressure_* limits (see coordinator/queue.py)."""
        import ray

        from megatron_rl.metrics import percentiles

        dv_p95 = percentiles(learn["dv"] or [0.0], "dv", qs=(95,))["dv/p95"]
        d_lag_p95 = learn.get("d_lag/p95")
        ray.get(self.coordinator.report_lag.remote(dv_p95=float(dv_p95),
                                                   d_lag_p95=None if d_lag_p95 is None else float(d_lag_p95)))

    def publish(self, version: int) -> float:
        import ray

        t0 = time.perf_counter()
        self._expect_probe(version)
        for attempt in (1, 2):
            try:
                report = self.fleet.publish(version)  # restarted groups rejoin here (rollout/fleet.py)
            except Exception as err:
                self._raise_if_engine_down(version, err)
                raise
            if report["committed"]:
                break
            self._raise_if_engine_down(version, report["errors"])
            refits = [e for e in report["errors"] if e and e.startswith("refit check")]
            if not refits:
                raise RuntimeError(f"publication of version {version} was refused: {report['errors']}")
            if attempt == 2:
                raise PublicationError(f"publication of policy version {version} failed the refit check twice "
                                       f"({refits[0]}); the groups serve version {version - 1}")
            logger.warning("%s; the group rolled back to version %d, publishing version %d again",
                           refits[0], version - 1, version)
        ray.get(self.coordinator.set_version.remote(version))
        return time.perf_counter() - t0

    def _expect_probe(self, version: int) -> None:
        """Give every rollout group the learner's logprobs of the fixed probe batch for `version`
        (its refit check, rollout/worker.py); skipped when the learner scores under a sampling
        transform (temperature, top-p/k) the engine's teacher-forced logprobs do not apply."""
        from megatron_rl.train.restart import probe_tokens

        s = self.cfg.sampling
        if self.cfg.run.refit_tolerance is None or (s.temperature, s.top_p, s.top_k) != (1.0, 1.0, 0):
            return
        rows = self.cfg.learner.micro_batch_size * self.cfg.run.learner_data_parallel_size
        tokens_bt = probe_tokens(rows, self._vocab_size(), seed=1)
        logprobs_bt = self.learner.forward_logprobs(tokens_bt)  # [B, T-1]
        seqs, lps = tokens_bt[:4].tolist(), logprobs_bt[:4].tolist()  # 4 rows are plenty for the engine
        self.fleet.expect_probe(version, seqs, lps, self.cfg.run.refit_tolerance)

    def _raise_if_engine_down(self, version: int, cause, timeout_s: float = 10.0) -> None:
        """PublicationError naming the rollout groups whose engine does not answer (dead actor,
        crashed vLLM); returns when every group answers, so the caller reports the original error."""
        import ray

        down = []
        for g, worker in enumerate(self.fleet.workers):
            try:
                ray.get(worker.policy_version.remote(), timeout=timeout_s)
            except Exception as err:  # RayActorError, GetTimeoutError, a crashed engine's error
                down.append(f"rollout group {g} ({type(err).__name__})")
        if down:
            first = str(cause).strip().splitlines()
            raise PublicationError(f"publication of policy version {version} failed: the engine of "
                                   f"{', '.join(down)} is dead or unreachable (cause: {first[-1] if first else cause})")

    # ---- reporting -------------------------------------------------------------------------------

    def log_step(self, step: int, samples, trajs, taken, learn: dict, phases: dict) -> None:
        import ray

        queue = ray.get(self.coordinator.metrics.remote())
        metrics = self.telemetry.step_metrics(samples, trajs, taken, learn, phases, queue, self.verifier.counters(),
                                              sampling=self._producer.handed_stats if self._producer else None)
        metrics.update(self.fleet.counters())  # engine restarts, retried requests (rollout/fleet.py)
        self.metrics.log(step, metrics)
        self.stop_rules.observe(step, metrics)
        self._step_seconds.append(phases["step"])
        progress(progress_line(step, self.cfg.run.steps, metrics, sum(self._step_seconds) / len(self._step_seconds)),
                 step=step, total=self.cfg.run.steps)

    def stop_condition(self) -> StopCondition | None:
        """The stop condition (train/stop.py) the metrics logged so far meet, or None; one that
        holds is also written to RUN_DIR/stop_condition.json (for `megatron-rl doctor`)."""
        condition = self.stop_rules.triggered
        if condition is not None:
            (self.run_dir / STOP_FILE).write_text(json.dumps(condition.to_dict()))
        return condition

    def log_eval(self, step: int, split: str) -> float:
        """Greedy pass@1 on a held-out split (dev during training, the hidden test split at the
        ends); logs reward, correctness and format apart, returns the mean reward."""
        from megatron_rl.evaluation import Decoding, evaluate

        ds = self.splits[split]
        examples = [ds[i] for i in range(min(self.cfg.data.eval_size, len(ds)))]
        result = evaluate(self.fleet, self.verifier, examples, self.template, self.tokenizer, Decoding(), split=split)
        self.last_eval = s = result.summary()
        if split == "test":  # per-example outcomes: what paired comparisons of runs are built on
            result.write(self.run_dir / "eval" / f"test_step_{step:06d}.jsonl")
        metrics = {f"eval/{split}_reward": s["reward"], f"eval/{split}_correctness": s["correctness"],
                   f"eval/{split}_format": s["format"], f"eval/{split}_verifier_errors": float(s["verifier_errors"])}
        self.metrics.log(step, metrics)
        self.stop_rules.observe(step, metrics)
        if s["verifier_errors"]:
            logger.warning("eval step %d on %s: %d of %d responses could not be graded (excluded from the means)",
                           step, split, s["verifier_errors"], len(examples))
        if step == 0 and split == "test" and self.initial_eval is None:
            self.initial_eval = {k: s[k] for k in ("reward", "correctness", "format")}
        logger.info("eval step %d on %s: mean reward %.3f, correctness %.3f", step, split, s["reward"],
                    s["correctness"])
        return s["reward"]

    def close(self) -> None:
        import ray

        from megatron_rl.run_manifest import close_run

        if self._producer is not None:
            self._producer.stop()
        for closer in (self.metrics.close, self.verifier.close, self.fleet.shutdown, self.learner.shutdown,
                       self.placement.remove):
            try:
                closer()
            except Exception as err:  # shutting down: report, keep closing the rest
                logger.warning("while closing: %s", err)
        if self.own_ray:
            ray.shutdown()
        close_run(self.run_dir)


# ---- helpers ------------------------------------------------------------------------------------


def open_run_dir(cfg: TrainConfig, kind: str):
    """What every run (train, sft) does first, before any Ray/vLLM/Megatron start: the run
    directory with its resolved config, seeds, the model to start from, its tokenizer, the data
    splits (checked encodable), and run_manifest.json (a resume with other inputs is refused).

    Returns (run_dir, model_dir, tokenizer, tokenizer_hash, splits, template).
    """
    from transformers import AutoTokenizer

    from megatron_rl.checkpoint import latest_committed
    from megatron_rl.data.reasoning_gym_task import check_encodable
    from megatron_rl.models.tokenizer import tokenizer_hash
    from megatron_rl.run_manifest import model_identity, open_run
    from megatron_rl.train.learner_group import seed_everything

    run_dir = Path(cfg.run.dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(resolved_dict(cfg), indent=2, sort_keys=True))
    seed_everything(cfg.run.seed, cfg.run.deterministic, cfg.run.torch_threads)
    model_dir = prepare_model(cfg, run_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    splits, template = load_data(cfg)
    check_encodable(splits, template, tokenizer)
    tok_hash = tokenizer_hash(model_dir)
    open_run(run_dir, kind=kind, config_hash=config_hash(cfg),
             resuming=cfg.run.resume and latest_committed(run_dir / "checkpoints") is not None,
             identity={"model": model_identity(model_dir), "tokenizer_hash": tok_hash,
                       "dataset_version": splits["train"].dataset_version,
                       "grader_version": cfg.reward.grader_version()})
    return run_dir, model_dir, tokenizer, tok_hash, splits, template


def prepare_model(cfg: TrainConfig, run_dir: Path) -> Path:
    """The HF model directory to start from (a tiny random model is made on first use; another
    run's newest checkpoint is exported on first use)."""
    if cfg.model.init_from is not None:
        from megatron_rl.conversion.mcore_to_hf import export_run_checkpoint

        return export_run_checkpoint(Path(cfg.model.init_from).resolve())
    if cfg.model.path is not None:
        path = Path(cfg.model.path).resolve()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path: no config.json in {path}")
        return path
    from megatron_rl.models.tiny import make_tiny_model

    path = run_dir / "model"
    if not (path / "config.json").is_file():
        spec = cfg.model.tiny
        make_tiny_model(path, arch=spec.arch, size=spec.size, seed=spec.seed)
    return path


def load_data(cfg: TrainConfig):
    from megatron_rl.data.builtin import DIGIT_MAX_TEMPLATE, make_digit_max
    from megatron_rl.data.dataset import PromptTemplate
    from megatron_rl.data.jsonl import load_jsonl
    from megatron_rl.data.splits import holdout_splits

    if cfg.data.task == "digit_max":
        splits = make_digit_max(seed=cfg.data.seed)
        template = DIGIT_MAX_TEMPLATE
    elif cfg.data.task == "reasoning_gym":
        from megatron_rl.data.reasoning_gym_task import REASONING_GYM_TEMPLATE, make_reasoning_gym

        d = cfg.data
        splits = make_reasoning_gym(d.generator, d.generator_config, seed=d.seed, train_size=d.train_size,
                                    holdout_size=d.holdout_size)
        template = REASONING_GYM_TEMPLATE
    else:
        kw = dict(question_field=cfg.data.question_field, answer_field=cfg.data.answer_field)
        d = cfg.data
        splits = holdout_splits(load_jsonl(d.train_file, split="train", **kw),
                                dev=load_jsonl(d.dev_file, split="dev", **kw) if d.dev_file else None,
                                test=load_jsonl(d.test_file, split="test", **kw) if d.test_file else None,
                                seed=d.seed, fraction=d.holdout_fraction)
        template = PromptTemplate("{question}")
    if cfg.data.template is not None:
        template = PromptTemplate(cfg.data.template)
    return splits, template


def to_trajectories(samples: list, scores: list, *, tokenizer_hash: str, dataset_version: str) -> list:
    """Rollout samples + verifier scores -> Trajectories (ids '<round>/<prompt_id>/<i>').

    A sample whose grading failed (timeout, crash) keeps no reward at all: status
    'verifier_error' with the error code, so it is excluded from the loss and counted.
    """
    from megatron_rl.trajectory import make_trajectory

    scored_at = time.time()
    trajs = []
    index: dict[str, int] = {}
    for s, sc in zip(samples, scores, strict=True):
        key = f"r{s.extra['round']:06d}/{s.extra['prompt_id']}"
        i = index[key] = index.get(key, -1) + 1
        # The verifier's weighted components: they sum to the reward eval reports too.
        components = dict(sc.components) if sc.ok else {}
        trajs.append(make_trajectory(
            id=f"{key}/{i}", prompt_id=s.extra["prompt_id"], dataset_version=dataset_version,
            policy_versions=s.policy_versions, tokenizer_hash=tokenizer_hash, prompt_tokens=s.prompt_tokens,
            response_tokens=s.response_tokens, behavior_logprobs=s.behavior_logprobs, sampling_config=s.sampling,
            reward_components=components, grader_version=sc.grader_version, terminal_reason=s.finish_reason,
            rollout_started_at=s.started_at, scored_at=scored_at,
            status="ok" if sc.ok else ("verifier_timeout" if sc.error == "timeout" else "verifier_error"),
            error_code=sc.error or "",
        ))
    return trajs


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


def snapshot_queue(src: Path, dst: Path) -> None:
    """Consistent copy of the coordinator's SQLite log (SQLite's online backup)."""
    if not src.exists():
        return
    with sqlite3.connect(str(src)) as a, sqlite3.connect(str(dst)) as b:
        a.backup(b)


def check_resume_world(cfg: TrainConfig) -> None:
    """Refuse, before anything starts, to resume a checkpoint saved by another learner layout.

    The Megatron distributed checkpoint of model + optimizer could be resharded, but the
    per-rank RNG states and the scheduler files are keyed by rank, so a resume at another
    data-parallel (or tensor/pipeline) size would not be the run it claims to continue.
    """
    from megatron_rl.checkpoint import CheckpointError, read_manifest, resume_checkpoint

    ckpt = resume_checkpoint(Path(cfg.run.dir).resolve() / "checkpoints") if cfg.run.resume else None
    if ckpt is None:
        return
    manifest = read_manifest(ckpt)
    lc = cfg.learner
    now = {"tensor": lc.tensor_model_parallel_size, "pipeline": lc.pipeline_model_parallel_size,
           "data": cfg.run.learner_data_parallel_size}
    saved = manifest.get("extra", {}).get("learner_world")
    if saved is None:  # written before the layout was recorded: the RNG files still count the ranks
        ranks = len(manifest.get("rng", {}).get("ranks", []))
        if ranks and ranks != now["tensor"] * now["pipeline"] * now["data"]:
            raise CheckpointError(f"cannot resume {ckpt}: it was saved by {ranks} learner ranks, this run has "
                                  f"{now['tensor'] * now['pipeline'] * now['data']}")
        return
    if saved != now:
        raise CheckpointError(
            f"cannot resume {ckpt}: it was saved by a learner with (tensor, pipeline, data) parallel sizes "
            f"({saved['tensor']}, {saved['pipeline']}, {saved['data']}), this run has ({now['tensor']}, "
            f"{now['pipeline']}, {now['data']}); per-rank RNG and scheduler state cannot be carried over. "
            "Use the same layout, or start a new run directory (run.resume=false ignores the checkpoint)")


def restore_queue_snapshot(run_dir: Path, cfg: TrainConfig, tokenizer_hash: str | None = None) -> Path | None:
    """Put the queue back as it was at the checkpoint we resume from (if any); returns that checkpoint.

    The checkpoint is the newest one whose every file matches its COMMITTED manifest (sha256):
    a corrupt or uncommitted newer one is skipped (the warning names the file) before the live
    queue.db is touched, so nothing of it ever reaches the run directory; so is a checkpoint of
    another tokenizer refused (CheckpointError) with the live queue left as it is.
    """
    from megatron_rl.checkpoint import load_checkpoint, resume_checkpoint

    ckpt = resume_checkpoint(run_dir / "checkpoints") if cfg.run.resume else None
    if ckpt is not None:
        load_checkpoint(ckpt, tokenizer_hash=tokenizer_hash, verify=False)  # files verified just above
    live = run_dir / QUEUE_DB
    for suffix in ("", "-wal", "-shm"):
        Path(str(live) + suffix).unlink(missing_ok=True)
    if ckpt is not None and (ckpt / QUEUE_SNAPSHOT).exists():
        shutil.copyfile(ckpt / QUEUE_SNAPSHOT, live)
        logger.info("restored %s from %s", QUEUE_DB, ckpt / QUEUE_SNAPSHOT)
    return ckpt
