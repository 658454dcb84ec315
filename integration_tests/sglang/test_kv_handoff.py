"""KV-cache pin and hand-off between two real SGLang CPU servers over Mooncake (loopback TCP).

The shared session server is the source (these tests only pin and abort their own requests on it,
and leave no pin behind); one extra server is the destination, killed by the last test.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

import pytest

from gyre_sglang.testing import start_sglang_server

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake, pytest.mark.timeout(400)]

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

N = 384
"""Long enough that the request is still decoding when the hand-off aborts it, even on an idle machine."""
N_ORPHAN = 2048
"""The orphan test pins a request it then aborts, so it can afford a far longer one: 384 tokens
once finished between the stream's third token and the pin in CI."""
GREEDY = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}
MOVE_AFTER = 3
"""Tokens the source must have streamed before the hand-off starts (so it is mid-generation)."""


def _prompt(seed: int, n: int = 40) -> list[int]:
    """A prompt no other test sends, so no server has any of it cached."""
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def dest_server(tiny_model_dir, tmp_path_factory, sglang_server):
    # one run's engines share its engine key: the destination acknowledges to the source with it
    server = start_sglang_server(tiny_model_dir, tmp_path_factory.mktemp("kv-handoff-logs"), "kv-dest",
                                 api_key=sglang_server.api_key)
    yield server
    server.stop()


async def _pins(client: Any) -> dict[str, Any]:
    return dict(await client.get("/gyre/kv/pins"))


def _source_pins(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in state["pins"] if p["kind"] == "source"]


async def _start_and_wait_decoding(client: Any, prompt: list[int], rid: str, max_new_tokens: int = N) -> asyncio.Task:
    """Stream a greedy request from ``client``'s server; return once it has produced MOVE_AFTER tokens.

    The task's result is the final answer (a ``GenerateResult``), partial when aborted. Streaming
    is how the test knows the request is mid-generation, whatever the machine's speed.
    """
    import json

    import aiohttp

    from gyre_sglang.client import parse_generate

    started = asyncio.Event()

    async def run():
        body = {"input_ids": prompt, "sampling_params": dict(GREEDY, max_new_tokens=max_new_tokens), "rid": rid,
                "stream": True}
        last = None
        async with aiohttp.ClientSession(headers=client.auth_headers) as http:
            async with http.post(client.url + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    last = json.loads(line[len("data:"):])
                    if len(last["output_ids"]) >= MOVE_AFTER:
                        started.set()
        started.set()
        return parse_generate(last)

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), 120)
    assert not task.done(), "the request finished before it could be moved"
    return task


def test_migrated_request_yields_the_unmoved_tokens_without_recomputing(sglang_server, dest_server):
    from gyre_sglang.kv_handoff import continue_on, hand_off

    prompt = _prompt(1)

    async def go():
        async with sglang_server.client() as a, dest_server.client() as b:
            before_a, before_b = await _pins(a), await _pins(b)
            task = await _start_and_wait_decoding(a, prompt, "kvh-moved")
            res = await hand_off(a, b, "kvh-moved", timeout=30)
            partial = await task
            prefix = prompt + list(partial.output_ids)
            dig_a = await a.post("/gyre/kv/digest", {"token_ids": prefix})
            dig_b = await b.post("/gyre/kv/digest", {"token_ids": prefix})
            after_a, after_b = await _pins(a), await _pins(b)
            cont = await continue_on(b, prompt, partial, GREEDY)
            # The reference last: the same prompt never reached A before the move.
            ref = await a.generate(prompt, GREEDY, rid="kvh-reference")
            return before_a, before_b, res, partial, dig_a, dig_b, after_a, after_b, cont, ref

    before_a, before_b, res, partial, dig_a, dig_b, after_a, after_b, cont, ref = asyncio.run(go())

    k = len(partial.output_ids)
    assert partial.finish_reason == "abort" and 0 < k < N
    assert not res.fell_back, res.reason
    # The source held the KV of the prompt and of every token it returned (the abort's extra
    # forward pass writes the last one's KV; the token that pass samples is dropped).
    assert res.prefix_tokens in (len(prompt) + k - 1, len(prompt) + k)
    assert res.cached_before == 0 and res.imported_tokens == res.prefix_tokens and res.bytes > 0
    assert res.acked  # the destination acknowledged: the source released at once
    # The bytes arrived intact: same K/V rows on both servers.
    assert dig_a["matched"] == dig_b["matched"] == res.prefix_tokens
    assert dig_a["sha256"] == dig_b["sha256"]
    # Exactly the imported prefix was reused; SGLang always recomputes at least the last input
    # token (it needs its logits), hence the min with len(input) - 1.
    assert cont.cached_tokens == min(res.prefix_tokens, len(prompt) + k - 1)
    assert cont.finish_reason == "length" and len(cont.output_ids) == N - k
    # Greedy: the moved request produced exactly the tokens of one never moved.
    assert partial.output_ids + cont.output_ids == ref.output_ids
    # Accounting on both sides.
    assert after_a["counts"]["released"] == before_a["counts"]["released"] + 1
    assert not _source_pins(after_a) and after_a["protected_tokens"] == before_a["protected_tokens"]
    assert after_b["counts"]["imports_done"] == before_b["counts"]["imports_done"] + 1


def test_nothing_to_move_falls_back_to_reprefill(sglang_server, dest_server):
    from gyre_sglang.kv_handoff import hand_off

    async def go():
        async with sglang_server.client() as a, dest_server.client() as b:
            res = await hand_off(a, b, "kvh-no-such-request", timeout=10)
            return res, await _pins(a)

    res, state = asyncio.run(go())
    assert res.fell_back and "not running" in res.reason
    assert not _source_pins(state)


def test_a_role_change_continues_running_calls_on_the_kv_their_engine_handed_off(
        sglang_server, dest_server, tiny_model_dir):
    """The live role switch's path, as ``LiveOrchestrator`` takes it: the proxy reroutes the
    switching engine's executions, then the engine's serving side goes to training with the
    proxy's ``hand_off`` as its hand-off step. Each running call's KV moves to the other engine
    and the call continues there: the recorded answers are exactly greedy answers of one engine,
    and the destination prefilled (almost) nothing. The switching engine is ``dest_server`` (it
    is brought back to rollout at the end); the session server receives the calls."""
    from gyre_core.proxy.render import ChatRenderer
    from gyre_core.proxy.service import ProxyConfig, ProxyService
    from gyre_core.proxy.types import ChatMessage, ChatRequest
    from gyre_sglang.serving_side import SGLangServingSide

    renderer = ChatRenderer.from_model_dir(tiny_model_dir)
    svc = ProxyService(renderer, ProxyConfig(served_models=("tiny",), max_new_tokens=N, retry_wait_s=30.0,
                                             sampling={"temperature": 0.0, "ignore_eos": True}))
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "zeta"]
    side = SGLangServingSide(dest_server.url, cell=1, api_key=dest_server.api_key)

    async def go():
        async with sglang_server.client() as a, dest_server.client() as b:
            svc.add_engine(b, kind="cell", cell_index=1, capacity=4)
            eids = [svc.create_execution()[0] for _ in range(2)]
            for e in eids:
                svc.router.assign(e)  # both on the switching engine (the only one yet)
            svc.add_engine(a, kind="cell", cell_index=0, capacity=4)
            calls = [asyncio.ensure_future(svc.complete(ChatRequest(
                execution_id=str(e), model="tiny", tools=(),
                messages=(ChatMessage("user", " ".join(rng.choice(words) for _ in range(60))),))))
                for e in eids]
            deadline = time.monotonic() + 120
            while len(svc.inflight(b.url)) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)  # both are decoding now (384 tokens take several seconds here)
            svc.reroute(b.url, [a.url])
            phases = await side.ato_training(lambda rids: svc.hand_off(b.url, rids))
            await asyncio.gather(*calls)
            refs = []
            for e in eids:
                (rec,) = svc.records(e).calls
                refs.append(await a.generate(list(rec.new_input_ids), {"temperature": 0.0, "ignore_eos": True,
                                                                       "max_new_tokens": N}))
            pins_b = await _pins(b)
            await side.ato_rollout(None)  # the later tests use it as a destination again
            return eids, phases, refs, pins_b

    eids, phases, refs, pins_b = asyncio.run(go())
    assert [p.phase for p in phases][:3] == ["stop_intake", "hand_off", "abort"]
    summary = svc.handoffs.summary()
    assert summary["interrupted"] == 2 and summary["handed_off"] == 2, summary
    assert summary["reprefilled"] == 0 and summary["regenerated"] == 0
    for e, ref in zip(eids, refs):
        (rec,) = svc.records(e).calls
        assert rec.attempts == 2 and rec.engine == sglang_server.url
        assert rec.output_ids == ref.output_ids  # greedy: what one engine alone produces
        assert len(rec.logprobs) == N and rec.finish_reason == "length"
    # The destination reused the handed-off prefix of each call (prompt + partial output, less at
    # most the last token, which SGLang always recomputes): far more than the prompts alone.
    assert summary["prefill_tokens_saved"] > 2 * 60 and summary["handoff_bytes"] > 0
    assert not _source_pins(pins_b)  # the switching engine holds nothing for the hand-offs


def test_dead_destination_is_a_clear_error_and_leaves_no_pin(sglang_server):
    from gyre_sglang.client import SGLangClient
    from gyre_sglang.kv_handoff import DestinationUnreachable, hand_off
    from gyre_sglang.server import free_port

    prompt = _prompt(2)

    async def go():
        async with sglang_server.client() as a, SGLangClient(f"http://127.0.0.1:{free_port()}") as dead:
            before = await _pins(a)
            task = asyncio.create_task(a.generate(prompt, dict(GREEDY, max_new_tokens=12), rid="kvh-dead-dest"))
            await asyncio.sleep(0.2)
            with pytest.raises(DestinationUnreachable, match="does not answer"):
                await hand_off(a, dead, "kvh-dead-dest", timeout=10)
            out = await task
            return before, await _pins(a), out

    before, after, out = asyncio.run(go())
    assert out.finish_reason == "length" and len(out.output_ids) == 12  # the source kept serving it
    assert after["counts"]["pinned"] == before["counts"]["pinned"]
    assert not _source_pins(after) and after["protected_tokens"] == before["protected_tokens"]


def test_killed_destination_leaves_source_blocks_released_after_the_lease(sglang_server, dest_server):
    """Runs last: it kills the destination. The destination dies before it acknowledges, and
    nobody releases the pin: the source's lease must free the blocks by itself."""
    from gyre_core.interfaces import EngineUnreachable

    lease_s = 3.0
    prompt = _prompt(3)

    async def go():
        async with sglang_server.client() as a, dest_server.client() as b:
            before = await _pins(a)
            task = await _start_and_wait_decoding(a, prompt, "kvh-orphan", N_ORPHAN)
            pin = await a.post("/gyre/kv/pin", {"rid": "kvh-orphan", "lease_s": lease_s})
            await a.abort_request("kvh-orphan")
            partial = await task
            desc = await a.get(f"/gyre/kv/handle/{pin['handle']}?wait_s=10")
            held = await _pins(a)
            dest_server.kill()
            with pytest.raises(EngineUnreachable):
                await b.post("/gyre/kv/import", {"descriptor": desc, "source_url": a.url}, timeout=10)
            still = await _pins(a)
            deadline = time.monotonic() + lease_s + 10
            while time.monotonic() < deadline:
                after = await _pins(a)
                if not _source_pins(after):
                    break
                await asyncio.sleep(0.2)
            return before, partial, desc, held, still, after, time.monotonic()

    t0 = time.monotonic()
    before, partial, desc, held, still, after, t_end = asyncio.run(go())
    assert desc["state"] == "ready" and len(desc["token_ids"]) >= len(prompt) + len(partial.output_ids) - 1
    assert [p["handle"] for p in _source_pins(held)] == [desc["handle"]]
    assert held["protected_tokens"] >= before["protected_tokens"] + len(desc["token_ids"])
    assert [p["handle"] for p in _source_pins(still)] == [desc["handle"]]  # nobody released it
    assert not _source_pins(after), "the lease did not release the pinned blocks"
    assert after["counts"]["expired"] == before["counts"]["expired"] + 1
    assert after["protected_tokens"] == before["protected_tokens"]
    assert t_end - t0 < lease_s + 30
