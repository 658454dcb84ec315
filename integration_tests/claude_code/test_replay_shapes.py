"""Tree shapes of a sub-agent and of compaction, from request bodies the real Claude Code CLI sent.

A tiny random model cannot be driven into spawning a sub-agent or into compaction, so these tests
replay the requests the real CLI (2.1.197) made in those situations (``fixtures/``, captured by
``capture_cli_requests.py`` against a scripted endpoint) through the real proxy and SGLang. The
stub's tool-call ids in later requests are replaced by the ids the proxy minted; answers that
later requests build on are forced with an engine regex to what the CLI saw, the others are
sampled freely (and are the trainable tokens selection draws from).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import httpx
import pytest

from cc_proxy import MODEL, ServedProxy, captured_requests, tool_call_regex

pytestmark = [pytest.mark.claude_code, pytest.mark.sglang, pytest.mark.timeout(300)]

_KEEP_HEADERS = ("anthropic-version", "anthropic-beta", "x-claude-code-session-id", "x-claude-code-agent-id",
                 "x-claude-code-parent-agent-id", "user-agent", "x-app")


def _final_message(sse: str) -> dict[str, Any]:
    """Accumulate an SSE answer with the official SDK's own accumulator."""
    from anthropic._models import construct_type
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent

    snapshot = None
    bufs: dict[int, bytes] = {}
    for line in sse.splitlines():
        if not line.startswith("data: "):
            continue
        data = json.loads(line[6:])
        if data["type"] == "ping":
            continue
        assert data["type"] != "error", data
        event = construct_type(type_=RawMessageStreamEvent, value=data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot is not None
    return snapshot.to_dict()


def replay(proxy: ServedProxy, entries: list[Mapping[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """Send the captured requests of one scenario as one execution; returns its id and records."""
    service = proxy.service
    eid, key = service.create_execution()
    ids: dict[str, str] = {}
    forced: list[str | None] = []
    service.regex_for = lambda request: forced[-1]
    for entry in entries:
        if "body" not in entry:
            continue  # the marker of a new CLI invocation (same session, `--continue`)
        raw = json.dumps(entry["body"])
        for stub_id, our_id in ids.items():
            raw = raw.replace(json.dumps(stub_id), json.dumps(our_id))
        body = json.loads(raw)
        body["model"] = MODEL
        stub = entry["stub_answer"]["content"]
        uses = [b for b in stub if b["type"] == "tool_use"]
        if uses:  # later requests build on this answer: make the model say exactly it
            forced.append(tool_call_regex(uses[0]["name"], json.dumps(uses[0]["input"])))
        else:  # a leaf of its conversation: sample it, briefly
            forced.append(None)
            body["max_tokens"] = 12
        headers = {k: v for k, v in entry["headers"].items() if k in _KEEP_HEADERS}
        r = httpx.post(f"{proxy.url}/v1/messages?beta=true", json=body, timeout=120,
                       headers={**headers, "x-api-key": key})
        assert r.status_code == 200, r.text
        message = _final_message(r.text) if body.get("stream") else r.json()
        ours = [b for b in message["content"] if b["type"] == "tool_use"]
        assert len(ours) == len(uses)
        for stub_use, our_use in zip(uses, ours):
            assert our_use["input"] == stub_use["input"]
            ids[stub_use["id"]] = our_use["id"]
    records = [c.to_json() for c in service.records(eid).calls]
    return eid, records


def test_sub_agent_is_a_separate_root_path(served_proxy: ServedProxy) -> None:
    entries = captured_requests()["subagent"]
    eid, (main1, sub, main2) = replay(served_proxy, entries)
    service = served_proxy.service
    tree = service.records(eid).tree

    # The sub-agent's conversation shares no prefix with the main agent's: its own root path.
    assert sub["parent_id"] is None and sub["agent_id"]
    # The main agent continues its own path after the Agent tool's result.
    assert main1["parent_id"] is None and main2["parent_id"] == main1["node_id"]
    assert sorted(tree.leaves()) == sorted([sub["node_id"], main2["node_id"]])
    roles = {leaf: service.role_of(eid, leaf).name for leaf in tree.leaves()}
    assert roles == {sub["node_id"]: "SUB_AGENT_TASK", main2["node_id"]: "MAIN_AGENT_TASK"}
    # Selection draws by class: the main agent's trajectory first.
    picked = service.selected(eid, j_max=4, seed=0)
    assert [s.role.name for s in picked] == ["MAIN_AGENT_TASK", "SUB_AGENT_TASK"]


def test_compaction_branches_and_restarts(served_proxy: ServedProxy) -> None:
    entries = captured_requests()["compact"]
    eid, (call1, call2, summary, after) = replay(served_proxy, entries)
    service = served_proxy.service
    tree = service.records(eid).tree

    # The summary request re-sends the history up to the tool result with the instruction added
    # to that user turn: it branches off the path right after the tool call, beside the answer
    # the conversation had gone on with.
    assert call2["parent_id"] == call1["node_id"]
    assert summary["parent_id"] == call1["node_id"]
    # After compaction the CLI restarts from the summary (and its system header changes), so the
    # new conversation matches no stored prefix: a separate root path.
    assert after["parent_id"] is None and call1["parent_id"] is None
    assert sorted(tree.leaves()) == sorted([call2["node_id"], summary["node_id"], after["node_id"]])
    roles = {leaf: service.role_of(eid, leaf).name for leaf in tree.leaves()}
    assert roles == {call2["node_id"]: "MAIN_AGENT_TASK", summary["node_id"]: "MAIN_AGENT_SUMMARY",
                     after["node_id"]: "MAIN_AGENT_TASK"}
    picked = [s.role.name for s in service.selected(eid, j_max=4, seed=0)]
    assert picked == ["MAIN_AGENT_TASK", "MAIN_AGENT_TASK", "MAIN_AGENT_SUMMARY"]
