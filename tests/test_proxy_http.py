"""The proxy's HTTP server: OpenAI face, management routes, error shapes, fuzzed bodies.

The engine is ``FakeEngine`` (a named stand-in); the real-engine version of these checks is
``integration_tests/proxy/test_openai_sdk.py``.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
from starlette.testclient import TestClient

from gyre_core.proxy.app import build_app
from gyre_core.proxy.fake_engine import FakeEngine
from gyre_core.proxy.render import ChatRenderer
from gyre_core.proxy.service import ProxyConfig, ProxyService
from gyre_core.tiny_model import cached_tiny_model

ADMIN = "admin-token-0123456789"


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.from_model_dir(cached_tiny_model())


@pytest.fixture()
def stack(renderer: ChatRenderer):
    svc = ProxyService(renderer, ProxyConfig(served_models=("tiny",), max_body_bytes=64 * 1024))
    eng = FakeEngine("http://fake")
    svc.add_engine(eng)
    client = TestClient(build_app(svc, admin_token=ADMIN), raise_server_exceptions=False)
    r = client.post("/gyre/executions", headers={"Authorization": f"Bearer {ADMIN}"}, json={})
    assert r.status_code == 201
    ex = r.json()
    return svc, eng, client, ex["execution_id"], ex["api_key"]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_non_streaming_with_tools_and_usage(stack, renderer: ChatRenderer) -> None:
    svc, eng, client, eid, key = stack
    eng.script(renderer.encode('<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 2.0,
            "tools": [{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}]}
    r = client.post("/v1/chat/completions", headers=auth(key), json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    (call,) = out["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "Bash", "arguments": '{"command": "ls"}'}
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert out["usage"]["completion_tokens"] == len(svc.records(eid).calls[0].output_ids)
    assert "temperature" not in eng.calls[0].sampling_params or eng.calls[0].sampling_params["temperature"] != 2.0


def test_streaming_chunks_end_with_done(stack, renderer: ChatRenderer) -> None:
    svc, eng, client, eid, key = stack
    eng.script(renderer.encode("<think>hm</think>hello there<|im_end|>"))
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}]}
    with client.stream("POST", "/v1/chat/completions", headers=auth(key), json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "hello there"
    assert any(c["choices"] and c["choices"][0]["delta"].get("reasoning_content") == "hm" for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == len(svc.records(eid).calls[0].output_ids)


def test_management_is_admin_only_and_returns_records(stack) -> None:
    svc, eng, client, eid, key = stack
    client.post("/v1/chat/completions", headers=auth(key), json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    for path in (f"/gyre/executions/{eid}/tree", f"/gyre/executions/{eid}/records", "/gyre/engines"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers=auth(key)).status_code == 401  # an execution key is not admin
    tree = client.get(f"/gyre/executions/{eid}/tree", headers=auth(ADMIN)).json()
    assert len(tree["nodes"]) == 1
    recs = client.get(f"/gyre/executions/{eid}/records?input_ids=1", headers=auth(ADMIN)).json()
    assert recs[0]["input_ids"] == list(eng.calls[0].input_ids)
    sel = client.get(f"/gyre/executions/{eid}/selected?j_max=2&rows=1", headers=auth(ADMIN)).json()
    assert sel[0]["role"] == "MAIN_AGENT_TASK" and sum(sel[0]["loss_mask"]) == len(recs[0]["output_ids"])
    assert client.post(f"/gyre/executions/{eid}/close", headers=auth(ADMIN)).status_code == 200
    r = client.post("/v1/chat/completions", headers=auth(key), json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_one_execution_cannot_touch_another(stack) -> None:
    svc, eng, client, eid, key = stack
    other = client.post("/gyre/executions", headers=auth(ADMIN), json={}).json()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    client.post("/v1/chat/completions", headers=auth(other["api_key"]), json=body)
    assert len(svc.records(other["execution_id"]).calls) == 1 and svc.records(eid).calls == []


@pytest.mark.parametrize(
    ("kwargs", "status", "code"),
    [
        ({"content": b"{not json", "headers": {"Content-Type": "application/json"}}, 400, "invalid_request"),
        ({"content": b"{}", "headers": {"Content-Type": "text/plain"}}, 415, "unsupported_media_type"),
        ({"json": {"model": "nope", "messages": [{"role": "user", "content": "x"}]}}, 404, "model_not_found"),
        ({"json": {"model": "tiny", "messages": [{"role": "tool", "content": "x", "tool_call_id": "a"}]}}, 400, "invalid_request"),
        ({"json": {"model": "tiny", "messages": [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "x", "tool_call_id": "c9"}]}}, 400, "invalid_request"),
        ({"content": b'{"model": "tiny", "messages": [' + b'{"role": "user", "content": "' + b"x" * 70000 + b'"}]}',
          "headers": {"Content-Type": "application/json"}}, 413, "request_too_large"),
    ],
)
def test_errors_in_openai_shape_record_nothing(stack, kwargs, status, code) -> None:
    svc, eng, client, eid, key = stack
    headers = {**auth(key), **kwargs.pop("headers", {})}
    r = client.post("/v1/chat/completions", headers=headers, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == code
    assert svc.records(eid).calls == [] and eng.calls == []


json_leaf = st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=6)
json_any = st.recursive(json_leaf, lambda k: st.lists(k, max_size=3) | st.dictionaries(st.text(max_size=8), k, max_size=3), max_leaves=10)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system", "developer", "bogus", 3])},
    optional={
        "content": st.none() | st.text(max_size=10) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5)}) | json_any, max_size=2),
        "tool_call_id": st.sampled_from(["c1", "c2", "", None]) | json_any,
        "tool_calls": st.lists(st.fixed_dictionaries({"id": st.sampled_from(["c1", "c2"]) | json_any, "type": st.just("function"),
                                                      "function": st.fixed_dictionaries({"name": st.sampled_from(["f", ""]) | json_any},
                                                                                        optional={"arguments": st.text(max_size=8) | json_any})}), max_size=2) | json_any,
        "reasoning_content": st.text(max_size=5) | json_any,
    },
)
bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "other"]) | json_any, "messages": st.lists(message, max_size=4) | json_any},
    optional={
        "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=4)}, optional={"parameters": json_any})}) | json_any, max_size=2) | json_any,
        "max_tokens": json_any | st.integers(-2, 10**12), "stream": json_any, "n": json_any, "stream_options": json_any,
    },
) | json_any


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies)
def test_fuzzed_bodies_never_5xx_and_never_record_on_4xx(stack, body) -> None:
    svc, eng, client, eid, key = stack
    before_calls, before_nodes = len(svc.records(eid).calls), len(list(svc.records(eid).tree))
    r = client.post("/v1/chat/completions", headers={**auth(key), "Content-Type": "application/json"},
                    content=json.dumps(body).encode())
    event(f"status {r.status_code}")
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert "error" in r.json()
        assert len(svc.records(eid).calls) == before_calls and len(list(svc.records(eid).tree)) == before_nodes
    else:
        assert len(svc.records(eid).calls) == before_calls + 1
