"""The data plane's micro-steps as megatron GPT inputs.

A :class:`gyre_core.dataplane.packing.MicroStep` holds, per data-parallel rank, a pack of whole
rows (token ids and per-token objective weights ``W_t``). The rows of a pack become the batch
dimension, right-padded to the longest row, so each row attends only to itself with the plain
causal mask (packed-sequence attention across row boundaries needs TransformerEngine's THD
kernels, which the CPU local spec lacks). Position ``t`` predicts token ``t+1`` of its row, so
its loss weight is ``W_{t+1}``; padding and context tokens weigh 0. The result is the same item
format as the tests' synthetic rows, so the streaming schedule and the per-token loss need no
special case: the loss is ``Σ W_t · (−log π(token_t))``, additive over micro-steps.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["microstep_to_item"]


def microstep_to_item(ms: Any, dp_rank: int = 0) -> dict[str, torch.Tensor]:
    """``{tokens, labels, loss_mask, index}`` ([rows, longest row]) for ``ms.packs[dp_rank]``."""
    rows = ms.packs[dp_rank].rows
    if not rows:
        raise ValueError(f"micro-step {ms.index}: data-parallel rank {dp_rank} has an empty pack")
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.int64)
    labels = torch.zeros(len(rows), width, dtype=torch.int64)
    weights = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r)
        tokens[i, :n] = r.row.token_ids
        labels[i, : n - 1] = r.row.token_ids[1:]
        weights[i, : n - 1] = r.loss_weights[1:].float()
    return {"tokens": tokens, "labels": labels, "loss_mask": weights, "index": torch.tensor(ms.index)}


def as_item(obj: Any) -> Any:
    """Claimed queue entries as schedule items: micro-steps converted, anything else as is."""
    if obj is not None and hasattr(obj, "packs") and hasattr(obj, "index"):
        return microstep_to_item(obj)
    return obj
