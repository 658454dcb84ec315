"""Trajectory selection: which leaves of an execution's trajectory tree are trained on.

Admission starts from the provenance mask -- only tokens our engines sampled
(:attr:`Provenance.SAMPLED`) are trainable -- and draws trajectories one at a time, until no
unmasked trainable token remains or ``j_max`` are admitted:

1. take the highest-priority :class:`RoleClass` that still has a leaf whose root-to-leaf path
   holds an unmasked trainable token;
2. draw one leaf of that class with probability proportional to its path's count of unmasked
   trainable tokens;
3. fix the drawn trajectory's targets to the path's nodes that are still unmasked, then mask the
   whole path, so a shared prefix is never a target twice and targets fixed earlier stay as they
   are; the lowered counts reweight the remaining leaves for the next draw.

A tree node is one model call's segment and a whole path is masked at once, so the mask is kept
per node: a node is either unmasked (all its sampled tokens still trainable) or masked. Targets
are therefore node ids, exactly what :class:`SelectedTrajectory` and
:meth:`TrajectoryRow.from_tree` expect.

Cost: counting is O(nodes + Σ_leaves depth) once; each draw scans the leaves of one class, and
masking a node updates only the leaves below it (each node is masked at most once), so the whole
selection is O(Σ_leaves depth + j_max · leaves).
"""

from __future__ import annotations

import random
from typing import Mapping

from gyre_core.interfaces import RoleClass
from gyre_core.trajectory import Provenance, SelectedTrajectory, TrajectoryTree

__all__ = ["select_trajectories", "trainable_counts"]


def trainable_counts(tree: TrajectoryTree) -> dict[int, int]:
    """Number of trainable (``SAMPLED``) tokens per node id -- the provenance mask, counted."""
    return {n.node_id: int((n.provenance == Provenance.SAMPLED).sum()) for n in tree}


def _validated_roles(tree: TrajectoryTree, roles: Mapping[int, RoleClass], leaves: list[int]) -> dict[int, RoleClass]:
    where = f"execution {tree.execution_id}"
    leaf_set = set(leaves)
    missing = sorted(leaf_set - set(roles))
    if missing:
        raise ValueError(f"{where}: no role class for leaves {missing} (every leaf must be classified)")
    extra = sorted(set(roles) - leaf_set)
    if extra:
        raise ValueError(f"{where}: role classes given for {extra}, which are not leaves of the tree")
    out: dict[int, RoleClass] = {}
    for leaf in leaves:
        value = roles[leaf]
        try:
            out[leaf] = RoleClass(value)
        except ValueError:
            raise ValueError(f"{where}: leaf {leaf} has an unknown role class {value!r}") from None
    return out


def select_trajectories(
    tree: TrajectoryTree,
    roles: Mapping[int, RoleClass],
    j_max: int,
    seed: int | random.Random,
) -> list[SelectedTrajectory]:
    """Admit at most ``j_max`` trajectories of ``tree``, in draw order.

    ``roles`` maps every leaf id of ``tree`` to its :class:`RoleClass` (from the
    ``gyre_classify_role`` hook); a leaf missing from it, a key that is not a leaf, or a value that
    is not a role class is an error. ``seed`` is an integer seed (or a ``random.Random`` to draw
    from); the result depends only on the tree, the roles, ``j_max`` and the seed -- leaves are
    considered in increasing id order, not in mapping or insertion order.

    Each result's ``targets`` are the ids of the path's nodes that were unmasked at its draw and
    hold at least one sampled token (nodes without one contribute no target either way). Leaves
    whose path never had a trainable token are never drawn, so an execution without one yields
    ``[]``.
    """
    if isinstance(j_max, bool) or not isinstance(j_max, int):
        raise TypeError(f"j_max must be an int, got {type(j_max).__name__}")
    if j_max < 1:
        raise ValueError(f"j_max must be ≥ 1, got {j_max}")
    if isinstance(seed, random.Random):
        rng = seed
    elif isinstance(seed, int) and not isinstance(seed, bool):
        rng = random.Random(seed)
    else:
        raise TypeError(f"seed must be an int or a random.Random, got {type(seed).__name__}")

    leaves = sorted(tree.leaves())
    role_of = _validated_roles(tree, roles, leaves)
    count = trainable_counts(tree)

    # Unmasked trainable tokens on each leaf's path, and the leaves below each node.
    path_sum: dict[int, int] = {}
    leaves_below: dict[int, list[int]] = {}
    paths: dict[int, list[int]] = {}
    for leaf in leaves:
        path = [n.node_id for n in tree.path(leaf)]
        paths[leaf] = path
        path_sum[leaf] = sum(count[nid] for nid in path)
        for nid in path:
            leaves_below.setdefault(nid, []).append(leaf)

    by_class: dict[RoleClass, list[int]] = {}
    for leaf in leaves:
        by_class.setdefault(role_of[leaf], []).append(leaf)
    classes = sorted(by_class)

    masked: set[int] = set()
    selected: list[SelectedTrajectory] = []
    while len(selected) < j_max:
        for cls in classes:
            candidates = [(leaf, path_sum[leaf]) for leaf in by_class[cls] if path_sum[leaf] > 0]
            if candidates:
                break
        else:
            break  # no unmasked trainable token left anywhere in the tree
        # Exact integer draw: P(leaf) = path_sum[leaf] / total.
        pick = rng.randrange(sum(w for _, w in candidates))
        for leaf, w in candidates:
            if pick < w:
                break
            pick -= w
        targets = frozenset(nid for nid in paths[leaf] if nid not in masked and count[nid] > 0)
        for nid in paths[leaf]:
            if nid in masked:
                continue
            masked.add(nid)
            if count[nid]:
                for below in leaves_below[nid]:
                    path_sum[below] -= count[nid]
        selected.append(SelectedTrajectory(leaf, cls, targets))
    return selected
