"""The data plane's micro-steps as megatron GPT inputs, carrying what the GSPO loss needs.

A :class:`gyre_core.dataplane.packing.MicroStep` holds, per data-parallel rank, a pack of whole
rows: token ids, the objective's per-token weights ``W_t``, the behaviour log-probs, and each
row's execution slot and advantage. The rows of a pack become the batch dimension, right-padded to
the longest row, so each row attends only to itself with the plain causal mask (packed-sequence
attention across row boundaries needs TransformerEngine's THD kernels, which the CPU local spec
lacks). Position ``t`` predicts token ``t+1`` of its row, so every per-token field is shifted by
one (``W_{t+1}``, ``log π_b(t+1)``); padding and context tokens weigh 0. Where a call sampled at a
temperature other than 1 the item carries ``temperature`` per label, and the log-probs are taken
of ``softmax(logits / T)``, the distribution the engine sampled from and reported.

The loss is the core's objective, :func:`gyre_core.dataplane.objective.microstep_objective`
(called by :func:`gyre_megatron.model.gpt_forward_step` on the last pipeline stage with the
current log-probs): additive over micro-steps and cells, already normalised per execution, so
the trainer must not divide by the token count (``RankOptions.normalise_by_tokens = False``).
Items without ``advantages`` (the tests' synthetic rows) keep the plain per-token loss.

An execution too long for one pack is split over packs; each part's item carries the other parts'
rows as forward-only ``outside`` items. The stream runs them without gradient before the part
(:func:`gyre_megatron.streaming.run_streaming_1f1b`) and hands their log-ratio sums to the loss, so
the part is clipped on the whole execution's ratio.
"""

from __future__ import annotations

from typing import Any

import torch

from gyre_core.interfaces import ObjectiveConfig

__all__ = ["as_item", "microstep_to_item"]


def _padded(rows: Any, multiple: int = 1) -> dict[str, torch.Tensor]:
    """The per-token fields of ``rows`` as ``[rows, longest row]`` tensors, shifted by one; the
    width rounded up to a ``multiple`` (a sequence-parallel stage splits it over its tensor ranks)."""
    width = -(-max(len(r) for r in rows) // multiple) * multiple
    shape = (len(rows), width)
    tokens = torch.zeros(shape, dtype=torch.int64)
    labels = torch.zeros(shape, dtype=torch.int64)
    weights = torch.zeros(shape, dtype=torch.float32)
    behaviour = torch.zeros(shape, dtype=torch.float32)
    advantages = torch.zeros(shape, dtype=torch.float32)
    slots = torch.zeros(shape, dtype=torch.int64)
    temps = torch.ones(shape, dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r)
        tokens[i, :n] = r.row.token_ids
        labels[i, : n - 1] = r.row.token_ids[1:]
        weights[i, : n - 1] = r.loss_weights[1:].float()
        behaviour[i, : n - 1] = r.row.behaviour_logprobs[1:].float()
        advantages[i, :] = float(r.advantage)
        slots[i, :] = int(r.exec_slot)
        temps[i, : n - 1] = r.row.temperatures[1:]
    out = {"tokens": tokens, "labels": labels, "loss_mask": weights, "behaviour_logprobs": behaviour,
           "advantages": advantages, "exec_slots": slots}
    if bool((temps != 1).any()):  # the sampling temperature of each label's call (1 is the model's own)
        out["temperature"] = temps
    return out


def _outside_chunks(pack: Any, multiple: int = 1) -> list[dict[str, torch.Tensor]]:
    """The pack's :attr:`~gyre_core.dataplane.packing.Pack.outside` rows as forward-only items of at
    most the pack's own size in tokens (a row is never longer than the budget), so the ratio pass
    needs no more activation memory than the training forward."""
    limit = max(pack.tokens, max(len(r) for r in pack.outside))
    chunks: list[list[Any]] = [[]]
    room = limit
    for r in pack.outside:
        if len(r) > room and chunks[-1]:
            chunks.append([])
            room = limit
        chunks[-1].append(r)
        room -= len(r)
    out = []
    for rows in chunks:
        item = _padded(rows, multiple)
        del item["advantages"]
        item["n_executions"] = torch.tensor(int(pack.n_executions))
        item["ratio_only"] = torch.tensor(1)
        out.append(item)
    return out


def microstep_to_item(ms: Any, dp_rank: int = 0, objective: ObjectiveConfig | None = None,
                      multiple: int = 1) -> dict[str, Any]:
    """``{tokens, labels, loss_mask, behaviour_logprobs, advantages, exec_slots, n_executions,
    index}`` ([rows, longest row]) for ``ms.packs[dp_rank]``; ``objective`` is the run's objective
    (the paper's GSPO when absent). A pack with parts of split
    executions adds ``outside``: forward-only items of their other rows (``ratio_only``), which
    the stream runs before this one to complete each execution's ratio -- for the objectives that
    clip on it (:attr:`~gyre_core.interfaces.ObjectiveConfig.sequence_level`) only. Widths are padded to a
    ``multiple`` of tokens (weight 0)."""
    pack = ms.packs[dp_rank]
    rows = pack.rows
    if not rows:
        raise ValueError(f"micro-step {ms.index}: data-parallel rank {dp_rank} has an empty pack")
    item: dict[str, Any] = {**_padded(rows, multiple), "n_executions": torch.tensor(int(pack.n_executions)),
                            "index": torch.tensor(ms.index)}
    if objective is not None:
        item["objective"] = objective
    if pack.outside and (objective is None or objective.sequence_level):
        item["outside"] = _outside_chunks(pack, multiple)
    if objective is not None and objective.kl_coef > 0:  # the stream runs it through the reference first
        item["reference_pass"] = True
    return item


def as_item(obj: Any, objective: ObjectiveConfig | None = None, multiple: int = 1) -> Any:
    """Claimed queue entries as schedule items: micro-steps converted, anything else as is."""
    if obj is not None and hasattr(obj, "packs") and hasattr(obj, "index"):
        return microstep_to_item(obj, objective=objective, multiple=multiple)
    return obj
