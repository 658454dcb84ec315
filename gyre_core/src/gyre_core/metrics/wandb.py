"""Weights & Biases observer (optional: ``pip install wandb``): every step's metrics as one log
call at the training step. ``mode = "offline"`` writes the run under ``<out_dir>/metrics/wandb``
for a later ``wandb sync``; ``"online"`` needs the site's W&B login."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from gyre_core.hookspecs import hookimpl

__all__ = ["WandbObserver"]


class WandbObserver:
    """A ``gyre_on_metrics`` plugin logging to one W&B run."""

    def __init__(self, log_dir: str | Path, *, project: str, mode: str, config: Mapping[str, Any]) -> None:
        import wandb

        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, mode=mode, dir=str(log_dir), config=dict(config), reinit=True)

    @hookimpl
    def gyre_on_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()
