"""The async client against a real SGLang server (CPU engine here), with Gyre's plugin loaded."""

from __future__ import annotations

import asyncio
import math

import pytest

from gyre_core.interfaces import EngineError, EngineUnreachable, GenerateResult

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(300)]


def run(coro):
    return asyncio.run(coro)


def _client(server):
    return server.client(timeout=60)


def test_plugin_route_is_loaded(sglang_server):
    async def go():
        async with _client(sglang_server) as c:
            return await c.get("/gyre/info")

    info = run(go())
    assert info["plugin"] == "gyre-sglang"


def test_generate_returns_exact_tokens_and_logprobs(sglang_server):
    async def go():
        async with _client(sglang_server) as c:
            a = await c.generate([5, 6, 7, 8], {"max_new_tokens": 12, "temperature": 0.0}, rid="t-greedy-1")
            b = await c.generate([5, 6, 7, 8], {"max_new_tokens": 12, "temperature": 0.0})
            return a, b

    a, b = run(go())
    assert isinstance(a, GenerateResult)
    assert a.rid == "t-greedy-1"
    assert len(a.output_ids) == len(a.logprobs) == 12
    assert a.finish_reason == "length" and a.prompt_tokens == 4
    assert all(lp <= 0.0 and math.isfinite(lp) for lp in a.logprobs)
    assert a.output_ids == b.output_ids  # greedy is deterministic
    assert b.cached_tokens >= 3  # the second call reused the first one's prefix


def test_abort_by_rid_returns_partial_output(sglang_server):
    async def go():
        async with _client(sglang_server) as c:
            task = asyncio.create_task(
                c.generate([9, 10, 11], {"max_new_tokens": 4000, "temperature": 0.0, "ignore_eos": True}, rid="t-abort-1")
            )
            await asyncio.sleep(1.0)
            await c.abort_known("t-abort-1")
            await c.abort_request("no-such-rid")  # SGLang's endpoint: unknown rid passes silently
            with pytest.raises(EngineError) as unknown:
                await c.abort_known("no-such-rid")  # Gyre's: a clear error
            return await asyncio.wait_for(task, 60), unknown.value

    res, unknown = run(go())
    assert unknown.status == 404 and "no-such-rid" in unknown.message
    assert res.finish_reason == "abort"
    assert 0 < len(res.output_ids) < 4000
    assert len(res.logprobs) == len(res.output_ids)


def test_pause_continue_flush_memory_and_version(sglang_server):
    async def go():
        async with _client(sglang_server) as c:
            await c.pause_generation("abort")
            await c.continue_generation()
            await c.flush_cache()
            await c.release_memory_occupation(["kv_cache", "weights"])
            await c.resume_memory_occupation(["weights", "kv_cache"])
            ok = await c.health()
            return ok, await c.weight_version()

    ok, version = run(go())
    assert ok
    assert version == "default"


def test_bad_requests_raise_engine_errors_with_endpoint_and_message(sglang_server):
    async def go():
        async with _client(sglang_server) as c:
            with pytest.raises(EngineError) as e1:
                await c.generate([1, 2], {"max_tokens": 3})  # strict schema: max_new_tokens only
            with pytest.raises(EngineError) as e2:
                await c.update_weights_from_disk("/nonexistent/model/dir")
            with pytest.raises(EngineError) as e3:
                await c.post("/gyre/no-such-route", {})
            return e1.value, e2.value, e3.value

    e1, e2, e3 = run(go())
    assert e1.endpoint == "/generate" and e1.status is not None and 400 <= e1.status < 500
    assert "max_tokens" in e1.message
    assert e2.endpoint == "/update_weights_from_disk" and e2.message
    assert e3.status == 404


def test_unreachable_engine_is_distinguished():
    from gyre_sglang.client import SGLangClient
    from gyre_sglang.server import free_port

    async def go():
        async with SGLangClient(f"http://127.0.0.1:{free_port()}", timeout=5) as c:
            assert not await c.health()
            with pytest.raises(EngineUnreachable) as e:
                await c.generate([1], {"max_new_tokens": 1})
            return e.value

    err = run(go())
    assert err.endpoint == "/generate" and err.status is None
