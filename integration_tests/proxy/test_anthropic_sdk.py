"""The official ``anthropic`` SDK against Gyre's proxy in front of a real SGLang server.

Several turns with tool calls and tool results, streaming and not, the history re-sent the way
Claude Code re-sends it (tool input re-serialised, Bash key order, ``120000.0`` as ``120000``).
An engine-side ``regex`` makes the tiny random model emit the chosen tool call (recorded as not
trainable: constrained log-probs are not behaviour log-probs). A free-running execution checks that
the record holds the engine's tokens and that its log-probs are the engine's own (recomputed by
SGLang over prompt + answer).
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.sdk, pytest.mark.sglang]

anthropic = pytest.importorskip("anthropic")

TOOLS = [{"name": "Bash", "description": "Run a shell command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"},
                                                            "description": {"type": "string"},
                                                            "timeout": {"type": "number"}},
                           "required": ["command"]},
          "cache_control": {"type": "ephemeral"}}]
SAMPLED_ARGS = '{"description": "List – files", "command": "ls", "timeout": 120000.0}'
TOOL_REGEX = re.escape('<tool_call>\n{"name": "Bash", "arguments": ' + SAMPLED_ARGS + '}\n</tool_call>')
SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=test;"},
          {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]
# What Claude Code sends besides the conversation; the proxy ignores all of it.
EXTRA = {"metadata": {"user_id": json.dumps({"session_id": "s"})}, "extra_body": {
    "thinking": {"type": "adaptive"}, "context_management": {"edits": []}, "output_config": {"effort": "high"}}}


def _client(proxy_server: Any, key: str) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=proxy_server.url, api_key=key, max_retries=0, timeout=120)


def _call(client: Any, model: str, messages: list, stream: bool, **kw: Any) -> tuple[Any, list[str]]:
    """One call; returns the final Message and, when streaming, the event types the SDK saw."""
    args = dict(model=model, max_tokens=250, system=SYSTEM, messages=messages, tools=TOOLS, **EXTRA)
    args.update(kw)
    if not stream:
        return client.messages.create(**args), []
    with client.messages.stream(**args) as s:
        types = [e.type for e in s]
        return s.get_final_message(), types


def _block_events(types: list[str]) -> list[str]:
    return [t for t in types if t not in ("text", "thinking", "input_json", "signature", "citation")]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_calls_over_several_turns(proxy_server: Any, stream: bool) -> None:
    eid, key = proxy_server.create_execution(sampling={"regex": TOOL_REGEX})
    client = _client(proxy_server, key)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>date</system-reminder>"},
                                     {"type": "text", "text": "list the files"}]},
        {"role": "system", "content": "Environment: linux"},  # Claude Code sends these inside messages
    ]
    answers = []
    for turn in range(3):
        msg, types = _call(client, proxy_server.model, messages, stream)
        answers.append(msg)
        assert msg.stop_reason == "tool_use" and msg.model == proxy_server.model
        (use,) = [b for b in msg.content if b.type == "tool_use"]
        assert use.name == "Bash" and use.id.startswith("toolu_")
        assert use.input == json.loads(SAMPLED_ARGS)
        if stream:
            blocks = _block_events(types)
            assert blocks[0] == "message_start" and blocks[-2:] == ["message_delta", "message_stop"]
            deltas = {"thinking": 2, "text": 1, "tool_use": 1}  # thinking: its text, then its signature
            expected = [e for b in msg.content for e in
                        ["content_block_start", *["content_block_delta"] * deltas[b.type], "content_block_stop"]]
            assert blocks[1:-2] == expected
        # Re-send the history as Claude Code does: its own serialisation of the tool input.
        resent = {"command": use.input["command"], "description": use.input["description"],
                  "timeout": int(use.input["timeout"])}
        content: list[dict[str, Any]] = [{"type": "text", "text": b.text} for b in msg.content if b.type == "text"]
        content.append({"type": "tool_use", "id": use.id, "name": "Bash", "input": resent})
        messages.append({"role": "assistant", "content": content})
        result: Any = "file_a\nfile_b" if turn != 1 else [{"type": "text", "text": "ls: denied"}]
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": result, "is_error": turn == 1,
             "cache_control": {"type": "ephemeral"}}]})

    records = proxy_server.admin_get(f"/gyre/executions/{eid}/records?input_ids=1")
    assert len(records) == 3
    renderer = proxy_server.service.renderer
    for i, (rec, msg) in enumerate(zip(records, answers)):
        # each turn extends the previous turn's node: the restored payload matched the sampled tokens
        assert rec["parent_id"] == (records[i - 1]["node_id"] if i else None)
        if i:
            prev = records[i - 1]
            assert rec["input_ids"][: len(prev["input_ids"]) + len(prev["output_ids"])] == prev["input_ids"] + prev["output_ids"]
        assert renderer.decode(rec["output_ids"]).startswith(
            '<tool_call>\n{"name": "Bash", "arguments": ' + SAMPLED_ARGS + "}\n</tool_call>")
        assert rec["constrained"] and rec["output_provenance"] == "EXTERNAL"
        assert rec["api"] == "anthropic"
        # usage: Anthropic splits cached prompt tokens out of input_tokens
        u = msg.usage
        assert u.input_tokens + (u.cache_read_input_tokens or 0) == rec["input_len"]
        assert u.output_tokens == len(rec["output_ids"])
    # secrets are never recorded
    tree = proxy_server.admin_get(f"/gyre/executions/{eid}/tree")
    assert key not in json.dumps(tree)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_free_answer_is_recorded_with_the_engines_tokens_and_logprobs(proxy_server: Any, stream: bool) -> None:
    eid, key = proxy_server.create_execution()
    client = _client(proxy_server, key)
    msg, _ = _call(client, proxy_server.model, [{"role": "user", "content": "say something"}], stream, max_tokens=12)
    assert msg.stop_reason in ("end_turn", "max_tokens")

    (rec,) = proxy_server.admin_get(f"/gyre/executions/{eid}/records?input_ids=1")
    assert rec["output_provenance"] == "SAMPLED" and not rec["constrained"]
    assert 1 <= len(rec["output_ids"]) <= 12 and msg.usage.output_tokens == len(rec["output_ids"])
    # What the SDK got is the parse of exactly the recorded tokens.
    from gyre_core.proxy.parse import parse_output

    renderer = proxy_server.service.renderer
    parsed = parse_output(renderer.decode(rec["output_ids"]), eos_text=renderer.eos_text)
    text = "".join(b.text for b in msg.content if b.type == "text")
    thinking = "".join(b.thinking for b in msg.content if b.type == "thinking")
    assert text == parsed.content and (thinking or None) == (parsed.reasoning or None)

    # The recorded log-probs are the engine's: SGLang recomputes them over prompt + answer.
    full = rec["input_ids"] + rec["output_ids"]
    r = httpx.post(proxy_server.engine_url + "/generate", timeout=120, headers=proxy_server.engine_headers, json={
        "input_ids": full, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True, "logprob_start_len": len(rec["input_ids"]) - 1})
    r.raise_for_status()
    scored = r.json()["meta_info"]["input_token_logprobs"]
    by_position = [t for t in scored if t[0] is not None][-len(rec["output_ids"]):]
    assert [t[1] for t in by_position] == rec["output_ids"]
    assert [t[0] for t in by_position] == pytest.approx(rec["logprobs"], abs=2e-3)
