"""TensorBoard observer: every step's metrics as scalars in event files under the run folder.

Written with ``torch.utils.tensorboard`` (``tensorboard --logdir <out_dir>/metrics`` shows them);
the global step is the training step, so runs of different lengths and resumed runs line up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from gyre_core.hookspecs import hookimpl

__all__ = ["TensorBoardObserver"]


class TensorBoardObserver:
    """A ``gyre_on_metrics`` plugin writing to ``log_dir`` (created)."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    @hookimpl
    def gyre_on_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()  # a step is minutes apart: nothing is lost to a crash

    def close(self) -> None:
        self._writer.close()
