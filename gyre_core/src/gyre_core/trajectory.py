"""Trajectory types shared by the TITO proxy (which builds them) and the data plane (which trains on them).

An execution's model calls are stored once, as a *trajectory tree*: each node holds
the tokens one call added -- its incremental input followed by its recorded output -- with a
provenance per token and the behaviour log-probs of the tokens our engines sampled. A trajectory is
a root-to-leaf path; selection admits some of them (:class:`SelectedTrajectory`) and the data plane
*materialises* each admitted path into a flat :class:`TrajectoryRow` only when a training step
needs it, so a long shared prefix is stored once however many leaves hang below it.

Everything is validated on construction, so a malformed record fails where it enters instead of
as a shape error inside a training step.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch

from gyre_core.interfaces import RoleClass

__all__ = [
    "NO_RESPONSE",
    "Provenance",
    "SelectedTrajectory",
    "TrajectoryRow",
    "TrajectoryTree",
    "TreeNode",
]

NO_RESPONSE = -1
"""``response_ids`` value of a token that no engine of ours sampled (prompt, tool result, ...)."""


class Provenance(enum.IntEnum):
    """Where a token came from. Only ``SAMPLED`` tokens can ever be training targets.

    ``EVALUATOR`` marks evaluator critiques fed back into a later request: they are context like
    any external text, but keep their origin so that it stays auditable why they are not trained.
    """

    EXTERNAL = 0
    """Prompt, tool result, injected assistant content: supplied from outside."""
    SAMPLED = 1
    """Sampled by one of our rollout engines, with a recorded behaviour log-prob."""
    EVALUATOR = 2
    """An evaluator's critique placed into the context of a later request."""


def _as_1d(name: str, value: Any, dtype: torch.dtype) -> torch.Tensor:
    """``value`` as a 1-D tensor of ``dtype``; refuses lossy kinds (floats as ids, ints as a mask)."""
    t = torch.as_tensor(value)
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {tuple(t.shape)}")
    if t.numel():
        if dtype is torch.bool and t.dtype is not torch.bool:
            raise ValueError(f"{name}: expected booleans, got {t.dtype}")
        if not dtype.is_floating_point and dtype is not torch.bool and (
            t.dtype.is_floating_point or t.dtype is torch.bool
        ):
            raise ValueError(f"{name}: expected integers, got {t.dtype}")
    return t.to(dtype)


@dataclass(frozen=True, eq=False)
class TreeNode:
    """One model call's contribution to the tree: the tokens it added after its parent's.

    ``parent`` is ``None`` for a node attached to the (implicit) root: a request that matched no
    stored prefix. ``logprobs`` are the behaviour log-probs recorded for ``SAMPLED`` tokens and
    ``0.0`` elsewhere (kept finite everywhere so that a masked position can never leak a NaN into a
    loss through ``0 * nan``). ``temperature`` is the sampling temperature of the call: the
    behaviour log-probs are those of ``softmax(logits / temperature)``, and the trainer takes its
    own log-probs of the same tokens at the same temperature.
    """

    node_id: int
    parent: int | None
    token_ids: torch.Tensor
    provenance: torch.Tensor
    logprobs: torch.Tensor
    metadata: Mapping[str, Any] = field(default_factory=dict)
    temperature: float = 1.0

    def __post_init__(self) -> None:
        tok = _as_1d("token_ids", self.token_ids, torch.int64)
        prov = _as_1d("provenance", self.provenance, torch.int8)
        lp = _as_1d("logprobs", self.logprobs, torch.float32)
        where = f"node {self.node_id}"
        if not (len(tok) == len(prov) == len(lp)):
            raise ValueError(
                f"{where}: token_ids, provenance and logprobs disagree in length "
                f"({len(tok)}, {len(prov)}, {len(lp)})"
            )
        if len(tok) == 0:
            raise ValueError(f"{where}: a node must add at least one token")
        if bool((tok < 0).any()):
            raise ValueError(f"{where}: negative token id")
        if not bool(torch.isin(prov, torch.tensor([int(p) for p in Provenance], dtype=torch.int8)).all()):
            raise ValueError(f"{where}: unknown provenance value")
        # a sampled token keeps whatever log-prob the engine returned, NaN or -inf included (the
        # record is what happened; TrajectoryRow.from_tree leaves such a token out of the targets)
        if not bool(torch.isfinite(lp[prov != Provenance.SAMPLED]).all()):
            raise ValueError(f"{where}: log-probs must be finite (0.0 where not sampled)")
        if bool((lp[prov == Provenance.SAMPLED] > 0).any()):
            raise ValueError(f"{where}: a sampled token's log-prob is > 0")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"{where}: temperature must be finite and > 0, got {self.temperature}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "token_ids", tok)
        object.__setattr__(self, "provenance", prov)
        object.__setattr__(self, "logprobs", lp)

    def __len__(self) -> int:
        return len(self.token_ids)


class TrajectoryTree:
    """An execution's trajectory tree: nodes with incremental token segments, parents added first.

    Leaves (nodes without children) are the candidate trajectories. Nodes are append-only: the
    proxy adds one per recorded model call and never rewrites a stored segment.
    """

    def __init__(self, execution_id: int, nodes: Sequence[TreeNode] = ()) -> None:
        self.execution_id = execution_id
        self._nodes: dict[int, TreeNode] = {}
        self._children: dict[int, list[int]] = {}
        for node in nodes:
            self.add(node)

    def add(self, node: TreeNode) -> None:
        if node.node_id in self._nodes:
            raise ValueError(f"execution {self.execution_id}: node {node.node_id} added twice")
        if node.parent is not None and node.parent not in self._nodes:
            raise ValueError(
                f"execution {self.execution_id}: node {node.node_id} names unknown parent {node.parent}"
            )
        self._nodes[node.node_id] = node
        self._children[node.node_id] = []
        if node.parent is not None:
            self._children[node.parent].append(node.node_id)

    def __iter__(self) -> Iterator[TreeNode]:
        return iter(self._nodes.values())

    def node(self, node_id: int) -> TreeNode:
        return self._nodes[node_id]

    def leaves(self) -> list[int]:
        return [nid for nid, kids in self._children.items() if not kids]

    def path(self, leaf_id: int) -> list[TreeNode]:
        """Nodes from the root down to ``leaf_id`` (a trajectory's whole context)."""
        if leaf_id not in self._nodes:
            raise ValueError(f"execution {self.execution_id}: unknown node {leaf_id}")
        out: list[TreeNode] = []
        nid: int | None = leaf_id
        while nid is not None:
            node = self._nodes[nid]
            out.append(node)
            nid = node.parent
        out.reverse()
        return out


@dataclass(frozen=True)
class SelectedTrajectory:
    """A leaf admitted for training, with the nodes whose sampled tokens are its targets.

    Selection masks a drawn trajectory's whole path, so targets are fixed per node: ``targets``
    holds the ids of the path's nodes that were still unmasked when this leaf was drawn. Sampled
    tokens of the other path nodes are context for this trajectory.
    """

    leaf_id: int
    role: RoleClass
    targets: frozenset[int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", RoleClass(self.role))
        object.__setattr__(self, "targets", frozenset(self.targets))


@dataclass(frozen=True, eq=False)
class TrajectoryRow:
    """One materialised trajectory: a flat token row ready to be packed into a micro-step.

    Position ``i`` holds token ``i``; ``loss_mask[i]`` says token ``i`` is a training target
    (predicted from tokens ``< i``), ``behaviour_logprobs[i]`` is the log-prob the rollout engine
    sampled it with. ``response_ids[i]`` names the tree node whose recorded response token ``i``
    belongs to (``NO_RESPONSE`` for tokens not sampled by us): two rows of one execution that
    contain the same response carry the same id, which is how the objective counts a shared
    response once.
    """

    execution_id: int
    group_id: int
    role: RoleClass
    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    response_ids: torch.Tensor
    masked_nonfinite: int = 0
    """Sampled tokens left out of the targets because their recorded log-prob was not finite."""
    temperatures: torch.Tensor | None = None
    """Per token, the sampling temperature its log-prob was taken at (all 1.0 when omitted)."""

    def __post_init__(self) -> None:
        tok = _as_1d("token_ids", self.token_ids, torch.int64)
        temps = (torch.ones(len(tok), dtype=torch.float32) if self.temperatures is None
                 else _as_1d("temperatures", self.temperatures, torch.float32))
        mask = _as_1d("loss_mask", self.loss_mask, torch.bool)
        lp = _as_1d("behaviour_logprobs", self.behaviour_logprobs, torch.float32)
        rid = _as_1d("response_ids", self.response_ids, torch.int64)
        where = f"execution {self.execution_id} ({RoleClass(self.role).name})"
        if not (len(tok) == len(mask) == len(lp) == len(rid) == len(temps)):
            raise ValueError(
                f"{where}: token_ids, loss_mask, behaviour_logprobs, response_ids and temperatures "
                f"disagree in length ({len(tok)}, {len(mask)}, {len(lp)}, {len(rid)}, {len(temps)})"
            )
        if not bool((torch.isfinite(temps) & (temps > 0)).all()):
            raise ValueError(f"{where}: temperatures must be finite and > 0")
        if len(tok) == 0:
            raise ValueError(f"{where}: empty row")
        if bool((tok < 0).any()):
            raise ValueError(f"{where}: negative token id")
        if bool(mask[0]):
            raise ValueError(f"{where}: the first token cannot be a target (nothing predicts it)")
        if not bool(torch.isfinite(lp).all()):
            raise ValueError(f"{where}: behaviour log-probs must be finite (0.0 where not sampled)")
        if bool((lp[mask] > 0).any()):
            raise ValueError(f"{where}: a target's behaviour log-prob is > 0")
        if bool((rid[mask] < 0).any()):
            raise ValueError(f"{where}: a target token has no response id")
        if bool((rid < NO_RESPONSE).any()):
            raise ValueError(f"{where}: response ids must be ≥ 0 or NO_RESPONSE")
        object.__setattr__(self, "role", RoleClass(self.role))
        object.__setattr__(self, "token_ids", tok)
        object.__setattr__(self, "loss_mask", mask)
        object.__setattr__(self, "behaviour_logprobs", lp)
        object.__setattr__(self, "response_ids", rid)
        object.__setattr__(self, "temperatures", temps)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def n_targets(self) -> int:
        return int(self.loss_mask.sum())

    @classmethod
    def from_tree(cls, tree: TrajectoryTree, selected: SelectedTrajectory, group_id: int) -> TrajectoryRow:
        """Materialise ``selected`` from the tree's stored segments (no re-encoding)."""
        path = tree.path(selected.leaf_id)
        unknown = selected.targets - {n.node_id for n in path}
        if unknown:
            raise ValueError(
                f"execution {tree.execution_id}: targets {sorted(unknown)} are not on the path "
                f"to leaf {selected.leaf_id}"
            )
        lengths = torch.tensor([len(n) for n in path])
        sampled = torch.cat([n.provenance for n in path]) == Provenance.SAMPLED
        owned = torch.tensor([n.node_id in selected.targets for n in path])
        node_ids = torch.repeat_interleave(torch.tensor([n.node_id for n in path]), lengths)
        logprobs = torch.cat([n.logprobs for n in path])
        # A sampled token whose recorded log-prob is NaN or infinite (an engine's numerical
        # failure) has no behaviour probability to correct by: it stays in the row as context,
        # is not a target, and is counted. The record keeps what the engine returned.
        finite = torch.isfinite(logprobs)
        targets = sampled & torch.repeat_interleave(owned, lengths)
        return cls(
            execution_id=tree.execution_id,
            group_id=group_id,
            role=selected.role,
            token_ids=torch.cat([n.token_ids for n in path]),
            loss_mask=targets & finite,
            behaviour_logprobs=torch.where(finite, logprobs, torch.zeros_like(logprobs)),
            response_ids=torch.where(sampled, node_ids, NO_RESPONSE),
            masked_nonfinite=int((targets & ~finite).sum()),
            temperatures=torch.repeat_interleave(torch.tensor([n.temperature for n in path], dtype=torch.float32),
                                                 lengths),
        )
