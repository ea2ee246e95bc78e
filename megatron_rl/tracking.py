"""Weights & Biases beside TensorBoard: a metrics sink (megatron_rl/metrics.py) that sends every step's
metrics under the same names, with the run's resolved config, and attaches config.json and run_manifest.json.

    tracking:
      wandb: {project: my-project, entity: my-team, mode: offline}   # online | offline | disabled

    sinks = tracking_sinks(cfg.tracking, run_dir, resolved_config)    # [] without tracking.wandb.project

wandb is an optional dependency (`pip install wandb`, or the package's `tracking` extra): with a project set
and wandb missing, the run stops at start-up naming what to install.  The W&B run's id is derived from the run
directory, so a resumed run continues the same W&B run.  Offline runs are written under RUN_DIR/wandb
(`wandb sync RUN_DIR/wandb/offline-run-*` uploads them later).  Like every sink, a failing one is warned about
and never stops training.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Mapping

logger = logging.getLogger(__name__)

ATTACHED = ("config.json", "run_manifest.json")


class WandbSink:
    name = "wandb"

    def __init__(self, cfg: Any, run_dir: Path, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise RuntimeError("tracking.wandb.project is set but wandb is not installed: pip install wandb "
                               "(or unset tracking.wandb.project)") from None
        self.run_dir = Path(run_dir)
        run_id = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, name=cfg.name or self.run_dir.name,
                              id=run_id, resume="allow", dir=str(self.run_dir), config=dict(config),
                              settings=wandb.Settings(console="off", silent=True))
        self._attach()

    def _attach(self) -> None:
        for name in ATTACHED:
            if (self.run_dir / name).is_file():
                self.run.save(str(self.run_dir / name), base_path=str(self.run_dir), policy="now")

    def write(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._attach()  # the manifest as the run ends it
        self.run.finish()


def tracking_sinks(cfg: Any, run_dir: Path, config: Mapping[str, Any]) -> list:
    """The sinks the `tracking:` section asks for (train/config.py TrackingConfig): W&B when a project is set."""
    if cfg is None or not cfg.wandb.project or cfg.wandb.mode == "disabled":
        return []
    sink = WandbSink(cfg.wandb, run_dir, config)
    logger.info("W&B run %s (%s) in project %s", sink.run.id, cfg.wandb.mode, cfg.wandb.project)
    return [sink]
