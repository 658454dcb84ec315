"""Shared trajectory types: validation at construction and materialisation from stored trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_core.interfaces import RoleClass
from gyre_core.trajectory import (
    NO_RESPONSE,
    Provenance,
    SelectedTrajectory,
    TrajectoryRow,
    TrajectoryTree,
    TreeNode,
)


E, S, V = Provenance.EXTERNAL, Provenance.SAMPLED, Provenance.EVALUATOR


def node(nid: int, parent: int | None, prov: list[Provenance], base: int = 10) -> TreeNode:
    n = len(prov)
    return TreeNode(
        nid, parent, torch.arange(base, base + n), torch.tensor([int(p) for p in prov]),
        torch.tensor([-0.5 if p is S else 0.0 for p in prov]),
    )


def row(n: int = 4, **override) -> TrajectoryRow:
    fields = dict(
        execution_id=1, group_id=0, role=RoleClass.MAIN_AGENT_TASK,
        token_ids=torch.arange(n), loss_mask=torch.tensor([False] + [True] * (n - 1)),
        behaviour_logprobs=torch.full((n,), -1.0), response_ids=torch.tensor([-1] + [3] * (n - 1)),
    )
    fields.update(override)
    return TrajectoryRow(**fields)


def test_materialised_path_concatenates_segments_and_masks_only_owned_sampled_tokens() -> None:
    # root: prompt + response; two branches: tool result + response, critique + response
    tree = TrajectoryTree(7, [
        node(0, None, [E, E, S, S]),
        node(1, 0, [E, S, S], base=20),
        node(2, 0, [V, V, S], base=30),
    ])
    assert sorted(tree.leaves()) == [1, 2]
    r = TrajectoryRow.from_tree(tree, SelectedTrajectory(2, RoleClass.MAIN_AGENT_SUMMARY, frozenset({0, 2})), 5)
    assert r.token_ids.tolist() == [10, 11, 12, 13, 30, 31, 32]
    assert r.loss_mask.tolist() == [False, False, True, True, False, False, True]  # critique masked
    assert r.response_ids.tolist() == [NO_RESPONSE, NO_RESPONSE, 0, 0, NO_RESPONSE, NO_RESPONSE, 2]
    assert (r.execution_id, r.group_id, r.role) == (7, 5, RoleClass.MAIN_AGENT_SUMMARY)
    # a node masked by an earlier draw: its sampled tokens stay in the context, not in the targets
    r2 = TrajectoryRow.from_tree(tree, SelectedTrajectory(1, RoleClass.MAIN_AGENT_TASK, frozenset({1})), 5)
    assert r2.loss_mask.tolist() == [False, False, False, False, False, True, True]
    assert r2.response_ids.tolist()[2:4] == [0, 0]
    assert r2.behaviour_logprobs.tolist() == [0, 0, -0.5, -0.5, 0, -0.5, -0.5]


def test_targets_off_the_path_are_refused() -> None:
    tree = TrajectoryTree(1, [node(0, None, [E, S]), node(1, 0, [E, S]), node(2, 0, [E, S])])
    with pytest.raises(ValueError, match="not on the path"):
        TrajectoryRow.from_tree(tree, SelectedTrajectory(1, RoleClass.MAIN_AGENT_TASK, frozenset({2})), 0)


@pytest.mark.parametrize("override, message", [
    (dict(loss_mask=torch.tensor([False, True, True])), "disagree in length"),
    (dict(behaviour_logprobs=torch.zeros(5)), "disagree in length"),
    (dict(response_ids=torch.tensor([-1, 3, 3])), "disagree in length"),
    (dict(loss_mask=torch.tensor([True, True, True, True])), "first token"),
    (dict(behaviour_logprobs=torch.tensor([0.0, -1.0, float("nan"), -1.0])), "finite"),
    (dict(behaviour_logprobs=torch.tensor([0.0, -1.0, 0.5, -1.0])), "> 0"),
    (dict(response_ids=torch.tensor([-1, 3, -1, 3])), "no response id"),
    (dict(token_ids=torch.tensor([0, 1, -2, 3])), "negative token"),
    (dict(token_ids=torch.tensor([0.0, 1.0, 2.0, 3.0])), "integers"),
    (dict(loss_mask=torch.tensor([0, 1, 1, 1])), "booleans"),
    (dict(token_ids=torch.zeros(0, dtype=torch.int64), loss_mask=torch.zeros(0, dtype=torch.bool),
          behaviour_logprobs=torch.zeros(0), response_ids=torch.zeros(0, dtype=torch.int64)), "empty"),
])
def test_malformed_rows_are_refused_with_a_clear_error(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        row(**override)


def test_malformed_nodes_and_trees_are_refused() -> None:
    with pytest.raises(ValueError, match="disagree in length"):
        TreeNode(0, None, torch.arange(3), torch.tensor([0, 1]), torch.zeros(3))
    with pytest.raises(ValueError, match="provenance"):
        TreeNode(0, None, torch.arange(2), torch.tensor([0, 7]), torch.zeros(2))
    with pytest.raises(ValueError, match="finite"):  # a token we did not sample has no log-prob to be off
        TreeNode(0, None, torch.arange(2), torch.tensor([0, 1]), torch.tensor([float("-inf"), -1.0]))
    # a sampled token keeps what the engine returned (it is then no target: TrajectoryRow.from_tree)
    TreeNode(0, None, torch.arange(2), torch.tensor([0, 1]), torch.tensor([0.0, float("-inf")]))
    tree = TrajectoryTree(1, [node(0, None, [E, S])])
    with pytest.raises(ValueError, match="unknown parent"):
        tree.add(node(5, 4, [E]))
    with pytest.raises(ValueError, match="twice"):
        tree.add(node(0, None, [E]))
    assert [n.node_id for n in tree] == [0]  # nothing half-added


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.lists(st.sampled_from([E, S, V]), min_size=1, max_size=6)),
                min_size=1, max_size=12))
def test_every_path_materialises_to_exactly_its_nodes_tokens(spec: list) -> None:
    tree = TrajectoryTree(3)
    for nid, (parent_pick, prov) in enumerate(spec):
        parent = None if nid == 0 else parent_pick % nid
        tree.add(node(nid, parent, [E] + prov, base=100 * nid))  # a node starts with context
    for leaf in tree.leaves():
        path = tree.path(leaf)
        r = TrajectoryRow.from_tree(tree, SelectedTrajectory(leaf, 0, frozenset(n.node_id for n in path)), 0)
        assert len(r) == sum(len(n) for n in path)
        sampled = torch.cat([n.provenance == S for n in path])
        assert torch.equal(r.loss_mask, sampled)  # exactly the sampled tokens, never critiques
        assert r.n_targets == int(sampled.sum())
