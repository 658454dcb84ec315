"""Role swap of a real SGLang server: to training (stop intake, hand off, abort, flush, release)
and back to rollout (resume, load the published weights, reopen), each phase timed."""

from __future__ import annotations

import asyncio

import pytest

from gyre_core.interfaces import EngineError, PhaseTiming, WeightsRef


pytestmark = [pytest.mark.sglang, pytest.mark.timeout(400)]

LONG = {"max_new_tokens": 4000, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def swap_server(changeable_sglang_server):
    """Not the shared server: this module closes intake, aborts everything and reloads the weights
    (the tiny model's own, so it leaves the server as it found it)."""
    return changeable_sglang_server


def test_to_training_then_back_to_rollout(swap_server, tiny_model_dir):
    from gyre_core.interfaces import ServingOptions
    from gyre_sglang.plugin import gyre_make_serving_side

    reported: list[PhaseTiming] = []
    side = gyre_make_serving_side(engine=2, options=ServingOptions(url=swap_server.url, api_key=swap_server.api_key))
    side.on_phase = reported.append  # every phase of both switches is reported
    handed: list[list[str]] = []

    async def go():
        async with swap_server.client() as c:
            rids = [f"swap-{i}" for i in range(3)]
            running = [asyncio.create_task(c.generate([20 + i, 21, 22], LONG, rid=r)) for i, r in enumerate(rids)]
            await asyncio.sleep(1.5)

            def hand_off(ids):
                handed.append(list(ids))

            down = await side.ato_training(hand_off)
            results = await asyncio.gather(*running)
            with pytest.raises(EngineError) as refused:
                await c.generate([1, 2, 3], {"max_new_tokens": 2})
            up = await side.ato_rollout(WeightsRef(version=7, location=str(tiny_model_dir)))
            after = await c.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0.0})
            # a satellite's round trip within one policy version: its weights survived the release
            # (a no-op on the CPU engine; host backup on a GPU), so it pulls nothing on the way back
            reported.clear()
            await side.ato_training(lambda ids: None)
            again = await side.ato_rollout(WeightsRef(version=7, location="/nowhere: must not be read"))
            return rids, down, results, refused.value, up, after, again

    rids, down, results, refused, up, after, again = asyncio.run(go())
    assert side.weights_kept is True
    assert [p.phase for p in again] == ["resume_memory", "open_intake"] and side.weight_version == "7"
    reported[:] = down + up

    assert [p.phase for p in down] == ["stop_intake", "hand_off", "abort", "flush", "release_memory"]
    assert [p.phase for p in up] == ["resume_memory", "load_weights", "open_intake"]
    assert all(p.transition == "to_training" for p in down) and all(p.transition == "to_rollout" for p in up)
    assert all(p.cell == 2 and p.duration >= 0 for p in down + up)
    assert reported == down + up  # each phase reported as it ended, in order
    for a, b in zip(down + up, (down + up)[1:]):
        assert a.end <= b.start + 1e-9

    assert handed == [sorted(rids)]  # exactly the requests in flight were handed off
    # Each caller got its partial output (possibly empty if still queued) marked as aborted.
    assert [r.finish_reason for r in results] == ["abort"] * 3
    assert all(len(r.output_ids) < 4000 for r in results) and any(r.output_ids for r in results)
    assert refused.status == 503 and "leaving rollout" in refused.message

    assert side.weight_version == "7"
    assert after.weight_version == "7" and len(after.output_ids) == 4


def test_protocol_conformance_and_health(sglang_server):
    from gyre_core.interfaces import ServingSide
    from gyre_sglang.serving_side import SGLangServingSide

    side = SGLangServingSide(sglang_server.url, cell=0, api_key=sglang_server.api_key)
    assert isinstance(side, ServingSide)
    assert side.health()
    # the start check reads the engine's real /server_info: a CPU engine at TP 1 can switch with
    # KV hand-off on (the fields it reads are there, so a TP 2 engine would be caught)
    import asyncio

    async def info() -> dict:
        async with side._client() as c:
            return await c.server_info()

    got = asyncio.run(info())
    assert (got["tp_size"], got["device"], "enable_memory_saver" in got) == (1, "cpu", True)
    assert side.role_switch_problems(kv_handoff=True) == []
