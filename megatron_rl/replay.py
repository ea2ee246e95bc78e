"""Exact replay of a run's learner side from its log: the same batches, the same numbers, or the first step that differs.

    megatron-rl replay RUN_DIR [--to-step N] [--json]                      # identical: true | false
    megatron-rl replay RUN_DIR --from-step K --set loss.clip_eps_high=0.28   # a counterfactual on the same data

What a run keeps is enough: consumed.jsonl (the ids each learner step learned from, in order; after a resume
the last line of a step counts), the write-ahead log's trajectories (queue.db: the queued ones in `traj`, and,
with `coordinator.keep_consumed: true`, every consumed one in `kept`), metrics.jsonl (each step's loss and grad
norm) and the checkpoints.  Replay builds one learner rank in this process (no engines, no Ray) from the run's
config and starting model, then per step builds the batch from the recorded trajectories exactly as the driver
does (train/batch.py build_batch) and trains it (the restart canary's learning-rate scale on the first step of
a resumed attempt, the adaptive KL controller's β), and compares `learn/loss`, `learn/grad_norm`, `learn/lr`
and `learn/d_lag` bit for bit, and at every checkpoint the sha256 of the learner's weights and optimizer
against the checkpoint's.
Bit-identity holds on the machine kind the run trained on (one torch build and CPU kernel set).

`--from-step K` starts from checkpoint K instead of the start (its weights, optimizer and KL state); `--set`
changes config keys for the replay only: the report then shows where and by how much the numbers move.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sqlite3
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
KEYS = ("loss", "grad_norm", "lr", "d_lag")  # compared bit for bit; loss and grad_norm always, the others when logged


def weights_digest(weights_dir: Path) -> str:
    """sha256 over every tensor (model and optimizer) of a learner's saved weights directory, by name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "w.pt"
        dcp_to_torch_save(str(weights_dir), str(out))
        state = torch.load(out, weights_only=False)
    h = hashlib.sha256()
    for name, t in sorted((k, v) for k, v in state.items() if isinstance(v, torch.Tensor)):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclasses.dataclass
class StepRecord:
    step: int
    ids: list[str]
    canary: bool  # the first step of an attempt that resumed from a checkpoint


def consumed_steps(run_dir: Path) -> dict[int, StepRecord]:
    """Per learner step, the ids it learned from (the last attempt's line) and whether it was a canary step."""
    from megatron_rl.run_files import read_jsonl

    rows = read_jsonl(run_dir / "consumed.jsonl", strict=True)
    steps: dict[int, StepRecord] = {}
    previous_pid = None
    for row in rows:
        first_of_attempt = row.get("pid") != previous_pid
        previous_pid = row.get("pid")
        steps[int(row["step"])] = StepRecord(int(row["step"]), list(row["ids"]),
                                             canary=first_of_attempt and int(row["step"]) > 1)
    return steps


def load_trajectories(db_path: Path, ids: set[str]) -> dict[str, object]:
    """The recorded trajectories of `ids` from the run's log (queued and kept)."""
    from megatron_rl.config import ConfigError
    from megatron_rl.run_files import query_sqlite
    from megatron_rl.trajectory import Trajectory

    found: dict[str, object] = {}
    for table in ("traj", "kept"):
        try:
            for tid, payload in query_sqlite(db_path, f"SELECT id, payload FROM {table}"):
                if tid in ids and tid not in found:
                    found[tid] = Trajectory.from_bytes(payload)
        except ConfigError as err:
            if table == "kept" and "no such table" in str(err):
                continue  # a log written before `kept` existed
            raise
    return found


def recorded_figures(run_dir: Path) -> dict[int, dict[str, float]]:
    """learn/loss and learn/grad_norm per step as metrics.jsonl holds them (the last row of a step wins)."""
    from megatron_rl.run_files import read_jsonl

    out = {}
    for row in read_jsonl(run_dir / "metrics" / "metrics.jsonl"):
        if "learn/loss" in row:
            out[int(row["step"])] = {k: row.get(f"learn/{k}") for k in KEYS}
    return out


class ReplayLearner:
    """One learner rank in this process, built as a run's rank 0 is (ranks/rank.py LearnerWorker)."""

    def __init__(self, cfg, model_dir: Path):
        from megatron_rl.ranks.rank import LearnerWorker, RankSpec

        if cfg.learner.world_size != 1:
            raise ValueError(f"replay runs one learner rank in this process; this run has learner.world_size "
                             f"{cfg.learner.world_size} (TP/PP/DP replay is not built yet)")
        spec = RankSpec(learner=cfg.learner, loss=cfg.loss, hf_dir=str(model_dir), seed=cfg.learner.seed,
                        deterministic=cfg.run.deterministic, threads=cfg.run.torch_threads, sampling=cfg.sampling,
                        audit_ring=0)
        self.worker = LearnerWorker(rank=0, world_size=1)
        addr, port = self.worker.rendezvous_address()
        self.worker.setup(addr, port, spec)

    def digest(self) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            self.worker.save(str(Path(tmp) / "weights"))
            return weights_digest(Path(tmp) / "weights")


def _inputs(run_dir: Path, from_step: int, to_step: int | None) -> tuple[dict, dict, int]:
    """(the consumed steps, the trajectories of steps from_step+1..to_step, to_step); ConfigError when the log
    lacks any of them or the range is not the run's."""
    from megatron_rl.config import ConfigError

    steps = consumed_steps(run_dir)
    last = max(steps) if steps else 0
    to_step = last if to_step is None else to_step
    if not steps or not 0 <= from_step < to_step <= last:
        raise ConfigError(f"{run_dir}: replay needs 0 <= --from-step < --to-step <= {last} (the steps in "
                          f"consumed.jsonl), got {from_step} and {to_step}")
    wanted = {i for s in range(from_step + 1, to_step + 1) for i in steps[s].ids}
    trajs = load_trajectories(run_dir / "queue.db", wanted)
    missing = wanted - trajs.keys()
    if missing:
        raise ConfigError(f"{run_dir / 'queue.db'}: {len(missing)} of the {len(wanted)} trajectories these steps "
                          f"learned from are not in the log (compaction dropped them): replay needs a run made "
                          f"with coordinator.keep_consumed: true")
    return steps, trajs, to_step


def replay(run_dir: Path, *, to_step: int | None = None, from_step: int = 0, overrides: list[str] = ()) -> dict:
    """Re-run the learner side of `run_dir` (module docstring); the report, `identical` and `first_difference`."""
    from megatron_rl.config import ConfigError, apply_overrides, from_dict
    from megatron_rl.run_files import read_json
    from megatron_rl.run_model import run_model_dir
    from megatron_rl.train.batch import build_batch
    from megatron_rl.train.config import TrainConfig

    run_dir = Path(run_dir)
    cfg = from_dict(TrainConfig, apply_overrides(read_json(run_dir / "config.json"), list(overrides)))
    steps, trajs, to_step = _inputs(run_dir, from_step, to_step)
    from transformers import AutoTokenizer

    model_dir = run_model_dir(run_dir)
    pad_id = AutoTokenizer.from_pretrained(str(model_dir)).pad_token_id or 0
    learner = ReplayLearner(cfg, model_dir)
    kl = cfg.loss.kl_controller()
    checkpoints = {int(p.name.split("_")[-1]): p for p in (run_dir / "checkpoints").glob("step_*")
                   if (p / "COMMITTED").is_file() and (p / "weights").is_dir()}
    if from_step:
        start = checkpoints.get(from_step)
        if start is None:
            raise ConfigError(f"{run_dir}: no committed checkpoint at step {from_step} to start from "
                              f"(committed: {sorted(checkpoints)})")
        learner.worker.load(str(start / "weights"))
        manifest = json.loads((start / "COMMITTED").read_text())
        if manifest.get("extra", {}).get("kl_control"):
            kl.load_state_dict(manifest["extra"]["kl_control"])
    recorded = recorded_figures(run_dir)
    report = {"run_dir": str(run_dir), "from_step": from_step, "to_step": to_step, "overrides": list(overrides),
              "steps": [], "checkpoints": {}, "first_difference": None}
    for s in range(from_step + 1, to_step + 1):
        taken = [trajs[i] for i in steps[s].ids]
        batch, _ = build_batch(taken, pad_id=pad_id, loss_cfg=cfg.loss, micro_batch_size=cfg.learner.micro_batch_size)
        scale = cfg.run.canary_lr_scale if steps[s].canary else 1.0
        out = learner.worker.train_step(batch, lr_scale=scale, kl_coef=kl.coef if kl.adaptive else None)
        kl.update(out.get("kl_ref_estimate"))
        want = recorded.get(s, {})
        row = {"step": s, **{k: out.get(k) for k in KEYS}, **{f"recorded_{k}": want.get(k) for k in KEYS}}
        compared = [k for k in KEYS if k in ("loss", "grad_norm") or (k in out and want.get(k) is not None)]
        row["differs"] = [k for k in compared if out.get(k) != want.get(k)]
        row["identical"] = not row["differs"]
        report["steps"].append(row)
        if s in checkpoints and s > from_step:
            same = learner.digest() == weights_digest(checkpoints[s] / "weights")
            report["checkpoints"][checkpoints[s].name] = same
            row["identical"] = row["identical"] and same
        if not row["identical"] and report["first_difference"] is None:
            report["first_difference"] = s
        logger.info("replay step %d: loss %r (recorded %r) %s", s, row["loss"], row["recorded_loss"],
                    "identical" if row["identical"] else "DIFFERS")
    report["identical"] = report["first_difference"] is None
    return report
