"""The Anthropic face: translation both ways, the SSE sequence, and errors in Anthropic's shape.

Requests are real Claude Code bodies (the captured fixture) and hand-written edge cases. The
stream is checked with the ``anthropic`` SDK's own event accumulator; the HTTP error paths run the
real router and the real proxy core (``ProxyService`` with the tiny model's tokenizer) under
uvicorn, and are read back with the official SDK, which must raise its typed exceptions. Answers
that need an engine are covered by ``integration_tests/proxy/test_anthropic_sdk.py``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from gyre_core.proxy.anthropic_api import encode_sse, message_events, response_message, to_chat_request
from gyre_core.proxy.http_layer import api_key_of, decode_json
from gyre_core.proxy.types import ChatResponse, ProxyError, ToolCall, Usage

FIXTURE = Path(__file__).resolve().parents[1] / "integration_tests/claude_code/fixtures/claude_code_2.1.197_requests.json"


def _req(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "gyre", "max_tokens": 64, "messages": messages, **extra}


def _translate(body: dict[str, Any], headers: dict[str, str] | None = None):
    return to_chat_request(body, execution_id="7", headers=headers or {})


def _bad(body: dict[str, Any], match: str) -> None:
    with pytest.raises(ProxyError, match=match) as info:
        _translate(body)
    assert (info.value.status, info.value.kind) == (400, "invalid_request")


# ---------------------------------------------------------------------------------------------
# requests


def test_every_captured_claude_code_request_translates() -> None:
    data = json.loads(FIXTURE.read_text())
    entries = [e for k, v in data.items() if isinstance(v, list) for e in v if "body" in e]
    assert len(entries) >= 6
    for e in entries:
        req = _translate(e["body"], {"X-Api-Key": "secret", "Authorization": "Bearer s", **e["headers"]})
        body = e["body"]
        assert req.api == "anthropic" and req.stream is True and req.max_tokens == body["max_tokens"]
        # system blocks -> one leading system message, in order
        assert req.messages[0].role == "system"
        assert req.messages[0].content == "\n\n".join(b["text"] for b in body["system"])
        # tools: input_schema becomes parameters, unchanged
        assert [t["function"]["name"] for t in req.tools] == [t["name"] for t in body["tools"]]
        assert [t["function"]["parameters"] for t in req.tools] == [t["input_schema"] for t in body["tools"]]
        # credentials never reach the core (they would be recorded as metadata)
        assert "x-api-key" not in req.headers and "authorization" not in req.headers
        assert req.headers["x-claude-code-session-id"] == e["headers"]["x-claude-code-session-id"]
        # role:"system" messages inside messages stay system messages, in place
        inner = [m for m in body["messages"] if m["role"] == "system"]
        assert sum(m.role == "system" for m in req.messages) == 1 + len(inner)


def test_history_blocks() -> None:
    body = _req(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "env"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xx"},
                    {"type": "text", "text": " ok "},
                    {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls", "timeout": 120000}},
                    {"type": "tool_use", "id": "t2", "name": "Read", "input": {"path": "é"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "out", "is_error": False},
                    {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                     "content": [{"type": "text", "text": "x"}, {"type": "image", "source": {}}]},
                    {"type": "text", "text": "next"},
                ],
            },
        ],
        system=[{"type": "text", "text": "s1"}, {"type": "text", "text": "s2", "cache_control": {"type": "ephemeral"}}],
        metadata={"user_id": "{}"}, thinking={"type": "adaptive"}, context_management={}, output_config={},
        temperature=0.2, tool_choice={"type": "auto"},
    )
    req = _translate(body)
    roles = [m.role for m in req.messages]
    assert roles == ["system", "user", "system", "assistant", "tool", "tool", "user"]
    assert req.messages[0].content == "s1\n\ns2" and req.messages[1].content == "a\n\nb"
    a = req.messages[3]
    assert (a.content, a.reasoning) == (" ok ", "hmm")
    assert a.tool_calls == (
        ToolCall("t1", "Bash", '{"command": "ls", "timeout": 120000}'),
        ToolCall("t2", "Read", '{"path": "é"}'),
    )
    assert (req.messages[4].tool_call_id, req.messages[4].content) == ("t1", "out")
    assert req.messages[5].tool_call_id == "t2" and req.messages[5].content.startswith("x\n\n[image omitted")
    assert req.messages[6].content == "next"
    assert req.max_tokens == 64 and req.stream is False


def test_server_tools_are_dropped() -> None:
    body = _req([{"role": "user", "content": "hi"}],
                tools=[{"type": "web_search_20250305", "name": "web_search"},
                       {"name": "Bash", "description": "run", "input_schema": {"type": "object"}}])
    assert _translate(body).tools == (
        {"type": "function", "function": {"name": "Bash", "description": "run", "parameters": {"type": "object"}}},
    )


def test_request_errors() -> None:
    _bad({"messages": [{"role": "user", "content": "x"}]}, "model")
    _bad(_req([]), "messages")
    _bad(_req([{"role": "tool", "content": "x"}]), "role")
    _bad(_req([{"role": "user", "content": 5}]), "content: must be a string")
    _bad(_req([{"role": "user", "content": [{"type": "video"}]}]), "unexpected content block type 'video'")
    _bad(_req([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]), "assistant")
    _bad(_req([{"role": "user", "content": "x"}], max_tokens=0), "max_tokens")
    _bad(_req([{"role": "user", "content": "x"}], stream="yes"), "stream")
    _bad(_req([{"role": "user", "content": "x"}], tools=[{"name": "x"}]), "input_schema")
    # a tool_result without its tool_use
    _bad(_req([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]),
         "unexpected tool_use_id 'nope'")
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]}
    _bad(_req([{"role": "user", "content": "x"}, use,
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}]),
         "unexpected tool_use_id 't9'")
    # a tool_use left unanswered before the conversation goes on
    _bad(_req([{"role": "user", "content": "x"}, use, {"role": "user", "content": "y"}]), "without tool_result")
    _bad(_req([{"role": "user", "content": "x"}, use, use]), "without tool_result")
    _bad(_req([{"role": "user", "content": "x"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "a", "input": {}},
                                                 {"type": "tool_use", "id": "t", "name": "b", "input": {}}]}]),
         "duplicate")
    _bad(_req([{"role": "user", "content": "x"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "a", "input": [1]}]}]),
         "input: must be an object")


def test_body_decoding_and_credentials_of_the_shared_layer() -> None:
    assert decode_json(b'{"a": 1}') == {"a": 1}
    for raw, needle in [
        (b"{", "not valid JSON"),
        (b"\xff", "not valid UTF-8"),
        (b'{"a": NaN}', "NaN is not a JSON number"),
        (b'{"a": "\\ud800"}', "lone surrogate"),
        (b"[" * 70 + b"]" * 70, "nested deeper than 64"),
        (b"[" * 65 + b"]" * 65, "nested deeper than 64"),
        (b'{"a": [1.5, 1e999]}', "out of range"),
        (b'{"a": [{"b": ["x", "\\udfff"]}]}', "lone surrogate"),
        (b'{"a": [{"\\uD800": 1}]}', "lone surrogate"),
    ]:
        with pytest.raises(ProxyError, match=needle) as info:
            decode_json(raw)
        assert info.value.status == 400 and info.value.kind == "invalid_request"
    assert decode_json(b"[" * 64 + b"]" * 64) is not None  # 64 levels are allowed
    assert decode_json(b'{"a": "\\u00e9 \\ud83d\\ude00"}') == {"a": "\u00e9 \U0001f600"}  # a pair is text
    # a body of structure alone is refused by count, before it is parsed (413, like a long body)
    with pytest.raises(ProxyError, match="arrays and objects") as info:
        decode_json(b'{"m": [' + b"[]," * 100_000 + b"1]}")
    assert info.value.status == 413 and info.value.kind == "request_too_large"
    assert len(decode_json(b'{"m": [' + b"[]," * 99_000 + b"1]}")["m"]) == 99_001
    assert api_key_of({"x-api-key": " k "}) == "k"
    assert api_key_of({"authorization": "Bearer t"}) == "t"
    assert api_key_of({"authorization": "Basic t"}) is None
    assert api_key_of({}) is None
    assert api_key_of({"x-api-key": "b", "authorization": "Bearer a"}) == "b"
    for bad in ("k" * 513, "ké"):
        with pytest.raises(ProxyError) as info:
            api_key_of({"x-api-key": bad})
        assert info.value.status == 401


# ---------------------------------------------------------------------------------------------
# answers


def _answer(**kw: Any) -> ChatResponse:
    base = dict(call_id="gyre-1", model="gyre", content="", reasoning=None, tool_calls=(),
                finish_reason="stop", usage=Usage(100, 7, 40))
    base.update(kw)
    return ChatResponse(**base)


ARGS = '{"command": "echo hi > f.txt",  "description": "Write", "timeout": 120000.0}'
ANSWERS = {
    "text": _answer(content="Hello there."),
    "empty": _answer(),
    "thinking_text": _answer(reasoning="let me see", content="\n\nDone."),
    "tools": _answer(reasoning="r", content="I will run it.",
                     tool_calls=(ToolCall("toolu_a", "Bash", ARGS), ToolCall("toolu_b", "Read", "{}")),
                     finish_reason="tool_calls"),
    "length": _answer(content="cut", finish_reason="length"),
}


def test_response_message() -> None:
    m = response_message(ANSWERS["tools"], "my-model")
    assert m["model"] == "my-model" and m["stop_reason"] == "tool_use" and m["id"] == "msg_gyre-1"
    assert [b["type"] for b in m["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert m["content"][0]["signature"]
    assert m["content"][2] == {"type": "tool_use", "id": "toolu_a", "name": "Bash", "input": json.loads(ARGS)}
    # Anthropic counts cache reads apart from input_tokens; the sum is the prompt
    assert m["usage"] == {"input_tokens": 60, "cache_read_input_tokens": 40, "cache_creation_input_tokens": 0,
                          "output_tokens": 7}
    assert response_message(ANSWERS["length"], "x")["stop_reason"] == "max_tokens"
    assert response_message(ANSWERS["text"], "x")["stop_reason"] == "end_turn"
    assert response_message(ANSWERS["empty"], "x")["content"] == [{"type": "text", "text": ""}]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_stream_accumulates_to_the_message_with_the_official_sdk(name: str) -> None:
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    from anthropic._models import construct_type

    resp = ANSWERS[name]
    events = list(message_events(resp, "my-model"))
    types = [e for e, _ in events]
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta", "message_stop"]
    assert all(e == d["type"] for e, d in events)
    snapshot = None
    bufs: dict[int, bytes] = {}
    for _, data in events:
        if data["type"] == "ping":
            continue
        event = construct_type(type_=RawMessageStreamEvent, value=json.loads(json.dumps(data)))
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot is not None
    assert snapshot.to_dict(exclude_none=True) | {} == {
        k: v for k, v in response_message(resp, "my-model").items() if k != "stop_sequence"
    } | {"usage": snapshot.to_dict()["usage"]}
    assert snapshot.usage.input_tokens == 60 and snapshot.usage.output_tokens == 7
    # each block opens, fills and closes at its own index, in order
    starts = [d["index"] for e, d in events if e == "content_block_start"]
    stops = [d["index"] for e, d in events if e == "content_block_stop"]
    assert starts == stops == list(range(len(starts)))


def test_stream_sends_tool_arguments_exactly_as_sampled() -> None:
    events = list(message_events(ANSWERS["tools"], "m"))
    partial = [d["delta"]["partial_json"] for e, d in events
               if e == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert partial == [ARGS, "{}"]
    sig = [d["delta"] for e, d in events if e == "content_block_delta" and d["delta"]["type"] == "signature_delta"]
    assert len(sig) == 1 and sig[0]["signature"]
    raw = b"".join(encode_sse(e, d) for e, d in events)
    assert raw.startswith(b"event: message_start\ndata: {") and raw.endswith(b'data: {"type":"message_stop"}\n\n')


# ---------------------------------------------------------------------------------------------
# HTTP errors, read back by the official SDK


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Any]]:
    """The real router and proxy core (no engine registered) under uvicorn on 127.0.0.1."""
    pytest.importorskip("transformers")
    uvicorn = pytest.importorskip("uvicorn")
    from fastapi import FastAPI

    from gyre_core.proxy.anthropic_api import make_router
    from gyre_core.proxy.render import ChatRenderer
    from gyre_core.proxy.service import ProxyConfig, ProxyService
    from gyre_core.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    service = ProxyService(ChatRenderer.from_model_dir(model_dir), ProxyConfig(served_models=("gyre",)))
    _, key = service.create_execution()
    app = FastAPI()
    app.include_router(make_router(service, max_body_bytes=64 * 1024, ping_after_s=5.0))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", key, service
    server.should_exit = True
    thread.join(10)


def test_probe_of_the_base_url(proxy: tuple[str, str, Any]) -> None:
    import httpx

    url, _, _ = proxy
    assert httpx.head(url + "/").status_code == 200
    assert httpx.get(url + "/").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_errors_have_anthropic_shape_and_sdk_types(proxy: tuple[str, str, Any], stream: bool) -> None:
    import anthropic

    url, key, _ = proxy
    good = [{"role": "user", "content": "hi"}]
    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    cases: list[tuple[type[Exception], int, str, dict[str, Any], anthropic.Anthropic]] = [
        (anthropic.AuthenticationError, 401, "authentication_error", {"model": "gyre", "messages": good},
         anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)),
        (anthropic.NotFoundError, 404, "not_found_error", {"model": "claude-nope", "messages": good}, client),
        (anthropic.BadRequestError, 400, "invalid_request_error", {"model": "gyre", "messages": [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "r"}]}]}, client),
        (anthropic.BadRequestError, 400, "invalid_request_error",
         {"model": "gyre", "messages": [{"role": "user", "content": [{"type": "nope"}]}]}, client),
        (anthropic.APIStatusError, 413, "request_too_large",
         {"model": "gyre", "messages": [{"role": "user", "content": "x" * 100_000}]}, client),
        # a valid call, but no rollout engine is registered: overloaded, before any stream opens
        (anthropic.InternalServerError, 503, "overloaded_error", {"model": "gyre", "messages": good}, client),
    ]
    for exc_type, status, etype, kwargs, c in cases:
        with pytest.raises(exc_type) as info:
            if stream:
                with c.messages.stream(max_tokens=16, **kwargs) as s:
                    s.get_final_message()
            else:
                c.messages.create(max_tokens=16, **kwargs)
        err = info.value
        assert isinstance(err, anthropic.APIStatusError)
        assert err.status_code == status
        assert err.response.json()["type"] == "error" and err.response.json()["error"]["type"] == etype


def test_raw_http_errors(proxy: tuple[str, str, Any]) -> None:
    import httpx

    url, key, _ = proxy
    h = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    cases = [
        (httpx.post(url + "/v1/messages?beta=true", headers={**h, "content-type": "application/json"},
                    content=b"{not json"), 400, "invalid_request_error"),
        (httpx.post(url + "/v1/messages", headers={**h, "content-type": "text/plain"}, content=b"{}"),
         415, "invalid_request_error"),
        (httpx.post(url + "/v1/messages", headers={**h, "content-type": "application/json"},
                    content=b"{" + b" " * 70_000 + b"}"), 413, "request_too_large"),
        (httpx.post(url + "/v1/messages", headers={"authorization": "Bearer nope"}, json={}), 401,
         "authentication_error"),
        (httpx.post(url + "/v1/messages", headers={"authorization": f"Bearer {key}"},
                    json={"model": "gyre", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
         503, "overloaded_error"),
    ]
    for resp, status, etype in cases:
        assert resp.status_code == status, resp.text
        assert resp.json() == {"type": "error", "error": {"type": etype, "message": resp.json()["error"]["message"]}}
        assert resp.json()["error"]["message"]
