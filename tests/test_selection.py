"""Trajectory selection (docs/design.md: "The data plane", selection; rule 7): priority classes, proportional draws,
path masking, J_max, determinism, and the hand-off to materialisation.

Invariants are checked against an independent *replay*: the mask state before each draw is
recomputed from scratch (the union of the earlier drawn paths), not read from the implementation's
incremental bookkeeping.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_core.dataplane.materialise import materialise_group
from gyre_core.dataplane.trajectory_buffer import ReadyGroup, ScoredExecution
from gyre_core.interfaces import RoleClass
from gyre_core.selection import select_trajectories, trainable_counts
from gyre_core.trajectory import Provenance, SelectedTrajectory, TrajectoryRow, TrajectoryTree, TreeNode

E, S, V = Provenance.EXTERNAL, Provenance.SAMPLED, Provenance.EVALUATOR
MAIN, MAIN_SUM, SUB, SUB_SUM = (
    RoleClass.MAIN_AGENT_TASK, RoleClass.MAIN_AGENT_SUMMARY, RoleClass.SUB_AGENT_TASK, RoleClass.SUB_AGENT_SUMMARY,
)


def node(nid: int, parent: int | None, prov: list[Provenance], base: int = 10) -> TreeNode:
    n = len(prov)
    return TreeNode(
        nid, parent, torch.arange(base, base + n), torch.tensor([int(p) for p in prov]),
        torch.tensor([-0.5 if p is S else 0.0 for p in prov]),
    )


def ctx_then_sampled(nid: int, parent: int | None, n_sampled: int, n_ctx: int = 1) -> TreeNode:
    """A node: ``n_ctx`` context tokens (so a root never starts with a target), then ``n_sampled``."""
    return node(nid, parent, [E] * n_ctx + [S] * n_sampled, base=100 * nid)


# --------------------------------------------------------------------------------------------------
# Independent reference checks
# --------------------------------------------------------------------------------------------------

def replay_and_check(tree: TrajectoryTree, roles: dict[int, RoleClass], j_max: int,
                     selected: list[SelectedTrajectory]) -> None:
    """Every invariant of one selection, with the mask recomputed from scratch before each draw."""
    count = {n.node_id: int((n.provenance == S).sum()) for n in tree}
    path_ids = {leaf: [n.node_id for n in tree.path(leaf)] for leaf in tree.leaves()}

    def unmasked(leaf: int, masked: set[int]) -> int:
        return sum(count[n] for n in path_ids[leaf] if n not in masked)

    assert 1 <= j_max and len(selected) <= j_max
    masked: set[int] = set()
    targeted: set[int] = set()
    for s in selected:
        assert s.leaf_id in path_ids, "a selected node is not a leaf"
        assert s.role == roles[s.leaf_id]
        # the drawn leaf had something to train, and no higher class had anything left
        assert unmasked(s.leaf_id, masked) > 0
        for leaf, path in path_ids.items():
            if roles[leaf] < s.role:
                assert unmasked(leaf, masked) == 0, (
                    f"drew a {s.role.name} leaf while {roles[leaf].name} leaf {leaf} still had targets"
                )
        # targets: exactly the still-unmasked nodes on the path that hold sampled tokens
        path = path_ids[s.leaf_id]
        assert s.targets <= set(path)
        assert all(count[n] > 0 for n in s.targets), "a target node holds no sampled token"
        assert s.targets == {n for n in path if n not in masked and count[n] > 0}
        # never a target twice
        assert not (s.targets & targeted)
        targeted |= s.targets
        masked |= set(path)
    # stopping: either J_max reached, or nothing trainable is left unmasked anywhere
    if len(selected) < j_max:
        assert all(unmasked(leaf, masked) == 0 for leaf in path_ids)
        assert targeted == {n for n, c in count.items() if c > 0}


def chi2_sf(x: float, df: int) -> float:
    """P(χ²_df ≥ x), exact, for integer df (scipy is not in the venv).

    Q(x; 1) = erfc(√(x/2)), Q(x; 2) = e^(−x/2), Q(x; k+2) = Q(x; k) + (x/2)^(k/2) e^(−x/2) / Γ(k/2 + 1).
    """
    if x <= 0:
        return 1.0
    k, q = (1, math.erfc(math.sqrt(x / 2))) if df % 2 else (2, math.exp(-x / 2))
    while k < df:
        q += math.exp((k / 2) * math.log(x / 2) - x / 2 - math.lgamma(k / 2 + 1))
        k += 2
    return min(q, 1.0)


def chi2_stat(observed: Counter, expected_p: dict) -> float:
    n = sum(observed.values())
    assert set(observed) <= set(expected_p)
    return sum((observed.get(k, 0) - n * p) ** 2 / (n * p) for k, p in expected_p.items())


P_THRESHOLD = 1e-4
"""Goodness-of-fit tests pass when p > 1e-4 (a false failure about once in 10,000 seeds-sets; the
seeds are fixed, so the outcome is deterministic)."""


def test_chi2_sf_matches_textbook_critical_values() -> None:
    # so that a wrong survival function cannot make the statistical tests pass vacuously
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, rel=1e-4)
    assert chi2_sf(5.991465, 2) == pytest.approx(0.05, rel=1e-4)
    assert chi2_sf(7.814728, 3) == pytest.approx(0.05, rel=1e-4)
    assert chi2_sf(21.107690, 3) == pytest.approx(1e-4, rel=1e-3)
    assert chi2_sf(11.070498, 5) == pytest.approx(0.05, rel=1e-4)


# --------------------------------------------------------------------------------------------------
# Worked examples
# --------------------------------------------------------------------------------------------------

def shared_prefix_tree() -> tuple[TrajectoryTree, dict[int, RoleClass]]:
    """0 (prompt + 3 sampled) -> 1 (main task, 2) / 2 (main summary, 4 + critique);
    3: separate root of a sub-agent (5), 4 under 3 (sub summary, 1)."""
    tree = TrajectoryTree(11, [
        ctx_then_sampled(0, None, 3, n_ctx=2),
        ctx_then_sampled(1, 0, 2),
        node(2, 0, [V, V, S, S, S, S], base=200),
        ctx_then_sampled(3, None, 5),
        ctx_then_sampled(4, 3, 1),
        ctx_then_sampled(5, 3, 2),
    ])
    return tree, {1: MAIN, 2: MAIN_SUM, 4: SUB_SUM, 5: SUB}


def test_worked_example_draws_by_class_and_masks_shared_prefix() -> None:
    tree, roles = shared_prefix_tree()
    for seed in range(20):
        sel = select_trajectories(tree, roles, j_max=10, seed=seed)
        # one leaf per class here, so the order is fully determined by the classes
        assert [(s.leaf_id, s.role) for s in sel] == [(1, MAIN), (2, MAIN_SUM), (5, SUB), (4, SUB_SUM)]
        assert [s.targets for s in sel] == [
            frozenset({0, 1}),   # the shared prefix goes with the first (highest-class) draw
            frozenset({2}),      # ... and is context only for the summary
            frozenset({3, 5}),
            frozenset({4}),
        ]
        replay_and_check(tree, roles, 10, sel)


def test_at_most_j_max_and_highest_class_first() -> None:
    tree, roles = shared_prefix_tree()
    sel = select_trajectories(tree, roles, j_max=2, seed=0)
    assert [s.leaf_id for s in sel] == [1, 2]  # the two main-agent classes; sub-agents left out
    assert [s.leaf_id for s in select_trajectories(tree, roles, j_max=1, seed=0)] == [1]


def test_stops_when_no_trainable_token_remains() -> None:
    # three leaves under one root, but only the root and leaf 1 hold sampled tokens
    tree = TrajectoryTree(2, [
        ctx_then_sampled(0, None, 2),
        ctx_then_sampled(1, 0, 1),
        node(2, 0, [E, E], base=300),   # tool result only
        node(3, 0, [V], base=400),      # critique only
    ])
    roles = {1: SUB, 2: MAIN, 3: MAIN}
    sel = select_trajectories(tree, roles, j_max=8, seed=3)
    # MAIN leaves 2 and 3 are drawn first (their path holds the root's 2 sampled tokens) -- but only
    # one of them: after it the root is masked and the other has nothing left, so it is skipped.
    assert len(sel) == 2
    assert sel[0].leaf_id in (2, 3) and sel[0].targets == frozenset({0})
    assert (sel[1].leaf_id, sel[1].targets) == (1, frozenset({1}))
    replay_and_check(tree, roles, 8, sel)


def test_an_execution_without_sampled_tokens_selects_nothing() -> None:
    tree = TrajectoryTree(4, [node(0, None, [E, E]), node(1, 0, [V, E], base=20)])
    assert select_trajectories(tree, {1: MAIN}, j_max=4, seed=0) == []
    assert select_trajectories(TrajectoryTree(5), {}, j_max=4, seed=0) == []


def test_trainable_counts_follow_the_provenance_mask() -> None:
    tree, _ = shared_prefix_tree()
    assert trainable_counts(tree) == {0: 3, 1: 2, 2: 4, 3: 5, 4: 1, 5: 2}


# --------------------------------------------------------------------------------------------------
# Distribution of draws
# --------------------------------------------------------------------------------------------------

def test_first_draw_is_proportional_to_unmasked_trainable_tokens() -> None:
    """4 MAIN leaves with path counts 1+3=4, 1+9=10, 20, 0+6=6 (shared root of 1 sampled token,
    a separate root for the third leaf, a critique-only root for the fourth) and a SUB leaf
    that must never be picked first. 20,000 seeded first picks; χ² goodness of fit, df = 3."""
    tree = TrajectoryTree(9, [
        ctx_then_sampled(0, None, 1),
        ctx_then_sampled(1, 0, 3),
        ctx_then_sampled(2, 0, 9),
        ctx_then_sampled(3, None, 20),
        node(4, None, [V, V], base=400),
        ctx_then_sampled(5, 4, 6),
        ctx_then_sampled(6, None, 50),
    ])
    roles = {1: MAIN, 2: MAIN, 3: MAIN, 5: MAIN, 6: SUB}
    weights = {1: 4, 2: 10, 3: 20, 5: 6}
    total = sum(weights.values())
    expected = {leaf: w / total for leaf, w in weights.items()}
    n = 20_000
    observed = Counter(select_trajectories(tree, roles, j_max=1, seed=s)[0].leaf_id for s in range(n))
    assert set(observed) == set(weights)  # the SUB leaf never comes first
    p = chi2_sf(chi2_stat(observed, expected), df=3)
    assert p > P_THRESHOLD, (observed, expected, p)
    # power: the same sample clearly rejects a uniform draw (so the test can fail)
    assert chi2_sf(chi2_stat(observed, {leaf: 0.25 for leaf in weights}), df=3) < P_THRESHOLD


def test_later_draws_use_the_lowered_counts() -> None:
    """A MAIN leaf shares a 10-token root with SUB leaf 2; SUB leaf 3 is on its own root (6).
    After the forced first draw the root is masked, so leaf 2 weighs 2 (not 12) against 6:
    P(2) = 1/4, not 2/3."""
    tree = TrajectoryTree(8, [
        ctx_then_sampled(0, None, 10),
        ctx_then_sampled(1, 0, 1),
        ctx_then_sampled(2, 0, 2),
        ctx_then_sampled(3, None, 6),
    ])
    roles = {1: MAIN, 2: SUB, 3: SUB}
    n = 4_000
    second = []
    for s in range(n):
        sel = select_trajectories(tree, roles, j_max=2, seed=s)
        assert sel[0].leaf_id == 1
        second.append(sel[1].leaf_id)
    observed = Counter(second)
    assert chi2_sf(chi2_stat(observed, {2: 0.25, 3: 0.75}), df=1) > P_THRESHOLD, observed
    assert chi2_sf(chi2_stat(observed, {2: 12 / 18, 3: 6 / 18}), df=1) < P_THRESHOLD


# --------------------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------------------

def wide_tree() -> tuple[TrajectoryTree, dict[int, RoleClass]]:
    tree = TrajectoryTree(3, [ctx_then_sampled(0, None, 2)])
    roles = {}
    for nid in range(1, 13):
        tree.add(ctx_then_sampled(nid, 0, nid))
        roles[nid] = MAIN if nid % 3 else SUB
    return tree, roles


def test_same_seed_same_selection_and_different_seeds_can_differ() -> None:
    tree, roles = wide_tree()
    runs = {s: select_trajectories(tree, roles, j_max=5, seed=s) for s in range(30)}
    for s, sel in runs.items():
        assert select_trajectories(tree, roles, j_max=5, seed=s) == sel
        assert select_trajectories(tree, roles, j_max=5, seed=random.Random(s)) == sel
    assert len({tuple(s.leaf_id for s in sel) for sel in runs.values()}) > 1


def test_result_does_not_depend_on_the_role_mapping_order() -> None:
    tree, roles = wide_tree()
    reversed_roles = dict(reversed(list(roles.items())))
    for s in range(10):
        assert select_trajectories(tree, roles, 5, s) == select_trajectories(tree, reversed_roles, 5, s)


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("j_max", [0, -1])
def test_j_max_below_one_is_rejected(j_max: int) -> None:
    tree, roles = shared_prefix_tree()
    with pytest.raises(ValueError, match="j_max must be ≥ 1"):
        select_trajectories(tree, roles, j_max=j_max, seed=0)


@pytest.mark.parametrize("j_max", [2.0, True, "3"])
def test_j_max_of_the_wrong_type_is_rejected(j_max) -> None:
    tree, roles = shared_prefix_tree()
    with pytest.raises(TypeError, match="j_max"):
        select_trajectories(tree, roles, j_max=j_max, seed=0)


def test_bad_seed_is_rejected() -> None:
    tree, roles = shared_prefix_tree()
    with pytest.raises(TypeError, match="seed"):
        select_trajectories(tree, roles, j_max=1, seed=1.5)


def test_a_leaf_without_role_is_rejected() -> None:
    tree, roles = shared_prefix_tree()
    del roles[4]
    with pytest.raises(ValueError, match=r"no role class for leaves \[4\]"):
        select_trajectories(tree, roles, j_max=3, seed=0)


def test_roles_for_non_leaves_or_unknown_nodes_are_rejected() -> None:
    tree, roles = shared_prefix_tree()
    with pytest.raises(ValueError, match=r"\[0\], which are not leaves"):
        select_trajectories(tree, {**roles, 0: MAIN}, j_max=3, seed=0)
    with pytest.raises(ValueError, match=r"\[99\], which are not leaves"):
        select_trajectories(tree, {**roles, 99: MAIN}, j_max=3, seed=0)


def test_an_unknown_role_value_is_rejected() -> None:
    tree, roles = shared_prefix_tree()
    with pytest.raises(ValueError, match="leaf 4 has an unknown role class 7"):
        select_trajectories(tree, {**roles, 4: 7}, j_max=3, seed=0)


# --------------------------------------------------------------------------------------------------
# Hand-off to the data plane
# --------------------------------------------------------------------------------------------------

def sampled_token_keys(tree: TrajectoryTree, node_ids) -> set[tuple[int, int]]:
    """(node id, ordinal among that node's sampled tokens) for every sampled token of the nodes."""
    out = set()
    for nid in node_ids:
        out |= {(nid, k) for k in range(int((tree.node(nid).provenance == S).sum()))}
    return out


def test_selection_materialises_through_the_data_plane() -> None:
    tree, roles = shared_prefix_tree()
    sel = select_trajectories(tree, roles, j_max=10, seed=1)
    other = TrajectoryTree(12, [ctx_then_sampled(0, None, 4)])
    other_sel = select_trajectories(other, {0: MAIN}, j_max=10, seed=1)
    group = ReadyGroup(
        group_id=6, version=2,
        executions=(
            ScoredExecution(11, 6, 1.0, tree, tuple(sel)),
            ScoredExecution(12, 6, 0.0, other, tuple(other_sel)),
        ),
        advantages=(1.0, -1.0),
    )
    rows = materialise_group(group, slot_base=0, n_executions=2)
    # every selected trajectory carries targets nobody else has, so none is dropped as empty
    assert len(rows) == len(sel) + len(other_sel)
    mine = [r for r in rows if r.exec_slot == 0]
    assert [r.row.role for r in mine] == [s.role for s in sel]
    # each execution weighs 1/E, and every weighted token is a target of exactly one row
    assert sum(float(r.loss_weights.sum()) for r in mine) == pytest.approx(0.5)
    assert all(torch.equal(r.loss_weights > 0, r.row.loss_mask) for r in rows)
    assert sum(r.row.n_targets for r in mine) == sum(trainable_counts(tree).values())


@settings(max_examples=150, deadline=None)
@given(
    spec=st.lists(
        st.tuples(
            st.integers(0, 1000),                                           # parent pick
            st.lists(st.sampled_from([E, S, V]), min_size=0, max_size=5),   # after one context token
            st.sampled_from(list(RoleClass)),                               # role if a leaf
        ),
        min_size=1, max_size=25,
    ),
    j_max=st.integers(1, 8),
    seed=st.integers(0, 2**32),
)
def test_selection_invariants_on_random_trees(spec: list, j_max: int, seed: int) -> None:
    tree = TrajectoryTree(1)
    for nid, (pick, prov, _) in enumerate(spec):
        parent = pick % (nid + 1) - 1   # -1: a new root (a request that matched no prefix)
        tree.add(node(nid, None if parent < 0 else parent, [E] + prov, base=10 * nid))
    roles = {leaf: spec[leaf][2] for leaf in tree.leaves()}

    sel = select_trajectories(tree, roles, j_max, seed)
    replay_and_check(tree, roles, j_max, sel)
    assert select_trajectories(tree, roles, j_max, seed) == sel

    # the data plane accepts it, and no sampled token is a loss target twice
    rows = [TrajectoryRow.from_tree(tree, s, 0) for s in sel]
    seen: set[tuple[int, int]] = set()
    for r, s in zip(rows, sel):
        keys = set()
        ordinal: Counter = Counter()
        for rid, is_target in zip(r.response_ids.tolist(), r.loss_mask.tolist()):
            if rid >= 0:
                if is_target:
                    keys.add((rid, ordinal[rid]))
                ordinal[rid] += 1
        assert keys == sampled_token_keys(tree, s.targets)  # targets ⊆ sampled tokens of the path
        assert not (keys & seen)
        seen |= keys
    if sel:
        group = ReadyGroup(0, 0, (ScoredExecution(1, 0, 1.0, tree, tuple(sel)),), (1.0,))
        assert len(materialise_group(group, 0, 1)) == len(sel)


# --------------------------------------------------------------------------------------------------
# Size
# --------------------------------------------------------------------------------------------------

def test_thousands_of_nodes_select_quickly() -> None:
    rng = random.Random(0)
    tree = TrajectoryTree(1)
    n = 4000
    for nid in range(n):
        parent = None if nid == 0 or rng.random() < 0.01 else rng.randrange(max(0, nid - 50), nid)
        prov = [E] + [S if rng.random() < 0.6 else E for _ in range(rng.randrange(1, 6))]
        tree.add(node(nid, parent, prov, base=nid))
    roles = {leaf: RoleClass(rng.randrange(4)) for leaf in tree.leaves()}
    assert len(roles) > 1000
    t0 = time.perf_counter()
    sel = select_trajectories(tree, roles, j_max=256, seed=0)
    elapsed = time.perf_counter() - t0
    assert len(sel) == 256
    assert elapsed < 5.0, elapsed  # generous for a shared 2-core box; typically well under 1 s
    targets = [t for s in sel for t in s.targets]
    assert len(targets) == len(set(targets))
    assert [s.role for s in sel] == sorted(s.role for s in sel)  # classes come out in priority order
