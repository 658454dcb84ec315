"""The official ``openai`` SDK against Gyre's proxy in front of a real SGLang server.

Several turns with tool calls and tool results, streaming and not. The tiny random model is made
to emit a chosen tool call by an engine-side ``regex`` in the execution's sampling config (the
proxy records such output as ``EXTERNAL``: constrained log-probs are not behaviour log-probs). A
greedy unconstrained execution checks that the records hold exactly what the engine returns.
"""

from __future__ import annotations

import json
import re

import pytest

pytestmark = [pytest.mark.sdk, pytest.mark.sglang]

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {
    "name": "Bash", "description": "run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
                   "required": ["command"]}}}]
SAMPLED_ARGS = '{"command": "ls", "timeout": 120000.0}'
TOOL_REGEX = re.escape('<tool_call>\n{"name": "Bash", "arguments": ' + SAMPLED_ARGS + '}\n</tool_call>')


def _client(proxy_server, key: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=proxy_server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _ask(client, model: str, messages: list, stream: bool, max_tokens: int = 250):
    """One call through the SDK; returns (content, tool_calls as dicts, finish_reason)."""
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens)
        m = r.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]
        return m.content or "", calls, r.choices[0].finish_reason, r.usage
    content, calls, finish, usage = "", {}, None, None
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                slot["name"] += (tc.function.name or "") if tc.function else ""
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, usage


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_calls_over_several_turns(proxy_server, stream: bool) -> None:
    eid, key = proxy_server.create_execution(sampling={"regex": TOOL_REGEX})
    client = _client(proxy_server, key)
    messages: list = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "list the files"}]
    for turn in range(3):
        content, calls, finish, usage = _ask(client, proxy_server.model, messages, stream)
        assert finish == "tool_calls" and len(calls) == 1, (content, calls)
        call = calls[0]
        assert call["name"] == "Bash" and call["arguments"] == SAMPLED_ARGS  # exactly as sampled
        # the harness re-serialises the arguments (compact JSON, 120000.0 -> 120000) like Claude Code
        resent = json.dumps(json.loads(call["arguments"]), separators=(",", ":")).replace("120000.0", "120000")
        messages.append({"role": "assistant", "content": content or None,
                         "tool_calls": [{"id": call["id"], "type": "function", "function": {"name": "Bash", "arguments": resent}}]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"file{turn}.txt"})
        assert usage is not None and usage.completion_tokens > 0

    records = proxy_server.admin_get(f"/gyre/executions/{eid}/records?input_ids=1")
    assert [r["parent_id"] for r in records] == [None, records[0]["node_id"], records[1]["node_id"]]
    renderer = proxy_server.service.renderer
    for prev, cur in zip(records, records[1:]):
        # the next prompt holds the previous prompt and the engine's output tokens verbatim
        assert cur["input_ids"][: len(prev["input_ids"]) + len(prev["output_ids"])] == prev["input_ids"] + prev["output_ids"]
        assert cur["input_ids"][len(prev["input_ids"]) + len(prev["output_ids"]):] == cur["new_input_ids"]
        assert "<tool_response>" in renderer.decode(cur["new_input_ids"])
    for r in records:
        assert r["constrained"] and r["output_provenance"] == "EXTERNAL" and r["engine"] == proxy_server.engine_url
        assert r["input_len"] == len(r["input_ids"])
    tree = proxy_server.admin_get(f"/gyre/executions/{eid}/tree")
    assert all(p != 1 for n in tree["nodes"] for p in n["provenance"])  # forced tokens are never targets
    assert proxy_server.admin_get(f"/gyre/executions/{eid}/selected?j_max=4") == []


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_records_hold_exactly_what_the_engine_returns(proxy_server, stream: bool) -> None:
    import httpx

    eid, key = proxy_server.create_execution(sampling={"temperature": 0.0})
    client = _client(proxy_server, key)
    messages: list = [{"role": "user", "content": "say something"}]
    for turn in range(2):
        content, calls, finish, usage = _ask(client, proxy_server.model, messages, stream, max_tokens=40)
        messages.append({"role": "assistant", "content": content,
                         "tool_calls": [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls] or None})
        for c in calls:
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": "ok"})
        messages.append({"role": "user", "content": f"again {turn}"})
    records = proxy_server.admin_get(f"/gyre/executions/{eid}/records?input_ids=1")
    assert len(records) == 2 and records[1]["parent_id"] == records[0]["node_id"]
    for r in records:
        # greedy decoding samples from no distribution the trainer could take log-probs of: its
        # output is context, never a target (the record still keeps the engine's log-probs)
        assert r["output_provenance"] == "EXTERNAL" and not r["constrained"]
        # replay the recorded prompt on the engine, greedy: the same tokens and log-probs come back
        direct = httpx.post(proxy_server.engine_url + "/generate", timeout=120, headers=proxy_server.engine_headers, json={
            "input_ids": r["input_ids"], "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": len(r["output_ids"])}}).json()
        assert direct["output_ids"] == r["output_ids"]
        lps = [t[0] for t in direct["meta_info"]["output_token_logprobs"]]
        assert lps == pytest.approx(r["logprobs"], abs=1e-4)
    tree = proxy_server.admin_get(f"/gyre/executions/{eid}/tree")
    node = next(n for n in tree["nodes"] if n["node_id"] == records[1]["node_id"])
    n_in = len(records[1]["new_input_ids"])
    assert node["token_ids"] == records[1]["new_input_ids"] + records[1]["output_ids"]
    assert node["provenance"] == [0] * (n_in + len(records[1]["output_ids"]))  # no target in a greedy reply


def test_errors_come_back_in_openai_shape_and_record_nothing(proxy_server) -> None:
    eid, key = proxy_server.create_execution()
    client = _client(proxy_server, key)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="not-served", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=proxy_server.model, messages=[{"role": "tool", "tool_call_id": "nope", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        _client(proxy_server, "wrong-key").chat.completions.create(model=proxy_server.model, messages=[{"role": "user", "content": "x"}])
    assert proxy_server.admin_get(f"/gyre/executions/{eid}/records") == []
