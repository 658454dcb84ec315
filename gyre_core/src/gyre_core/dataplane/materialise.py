"""Materialisation: a ready group's selected trajectories as weighted token rows.

Each selected path is read from the execution's stored tree (:meth:`TrajectoryRow.from_tree`), and
every row gets the per-token loss weights of the execution-level objective
(:mod:`gyre_core.dataplane.objective`): ``W_t = 1 / (E · |U_e|)`` on the first occurrence of each
unique trainable token of execution ``e`` and 0 elsewhere. A token is identified by its response
(``response_ids``, the tree node it was sampled in) and its ordinal inside that response, so the
same response reached through two selected paths is weighted once -- in the earlier-selected
(higher-priority) trajectory.

Rows left with no weighted token (a placeholder's, or a path whose targets all repeat an earlier
row) carry no gradient and are not emitted: they would only take packing budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyre_core.dataplane.trajectory_buffer import ReadyGroup
from gyre_core.trajectory import TrajectoryRow

__all__ = ["TrainingRow", "execution_weights", "materialise_group"]

_ORDINAL_BITS = 32


@dataclass(frozen=True, eq=False)
class TrainingRow:
    """A row with what the objective needs: its execution's slot and advantage, and ``W_t``."""

    row: TrajectoryRow
    exec_slot: int
    advantage: float
    loss_weights: torch.Tensor

    def __len__(self) -> int:
        return len(self.row)


def _token_keys(row: TrajectoryRow) -> torch.Tensor:
    """``response_id · 2³² + ordinal within that response`` per token (meaningful where sampled)."""
    rid = row.response_ids
    if bool((rid >= 2**31).any()):
        raise ValueError(f"execution {row.execution_id}: response ids must be < 2**31")
    keys = torch.full_like(rid, -1)
    pos = torch.nonzero(rid >= 0).squeeze(1)
    if len(pos):
        r = rid[pos]
        order = torch.sort(r, stable=True).indices
        sorted_r = r[order]
        run_start = torch.ones(len(r), dtype=torch.bool)
        run_start[1:] = sorted_r[1:] != sorted_r[:-1]
        starts = torch.nonzero(run_start).squeeze(1)
        ordinal_sorted = torch.arange(len(r)) - starts[torch.cumsum(run_start, 0) - 1]
        ordinal = torch.empty_like(ordinal_sorted)
        ordinal[order] = ordinal_sorted
        keys[pos] = (r << _ORDINAL_BITS) + ordinal
    return keys


def execution_weights(rows: list[TrajectoryRow], n_executions: int) -> list[torch.Tensor]:
    """Float64 ``W_t`` per row of one execution (rows in selection order).

    The first occurrence of each unique trainable token gets ``1 / (n_executions · |U_e|)``,
    everything else 0, so the execution's weights sum to ``1 / n_executions`` whenever it has a
    trainable token at all.
    """
    keys = [_token_keys(r)[r.loss_mask] for r in rows]
    flat = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64)
    unique, inverse = torch.unique(flat, return_inverse=True)
    first = torch.full((len(unique),), len(flat), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(len(flat)), reduce="amin")
    is_first = first[inverse] == torch.arange(len(flat))
    w = 1.0 / (n_executions * max(len(unique), 1))
    out, at = [], 0
    for r, k in zip(rows, keys):
        weights = torch.zeros(len(r), dtype=torch.float64)
        weights[r.loss_mask] = is_first[at : at + len(k)].to(torch.float64) * w
        out.append(weights)
        at += len(k)
    return out


def materialise_group(group: ReadyGroup, slot_base: int, n_executions: int) -> list[TrainingRow]:
    """The group's weighted rows; its executions take slots ``slot_base .. slot_base + N − 1``."""
    out: list[TrainingRow] = []
    for i, (scored, advantage) in enumerate(zip(group.executions, group.advantages)):
        if scored.tree is None:
            continue  # placeholder: reward counted in the advantages, nothing to train
        rows = [TrajectoryRow.from_tree(scored.tree, s, group.group_id) for s in scored.selected]
        for row, weights in zip(rows, execution_weights(rows, n_executions)):
            if bool((weights > 0).any()):
                out.append(TrainingRow(row, slot_base + i, advantage, weights.to(torch.float32)))
    return out
