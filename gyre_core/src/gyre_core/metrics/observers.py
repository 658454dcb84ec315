"""Start and stop the metrics observers a run config names (``[metrics] backends``)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

__all__ = ["close_observers", "open_observers"]


def open_observers(metrics: Any, out_dir: Path, pm: Any, config: dict[str, Any]) -> list[Any]:
    """Register one observer per backend on ``pm``; their event files go under ``metrics.dir``
    (default ``<out_dir>/metrics``)."""
    root = Path(metrics.dir) if metrics.dir else out_dir / "metrics"
    observers: list[Any] = []
    for backend in metrics.backends:
        if backend == "tensorboard":
            from gyre_core.metrics.tensorboard import TensorBoardObserver

            obs: Any = TensorBoardObserver(root / "tensorboard")
        else:  # "wandb": the config check refused anything else
            from gyre_core.metrics.wandb import WandbObserver

            obs = WandbObserver(root / "wandb", project=metrics.wandb_project, mode=metrics.wandb_mode, config=config)
        pm.register(obs, name=f"gyre-metrics-{backend}")
        observers.append(obs)
    return observers


def close_observers(observers: list[Any], pm: Any) -> None:
    for obs in observers:
        with contextlib.suppress(Exception):
            obs.close()
        with contextlib.suppress(Exception):
            pm.unregister(obs)
