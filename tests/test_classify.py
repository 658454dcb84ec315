"""Role classification of trajectory leaves, on request bodies the real Claude Code CLI sent.

The bodies come from ``integration_tests/claude_code/fixtures`` (captured from Claude Code 2.1.197
by ``capture_cli_requests.py``): a main agent that spawns a sub-agent, and a ``/compact`` run.
Metadata is built the way the proxy core records it with each node (headers, ``agent_id``, the
tail of the last user turn), so these tests follow the same path as live classification.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import pytest

from gyre_core.hookspecs import hookimpl
from gyre_core.interfaces import RoleClass
from gyre_core.plugins import plugin_manager
from gyre_core.proxy.anthropic_api import to_chat_request
from gyre_core.proxy.classify import (
    DefaultRoleClassifier,
    classify_metadata,
    is_summary_request,
    register_default_classifier,
    request_role_metadata,
)
from gyre_core.proxy.types import ChatMessage, ChatRequest

FIXTURE = Path(__file__).resolve().parents[1] / "integration_tests/claude_code/fixtures/claude_code_2.1.197_requests.json"


def _captured() -> dict[str, list[dict[str, Any]]]:
    data = json.loads(FIXTURE.read_text())
    return {k: [e for e in v if "body" in e] for k, v in data.items() if isinstance(v, list)}


def _request(entry: Mapping[str, Any]) -> ChatRequest:
    return to_chat_request(entry["body"], execution_id="0", headers=entry["headers"])


def _recorded_metadata(req: ChatRequest) -> dict[str, Any]:
    """Node metadata as ``ProxyService.complete`` records it (the fields classification reads)."""
    last_user = next((m.content[-4000:] for m in reversed(req.messages) if m.role == "user"), "")
    return {
        "agent_id": req.headers.get("x-claude-code-agent-id"),
        "parent_agent_id": req.headers.get("x-claude-code-parent-agent-id"),
        "headers": dict(req.headers),
        "last_user_text": last_user,
    }


class Leaf:
    def __init__(self, metadata: Mapping[str, Any]) -> None:
        self.execution_id = 0
        self.metadata = metadata


def test_fixture_is_from_the_pinned_cli() -> None:
    assert json.loads(FIXTURE.read_text())["claude_code_version"] == "2.1.197"


def test_main_agent_and_sub_agent_calls() -> None:
    calls = _captured()["subagent"]
    roles = [classify_metadata(_recorded_metadata(_request(e))) for e in calls]
    # main agent calls Agent -> the sub-agent answers -> the main agent finishes
    assert roles == [RoleClass.MAIN_AGENT_TASK, RoleClass.SUB_AGENT_TASK, RoleClass.MAIN_AGENT_TASK]
    assert "x-claude-code-agent-id" in calls[1]["headers"]


def test_compaction_request_is_a_main_agent_summary() -> None:
    calls = _captured()["compact"]
    reqs = [_request(e) for e in calls]
    summary = [is_summary_request(r.messages) for r in reqs]
    assert summary.count(True) == 1, summary
    i = summary.index(True)
    # the instruction is appended to the user message that also carries the last tool result
    assert [m.role for m in reqs[i].messages[-2:]] == ["tool", "user"]
    roles = [classify_metadata(_recorded_metadata(r)) for r in reqs]
    assert roles[i] is RoleClass.MAIN_AGENT_SUMMARY
    assert all(r is RoleClass.MAIN_AGENT_TASK for j, r in enumerate(roles) if j != i)
    # after compaction the conversation restarts from the summary: task-driving again
    assert "continued from a previous conversation" in reqs[i + 1].messages[1].content
    # the explicit flag agrees with the text-based reading of the recorded tail
    assert request_role_metadata(reqs[i])["summary_request"] is True


def test_sub_agent_compaction_is_a_sub_agent_summary() -> None:
    entry = next(e for e in _captured()["compact"] if "CRITICAL" in json.dumps(e["body"]["messages"][-1]))
    headers = {**entry["headers"], "x-claude-code-agent-id": "a1", "x-claude-code-parent-agent-id": "a0"}
    req = to_chat_request(entry["body"], execution_id="0", headers=headers)
    assert classify_metadata(_recorded_metadata(req)) is RoleClass.SUB_AGENT_SUMMARY
    assert request_role_metadata(req) == {"summary_request": True, "agent_id": "a1", "parent_agent_id": "a0"}


def test_mentioning_a_summary_is_not_a_compaction() -> None:
    msgs = (ChatMessage("user", "Please write a <summary> of README.md into notes.txt."),)
    assert not is_summary_request(msgs)
    assert classify_metadata({"last_user_text": msgs[0].content}) is RoleClass.MAIN_AGENT_TASK


def test_an_answered_summary_request_further_back_does_not_count() -> None:
    entry = next(e for e in _captured()["compact"] if "CRITICAL" in json.dumps(e["body"]["messages"][-1]))
    req = _request(entry)
    later = req.messages + (ChatMessage("assistant", "<summary>x</summary>"), ChatMessage("user", "go on"))
    assert is_summary_request(req.messages) and not is_summary_request(later)


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({}, RoleClass.MAIN_AGENT_TASK),
        ({"headers": {"X-Claude-Code-Agent-Id": "a"}}, RoleClass.SUB_AGENT_TASK),
        ({"parent_agent_id": "p"}, RoleClass.SUB_AGENT_TASK),
        ({"summary_request": True}, RoleClass.MAIN_AGENT_SUMMARY),
        ({"summary_request": False, "last_user_text": "<summary> respond with text only"}, RoleClass.MAIN_AGENT_TASK),
        ({"role_class": "sub_agent_summary"}, RoleClass.SUB_AGENT_SUMMARY),
        ({"role_class": 1, "agent_id": "a"}, RoleClass.MAIN_AGENT_SUMMARY),
        ({"role_class": "nonsense", "agent_id": "a"}, RoleClass.SUB_AGENT_TASK),
    ],
)
def test_metadata_rules(metadata: dict[str, Any], expected: RoleClass) -> None:
    assert classify_metadata(metadata) is expected


def test_default_classifier_answers_through_the_hook_and_yields_to_harness_plugins() -> None:
    class OtherHarness:
        @hookimpl
        def gyre_classify_role(self, leaf: Leaf) -> RoleClass | None:
            return RoleClass.SUB_AGENT_SUMMARY if leaf.metadata.get("other") else None

    pm = plugin_manager(load_entrypoints=False)
    pm.register(OtherHarness())  # registered *before* the default: trylast still lets it answer first
    default = register_default_classifier(pm)
    assert register_default_classifier(pm) is default  # idempotent
    assert isinstance(default, DefaultRoleClassifier)
    pm.check_pending()
    assert pm.hook.gyre_classify_role(leaf=Leaf({"other": True})) is RoleClass.SUB_AGENT_SUMMARY
    assert pm.hook.gyre_classify_role(leaf=Leaf({"agent_id": "a"})) is RoleClass.SUB_AGENT_TASK
    assert pm.hook.gyre_classify_role(leaf=Leaf({})) is RoleClass.MAIN_AGENT_TASK
    from gyre_core.plugins import describe_plugins

    assert [d["seams"] for d in describe_plugins(pm)] == [["classification"]]
