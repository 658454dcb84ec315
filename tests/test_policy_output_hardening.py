"""What a policy under RL emits never becomes a server error, and what it sampled is kept.

Tool-call arguments holding ``NaN``/``Infinity`` or an escaped lone surrogate are not JSON an API
answer can carry: the block stays visible text (the harness sees what the model wrote). A NaN or
-inf log-prob from the engine is kept in the record as returned, answered as ``null`` in JSON,
and the token is context, not a training target, counted.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from gyre_core.proxy.parse import parse_output
from gyre_core.proxy.records import json_logprobs
from gyre_core.interfaces import RoleClass
from gyre_core.trajectory import Provenance, SelectedTrajectory, TrajectoryRow, TrajectoryTree, TreeNode


@pytest.mark.parametrize("args", ['{"x": NaN}', '{"x": Infinity}', '{"x": -Infinity}', '{"x": "\\ud800"}',
                                  '{"\\udfff": 1}', '{"x": ["ok", "\\udc00"]}'])
def test_tool_calls_no_answer_can_carry_stay_text(args: str) -> None:
    text = f'<tool_call>{{"name": "Bash", "arguments": {args}}}</tool_call>'
    out = parse_output(text)
    assert out.tool_calls == () and out.content == text
    # what the faces send back encodes: strict JSON, UTF-8
    json.dumps({"content": out.content}, allow_nan=False).encode("utf-8")


def test_a_valid_tool_call_is_still_a_tool_call() -> None:
    out = parse_output('<tool_call>{"name": "Bash", "arguments": {"command": "ls", "n": 1.5}}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("Bash", {"command": "ls", "n": 1.5})]


def test_nonfinite_logprobs_are_recorded_answered_as_null_and_never_targets() -> None:
    lp = [-0.5, float("nan"), float("-inf"), -1.0]
    assert json_logprobs(lp) == [-0.5, None, None, -1.0]
    json.dumps(json_logprobs(lp), allow_nan=False)
    prompt = TreeNode(0, None, [1, 2, 3], [int(Provenance.EXTERNAL)] * 3, [0.0] * 3, {})
    answer = TreeNode(1, 0, [4, 5, 6, 7], [int(Provenance.SAMPLED)] * 4, lp, {})
    assert math.isnan(float(answer.logprobs[1])) and float(answer.logprobs[2]) == -math.inf  # kept as sampled
    with pytest.raises(ValueError):  # only sampled tokens may carry one
        TreeNode(2, 1, [8], [int(Provenance.EXTERNAL)], [float("nan")], {})
    tree = TrajectoryTree(9, [prompt, answer])
    row = TrajectoryRow.from_tree(tree, SelectedTrajectory(1, RoleClass.MAIN_AGENT_TASK, frozenset({0, 1})), 0)
    assert row.loss_mask.tolist() == [False, False, False, True, False, False, True]
    assert row.masked_nonfinite == 2 and bool(torch.isfinite(row.behaviour_logprobs).all())
