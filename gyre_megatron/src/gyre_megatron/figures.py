"""A cell's share of a step's training figures, from its last stage's per-micro-step loss outputs
(what :func:`gyre_megatron.model.gpt_forward_step`'s loss functions return)."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["MAXIMA", "objective_figures"]

MAXIMA = ("ratio_max", "abs_delta_max")
"""The figures a cell reports as its maximum; every other one is a sum."""


def objective_figures(losses: Sequence[Any], stream: Any = None) -> dict[str, float]:
    """This cell's share of a step's training figures, from the loss function's per-micro-step
    outputs (last stage): sums, except the maxima (``ratio_max``, ``abs_delta_max``). Plain items contribute ``loss_sum`` and
    ``tokens`` only. With the stream's result, also the forward-only ratio pass over split
    executions' other rows: its tokens and seconds."""
    out = {"loss": 0.0, "executions": 0.0, "clipped": 0.0, "clipped_tokens": 0.0, "corrected_tokens": 0.0,
           "entropy_sum": 0.0, "ratio_sum": 0.0,
           "ratio_max": 0.0, "tokens": 0.0, "abs_delta_sum": 0.0, "abs_delta_max": 0.0, "k3_sum": 0.0,
           "kl_ref_sum": 0.0}
    if stream is not None:
        out["ratio_pass_tokens"] = float(stream.outside_tokens)
        out["ratio_pass_s"] = float(stream.outside_s)
        out["reference_pass_s"] = float(getattr(stream, "reference_s", 0.0))
    for d in losses:
        if not isinstance(d, dict):
            continue
        out["loss"] += float(d.get("loss", d.get("loss_sum", 0.0)))
        out["tokens"] += float(d.get("tokens", 0.0))
        for k in ("executions", "clipped", "clipped_tokens", "corrected_tokens", "entropy_sum", "ratio_sum",
                  "abs_delta_sum", "k3_sum", "kl_ref_sum"):
            out[k] += float(d.get(k, 0.0))
        for k in MAXIMA:
            out[k] = max(out[k], float(d.get(k, 0.0)))
    return out
