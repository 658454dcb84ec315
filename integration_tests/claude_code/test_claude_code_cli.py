"""The real Claude Code CLI as the harness, through the real proxy, served by a real SGLang server.

The tiny random model is made to emit a Bash tool call with an engine-side regex; Claude Code
really runs it in the scratch directory, sends the history back with the tool input re-serialised
its own way (compact JSON, Bash key order, ``60000.0`` as ``60000``), and the proxy must restore
the sampled payload by call id so the recorded tree path holds the tokens the engine sampled.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from claude_cli import claude_env
from cc_proxy import MODEL, ServedProxy, text_regex, tool_call_regex

pytestmark = [pytest.mark.claude_code, pytest.mark.sglang, pytest.mark.timeout(300)]

# Not Bash's key order, a float Claude Code rewrites as an int, a non-ASCII character: three ways
# the re-sent input differs from what the model sampled.
SAMPLED_ARGS = '{"description": "Write the marker – file", "command": "echo gyre > marker.txt", "timeout": 60000.0}'


def _records(proxy: ServedProxy, eid: int) -> list[dict[str, Any]]:
    r = httpx.get(f"{proxy.url}/gyre/executions/{eid}/records?input_ids=1",
                  headers={"authorization": f"Bearer {proxy.admin_token}"})
    r.raise_for_status()
    return r.json()


def test_bash_tool_call_runs_and_round_trips(served_proxy: ServedProxy, claude_cli: Path, tmp_path: Path) -> None:
    service = served_proxy.service
    eid, key = service.create_execution()

    def regex_for(request: Any) -> str:
        # First the tool call; once its result is back, a short final answer.
        if any(m.role == "tool" for m in request.messages):
            return text_regex("Done.")
        return tool_call_regex("Bash", SAMPLED_ARGS)

    service.regex_for = regex_for
    work = tmp_path / "work"
    work.mkdir()
    env = claude_env(tmp_path, served_proxy.url, key, MODEL)
    proc = subprocess.run(
        [str(claude_cli), "-p", "Write gyre to marker.txt.", "--dangerously-skip-permissions",
         "--output-format", "json", "--tools", "Bash", "--system-prompt", "You are a coding agent."],
        cwd=work, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["is_error"] is False and result["result"] == "Done.", result

    # The tool call really ran.
    assert (work / "marker.txt").read_text() == "gyre\n"

    records = _records(served_proxy, eid)
    assert len(records) == 2, [r["call_id"] for r in records]
    first, second = records
    rec = service.records(eid)
    tok = service.renderer

    # What Claude Code sent back for the tool call: its own serialisation, under our call id.
    history = served_proxy.bodies[-1]["body"]["messages"]
    uses = [b for m in history if m["role"] == "assistant" and isinstance(m["content"], list)
            for b in m["content"] if b.get("type") == "tool_use"]
    assert len(uses) == 1
    resent = uses[0]
    assert list(resent["input"]) == ["command", "description", "timeout"]  # Bash key order
    assert resent["input"]["timeout"] == 60000 and json.dumps(resent["input"]["timeout"]) == "60000"
    minted = service.records(eid).payloads.get(resent["id"])
    assert minted is not None and minted.arguments == SAMPLED_ARGS  # the cache holds what was sampled

    # Round trip: the second call's prompt extends the first call's node, whose output part is
    # exactly the token ids the engine returned (not a re-tokenisation of the re-sent JSON).
    assert second["parent_id"] == first["node_id"]
    node1 = rec.tree.node(first["node_id"])
    n_in = len(first["new_input_ids"])
    assert node1.token_ids[n_in:].tolist() == first["output_ids"]
    assert second["input_ids"][: len(first["input_ids"]) + len(first["output_ids"])] == (
        first["input_ids"] + first["output_ids"]
    )
    assert tok.decode(first["output_ids"]).startswith('<tool_call>\n{"name": "Bash", "arguments": ' + SAMPLED_ARGS)
    # ... and without the restoration the history would have rendered to other tokens.
    naive = json.dumps(resent["input"], ensure_ascii=False)
    assert naive != SAMPLED_ARGS and tok.encode(naive) != tok.encode(SAMPLED_ARGS)

    # Forced (regex) output is recorded but never trainable.
    assert first["constrained"] and second["constrained"]
    assert all(node.provenance.max().item() == 0 for node in rec.tree)
    # Every call of this run is the main agent driving the task.
    assert {service.role_of(eid, leaf).name for leaf in rec.tree.leaves()} == {"MAIN_AGENT_TASK"}
