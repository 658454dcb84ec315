"""Run metrics: what each training step reports, and the observers that write it out.

The live orchestrator calls the ``gyre_on_metrics`` hook once per finished training step with a
flat mapping of scalars (:func:`~gyre_core.metrics.step_metrics.step_metrics`); observers are
plugins. Two are built in and selected by the run config's ``[metrics] backends``: TensorBoard
(:mod:`~gyre_core.metrics.tensorboard`, on by default, event files under the run folder) and
Weights & Biases (:mod:`~gyre_core.metrics.wandb`, optional, ``mode = "offline"`` supported).
"""

from gyre_core.metrics.step_metrics import step_metrics

__all__ = ["BACKENDS", "step_metrics"]

BACKENDS = ("tensorboard", "wandb")
"""Metrics backends a run config may name."""
