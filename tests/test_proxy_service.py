"""The proxy core against ``FakeEngine`` (a named stand-in: scripted tokens, no model).

Checks what must hold for every recorded call: the engine got exactly path tokens + newly encoded
tokens, only the new content was encoded, divergence branches, unrelated contexts attach to the
root, credentials isolate executions, engine aborts are retried invisibly, forced output is never
a target.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("transformers")

from gyre_core.interfaces import GenerateResult, KVHandOff
from gyre_core.proxy.fake_engine import FakeEngine, FakeEngineCall
from gyre_core.proxy.render import ChatRenderer
from gyre_core.proxy.service import ProxyConfig, ProxyService
from gyre_core.proxy.types import ChatMessage, ChatRequest, ProxyError, ToolCall
from gyre_core.tiny_model import cached_tiny_model
from gyre_core.trajectory import Provenance, TrajectoryRow

TOOLS = ({"type": "function", "function": {"name": "Bash", "description": "run a command",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}},)


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.from_model_dir(cached_tiny_model())


def make(renderer: ChatRenderer, **cfg) -> tuple[ProxyService, FakeEngine]:
    svc = ProxyService(renderer, ProxyConfig(served_models=("tiny",), retry_wait_s=0.2, **cfg))
    eng = FakeEngine("http://fake-a")
    svc.add_engine(eng)
    return svc, eng


def req(eid: int, messages, **kw) -> ChatRequest:
    return ChatRequest(execution_id=str(eid), model="tiny", messages=tuple(messages), tools=kw.pop("tools", TOOLS), **kw)


def run(coro):
    return asyncio.run(coro)


def tool_answer(renderer: ChatRenderer, args: str) -> list[int]:
    return renderer.encode(f'<tool_call>\n{{"name": "Bash", "arguments": {args}}}\n</tool_call><|im_end|>')


def test_multi_turn_reuses_tokens_and_encodes_only_new_content(renderer: ChatRenderer) -> None:
    svc, eng = make(renderer)
    eid, _ = svc.create_execution()
    eng.script(tool_answer(renderer, '{"command": "ls",   "timeout": 120000.0}'), renderer.encode("all done<|im_end|>"))
    msgs = [ChatMessage("system", "You are terse."), ChatMessage("user", "list the files")]

    async def conversation() -> None:
        a = await svc.complete(req(eid, msgs))
        call = a.tool_calls[0]
        assert a.finish_reason == "tool_calls" and call.arguments == '{"command": "ls",   "timeout": 120000.0}'
        # the harness compacts the JSON and drops the .0, as Claude Code does
        resent = ToolCall(call.id, call.name, json.dumps({"command": "ls", "timeout": 120000}, separators=(",", ":")))
        msgs.extend([ChatMessage("assistant", a.content, None, (resent,)), ChatMessage("tool", "a.txt b.txt", tool_call_id=call.id)])
        b = await svc.complete(req(eid, msgs))
        assert b.content == "all done" and b.finish_reason == "stop"

    run(conversation())
    rec = svc.records(eid)
    first, second = rec.calls
    assert second.parent_id == first.node_id
    # the engine saw the first call's prompt and its sampled tokens verbatim, then only new tokens
    assert eng.calls[1].input_ids == eng.calls[0].input_ids + first.output_ids + second.new_input_ids
    assert list(eng.calls[1].input_ids) == rec.input_ids(second)
    new_text = "\n<|im_start|>user\n<tool_response>\na.txt b.txt\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert renderer.decode(second.new_input_ids) == new_text
    # restoration made the re-sent history render to exactly what one full encoding gives
    full = renderer.encode(renderer.render(rec.payloads.restore(tuple(msgs)), TOOLS, add_generation_prompt=True))
    assert list(eng.calls[1].input_ids) == full
    # provenance: only sampled tokens are targets
    node = rec.tree.node(second.node_id)
    n_in = len(second.new_input_ids)
    assert node.provenance[:n_in].tolist() == [Provenance.EXTERNAL] * n_in
    assert node.provenance[n_in:].tolist() == [Provenance.SAMPLED] * len(second.output_ids)
    assert node.logprobs[n_in:].tolist() == [-0.5] * len(second.output_ids)


def test_divergence_branches_and_unrelated_context_attaches_to_root(renderer: ChatRenderer) -> None:
    svc, eng = make(renderer)
    eid, _ = svc.create_execution()
    eng.script(renderer.encode("one<|im_end|>"), renderer.encode("two<|im_end|>"), renderer.encode("summary<|im_end|>"),
               renderer.encode("sub<|im_end|>"))
    base = [ChatMessage("system", "S"), ChatMessage("user", "task")]

    async def go() -> None:
        await svc.complete(req(eid, base))
        h1 = base + [ChatMessage("assistant", "one"), ChatMessage("user", "more")]
        await svc.complete(req(eid, h1))
        # compaction: the history is rewritten after the first turn
        await svc.complete(req(eid, base + [ChatMessage("assistant", "one"), ChatMessage("user", "summarise <summary>")]))
        # a sub-agent: its own conversation
        await svc.complete(req(eid, [ChatMessage("system", "You are a sub-agent"), ChatMessage("user", "look")], tools=(),
                               headers={"x-claude-code-agent-id": "agent-7"}))

    run(go())
    c = svc.records(eid).calls
    assert [x.parent_id for x in c] == [None, 0, 0, None]
    assert sorted(svc.records(eid).tree.leaves()) == [1, 2, 3]
    assert svc.role_of(eid, 3).name == "SUB_AGENT_TASK"
    # every recorded prompt equals what the engine got
    for call, sent in zip(c, eng.calls):
        assert svc.records(eid).input_ids(call) == list(sent.input_ids)


def test_encoded_tokens_stay_proportional_to_new_content(renderer: ChatRenderer) -> None:
    svc, eng = make(renderer)
    eid, _ = svc.create_execution()
    msgs = [ChatMessage("system", "S"), ChatMessage("user", "go")]

    async def go() -> None:
        for i in range(30):
            eng.script(renderer.encode(f"step {i} done<|im_end|>"))
            a = await svc.complete(req(eid, msgs))
            msgs.extend([ChatMessage("assistant", a.content), ChatMessage("user", f"next {i} " + "word " * 20)])

    run(go())
    calls = svc.records(eid).calls
    assert [c.parent_id for c in calls] == [None] + list(range(29))
    for i, c in enumerate(calls[1:]):
        # exactly the new user turn (plus the newline after the EOS) was encoded
        new_turn = "\n<|im_start|>user\n" + f"next {i} " + "word " * 20 + "<|im_end|>\n<|im_start|>assistant\n"
        assert renderer.decode(c.new_input_ids) == new_turn
        assert len(c.new_input_ids) == len(renderer.encode(new_turn))
    assert calls[-1].input_len > 10 * len(calls[-1].new_input_ids)


def test_credentials_isolate_executions(renderer: ChatRenderer) -> None:
    svc, eng = make(renderer)
    a, key_a = svc.create_execution()
    b, key_b = svc.create_execution()
    assert svc.authenticate(key_a) == str(a) and svc.authenticate(key_b) == str(b)
    for bad in (None, "", "gyre-nope", key_a + "x"):
        with pytest.raises(ProxyError) as e:
            svc.authenticate(bad)
        assert e.value.status == 401
    run(svc.complete(req(a, [ChatMessage("user", "hi")])))
    assert len(svc.records(a).calls) == 1 and len(svc.records(b).calls) == 0
    svc.close_execution(a)
    with pytest.raises(ProxyError) as e:
        svc.authenticate(key_a)
    assert e.value.status == 401
    with pytest.raises(ProxyError):
        run(svc.complete(req(a, [ChatMessage("user", "hi")])))
    assert len(svc.records(a).calls) == 1  # still readable, unchanged


@pytest.mark.parametrize("mode", ["abort", "vanish"])
def test_abort_during_role_change_is_retried_at_the_destination(renderer: ChatRenderer, mode: str) -> None:
    svc = ProxyService(renderer, ProxyConfig(served_models=("tiny",), retry_wait_s=5.0))
    cell = FakeEngine("http://cell-1", delay_s=0.05)
    standalone = FakeEngine("http://standalone")
    cell2 = FakeEngine("http://cell-2")
    svc.add_engine(cell, kind="cell", cell_index=1, capacity=4)
    eid, _ = svc.create_execution()
    svc.router.assign(eid)  # pinned to cell 1 (the only engine yet)
    svc.add_engine(standalone, kind="standalone", capacity=1)
    svc.add_engine(cell2, kind="cell", cell_index=2, capacity=4)
    if mode == "abort":
        cell.abort_next = 1
    else:
        cell.vanish_next = 1
    standalone.script(renderer.encode("fine<|im_end|>"))

    async def go():
        task = asyncio.ensure_future(svc.complete(req(eid, [ChatMessage("user", "hi")])))
        await asyncio.sleep(0.02)
        res = svc.reroute("http://cell-1")  # the orchestrator moves the execution away
        assert res.moved == {eid: "http://standalone"} and res.over_capacity == 0
        return await task

    out = run(go())
    (rec,) = svc.records(eid).calls
    assert rec.engine == "http://standalone" and rec.attempts == 2
    fine = tuple(renderer.encode("fine<|im_end|>"))
    prompt = list(cell.calls[0].input_ids)
    if mode == "abort":  # continued from the partial output (7, 7) on the destination
        assert rec.output_ids == (7, 7) + fine and len(rec.logprobs) == len(rec.output_ids)
        assert list(standalone.calls[0].input_ids) == prompt + [7, 7]
        assert standalone.calls[0].sampling_params["max_new_tokens"] == cell.calls[0].sampling_params["max_new_tokens"] - 2
        (node,) = [n for n in svc.records(eid).tree if n.metadata.get("engines")]
        assert node.metadata["engines"] == ["http://cell-1", "http://standalone"]
        assert svc.handoffs.summary()["reprefilled"] == 1  # the fake engine offers no KV hand-off
    else:  # the engine vanished with its partial output: generated again from the prompt
        assert out.content == "fine"
        assert rec.output_ids == fine
        assert list(standalone.calls[0].input_ids) == prompt
    assert svc.handoffs.interrupted == 1


class _HandOffEngineStandIn(FakeEngine):
    """A ``FakeEngine`` that also offers ``hand_off_kv``: it aborts the running call (as the real
    hand-off does) and reports the prefix as moved; the real one runs in integration_tests/sglang."""

    handed: list = []

    async def generate(self, input_ids, sampling_params, *, rid=None, return_logprob=True):
        self.calls.append(FakeEngineCall(rid, tuple(input_ids), dict(sampling_params)))
        while rid not in self.aborted:
            await asyncio.sleep(0.01)
        return GenerateResult(rid or "", (5, 6, 7), (-0.1, -0.2, -0.3), "abort", len(input_ids), 0, self.weight_version)

    async def hand_off_kv(self, rid, dest, *, timeout):
        self.aborted.append(rid)
        self.handed.append((rid, dest.url))
        return KVHandOff(rid, True, prefix_tokens=len(self.calls[-1].input_ids) + 3, bytes=1234)


@pytest.mark.parametrize("dest_version", ["fake-0", "fake-1"])
def test_a_handed_off_call_continues_on_its_destination(renderer: ChatRenderer, dest_version: str) -> None:
    svc = ProxyService(renderer, ProxyConfig(served_models=("tiny",), retry_wait_s=5.0))
    src = _HandOffEngineStandIn("http://src")
    src.handed = []
    dest = FakeEngine("http://dest", weight_version=dest_version)
    svc.add_engine(src, kind="cell", cell_index=0, capacity=4)
    eid, _ = svc.create_execution()
    svc.router.assign(eid)
    svc.add_engine(dest, kind="cell", cell_index=1, capacity=4)
    fine = tuple(renderer.encode("fine<|im_end|>"))
    dest.script(fine, fine)

    async def go():
        task = asyncio.ensure_future(svc.complete(req(eid, [ChatMessage("user", "hi")])))
        while not svc.inflight("http://src"):
            await asyncio.sleep(0.01)
        svc.reroute("http://src")
        outcomes = await svc.hand_off("http://src")
        return outcomes, await task

    outcomes, out = run(go())
    (rec,) = svc.records(eid).calls
    assert [o.moved for o in outcomes] == [True] and src.handed[0][1] == "http://dest"
    summary = svc.handoffs.summary()
    if dest_version == "fake-0":  # same policy: the partial and the continuation are one answer
        assert rec.output_ids == (5, 6, 7) + fine and rec.logprobs[:3] == (-0.1, -0.2, -0.3)
        assert summary["handed_off"] == 1 and summary["reprefilled"] == 0 and summary["regenerated"] == 0
        assert len(dest.calls) == 1
    else:  # the destination serves another version: never spliced, generated again from the prompt
        assert rec.output_ids == fine and rec.weight_version == "fake-1"
        assert summary["regenerated"] == 1 and len(dest.calls) == 2
        assert list(dest.calls[1].input_ids) == list(src.calls[0].input_ids)


def test_constrained_calls_are_generated_again_not_continued(renderer: ChatRenderer) -> None:
    svc = ProxyService(renderer, ProxyConfig(served_models=("tiny",), retry_wait_s=5.0,
                                             sampling={"temperature": 1.0, "regex": "fine.*"}))
    cell = FakeEngine("http://cell-1", delay_s=0.05, abort_next=1)
    other = FakeEngine("http://cell-2")
    svc.add_engine(cell, kind="cell", cell_index=1, capacity=4)
    eid, _ = svc.create_execution()
    svc.router.assign(eid)
    svc.add_engine(other, kind="cell", cell_index=2, capacity=4)
    other.script(renderer.encode("fine<|im_end|>"))

    async def go():
        task = asyncio.ensure_future(svc.complete(req(eid, [ChatMessage("user", "hi")])))
        await asyncio.sleep(0.02)
        svc.reroute("http://cell-1")
        return await task

    run(go())
    (rec,) = svc.records(eid).calls
    assert rec.output_ids == tuple(renderer.encode("fine<|im_end|>"))
    assert list(other.calls[0].input_ids) == list(cell.calls[0].input_ids)
    assert svc.handoffs.regenerated == 1


def test_reroute_order_and_capacity(renderer: ChatRenderer) -> None:
    svc = ProxyService(renderer, ProxyConfig(served_models=("tiny",)))
    src = FakeEngine("http://src")
    svc.add_engine(src, kind="cell", cell_index=0, capacity=10)
    for i in range(5):
        svc.create_execution()
        svc.router.assign(i)
    svc.add_engine(FakeEngine("http://c1"), kind="cell", cell_index=1, capacity=1)
    svc.add_engine(FakeEngine("http://c3"), kind="cell", cell_index=3, capacity=2)
    svc.add_engine(FakeEngine("http://s"), kind="standalone", capacity=1)
    res = svc.reroute("http://src")
    assert res.moved == {0: "http://s", 1: "http://c3", 2: "http://c3", 3: "http://c1", 4: res.moved[4]}
    assert res.over_capacity == 1
    assert not svc.router.slot("http://src").accepting


def test_constrained_output_is_never_a_target(renderer: ChatRenderer) -> None:
    svc, eng = make(renderer)
    eid, _ = svc.create_execution(sampling={"regex": "ok"})
    eng.script(renderer.encode("ok<|im_end|>"))
    run(svc.complete(req(eid, [ChatMessage("user", "hi")])))
    (rec,) = svc.records(eid).calls
    assert rec.constrained and rec.output_provenance is Provenance.EXTERNAL
    assert eng.calls[0].sampling_params["regex"] == "ok"
    node = svc.records(eid).tree.node(rec.node_id)
    assert int((node.provenance == Provenance.SAMPLED).sum()) == 0
    assert svc.selected(eid, 4, 0) == []


def test_sampling_comes_from_config_and_harness_may_only_lower_the_cap(renderer: ChatRenderer) -> None:
    svc, eng = make(renderer, sampling={"temperature": 0.7}, max_new_tokens=64)
    eid, _ = svc.create_execution()
    run(svc.complete(req(eid, [ChatMessage("user", "a")], max_tokens=10_000)))
    run(svc.complete(req(eid, [ChatMessage("user", "b")], max_tokens=5)))
    assert [c.sampling_params["max_new_tokens"] for c in eng.calls] == [64, 5]
    assert all(c.sampling_params["temperature"] == 0.7 for c in eng.calls)


@pytest.mark.parametrize(
    "messages",
    [
        [ChatMessage("tool", "x", tool_call_id="call_1")],
        [ChatMessage("user", "a"), ChatMessage("assistant", "", None, (ToolCall("c1", "Bash", "{}"),)),
         ChatMessage("tool", "x", tool_call_id="c2")],
        [],
    ],
)
def test_bad_requests_record_nothing(renderer: ChatRenderer, messages) -> None:
    svc, eng = make(renderer)
    eid, _ = svc.create_execution()
    with pytest.raises(ProxyError) as e:
        run(svc.complete(req(eid, messages)))
    assert e.value.status == 400
    with pytest.raises(ProxyError) as e:
        run(svc.complete(ChatRequest(str(eid), "other-model", (ChatMessage("user", "x"),))))
    assert e.value.status == 404
    assert svc.records(eid).calls == [] and eng.calls == []


def test_selected_rows_train_only_sampled_tokens(renderer: ChatRenderer) -> None:
    svc, eng = make(renderer)
    eid, _ = svc.create_execution()
    msgs = [ChatMessage("user", "a")]
    run(svc.complete(req(eid, msgs)))
    (sel,) = svc.selected(eid, 4, 0)
    row = TrajectoryRow.from_tree(svc.records(eid).tree, sel, group_id=0)
    (rec,) = svc.records(eid).calls
    assert row.loss_mask.sum().item() == len(rec.output_ids)
    assert row.token_ids.tolist() == svc.records(eid).input_ids(rec) + list(rec.output_ids)


def test_no_credential_is_ever_recorded_whatever_its_header(renderer: ChatRenderer) -> None:
    """Recorded headers are an allowlist: a secret under a name nobody foresaw stays out of the tree."""
    svc, eng = make(renderer)
    eid, _ = svc.create_execution()
    eng.script(renderer.encode("ok<|im_end|>"))
    headers = {"Authorization": "Bearer s1", "x-api-key": "s2", "x-auth-token": "s3", "anthropic-api-key": "s4",
               "x-goog-api-key": "s5", "openai-organization": "s6", "cookie": "s7", "x-gyre-agent-id": "a1",
               "user-agent": "claude-cli/2", "x-stainless-lang": "js", "x-claude-code-session-id": "sess"}
    run(svc.complete(req(eid, [ChatMessage("user", "hi")], headers=headers)))
    (node,) = [n for n in svc.records(eid).tree if n.metadata.get("headers")]
    recorded = node.metadata["headers"]
    assert recorded == {"x-gyre-agent-id": "a1", "user-agent": "claude-cli/2", "x-stainless-lang": "js",
                        "x-claude-code-session-id": "sess"}
    assert not any(f"s{i}" in json.dumps(dict(node.metadata)) for i in range(1, 8))


@pytest.mark.parametrize("eid, sampling, says", [
    (10**30, None, "execution_id must be an integer in [0, 2147483648)"),
    (-1, None, "execution_id"),
    (None, {"max_new_tokens": "abc"}, "sampling.max_new_tokens"),
    (None, {"temperature": float("nan")}, "sampling.temperature"),
    (None, {"top_p": 0}, "sampling.top_p"),
    (None, {"top_p": 5}, "sampling.top_p"),
    (None, {"seed_of_doom": 1}, "sampling.seed_of_doom: unknown"),
    (None, {"regex": 7}, "sampling.regex"),
])
def test_creation_refuses_unbounded_ids_and_bad_sampling(renderer: ChatRenderer, eid, sampling, says) -> None:
    svc, _ = make(renderer)
    with pytest.raises(ProxyError) as e:
        svc.create_execution(eid, sampling=sampling)
    assert e.value.status == 400 and says in str(e.value)
    assert svc.create_execution()[0] == 0  # nothing was registered: the next automatic id is 0


def test_one_executions_burst_of_large_requests_does_not_stall_the_others(renderer: ChatRenderer) -> None:
    """Execution 1 sends 20 calls at once whose preparation is slow (a large body); execution 2's
    one call is prepared after at most one of them, not after all 20."""
    import time as _time

    svc, _ = make(renderer)
    order: list[str] = []

    def slow_prepare(request: ChatRequest) -> str:
        _time.sleep(0.03)
        order.append(request.execution_id)
        return request.execution_id

    svc.prepare = slow_prepare  # type: ignore[method-assign]

    async def scenario() -> None:
        burst = [asyncio.ensure_future(svc.prepare_async(req(1, [ChatMessage("user", "x")]))) for _ in range(20)]
        await asyncio.sleep(0.005)  # the burst is queued first
        await svc.prepare_async(req(2, [ChatMessage("user", "y")]))
        await asyncio.gather(*burst)

    run(scenario())
    assert len(order) == 21 and order.index("2") <= 2, order
    assert svc._prepare_turns == {}  # nothing kept once every call is through


def test_an_execution_says_which_policy_versions_served_it(renderer: ChatRenderer) -> None:
    """A publication that lands while an execution runs: its later calls are served by the new
    version, and the execution says so (a held-out evaluation reads it to tell versions apart)."""
    svc, eng = make(renderer)
    eid, _ = svc.create_execution()
    eng.script(renderer.encode("one<|im_end|>"), renderer.encode("two<|im_end|>"))
    msgs = [ChatMessage("user", "count")]

    async def conversation() -> None:
        svc.policy_version = 3
        await svc.complete(req(eid, msgs))
        svc.policy_version = 4  # published meanwhile
        await svc.complete(req(eid, msgs + [ChatMessage("assistant", "one"), ChatMessage("user", "again")]))

    run(conversation())
    assert svc.policy_versions(eid) == [3, 4]


def test_a_header_cannot_move_the_main_conversation_into_another_class(renderer: ChatRenderer) -> None:
    """The agent-id header is the harness's claim: on the execution's first conversation (the one
    its task prompt started) it is ignored, so a policy cannot relabel its own task trajectories;
    a conversation of its own with the header is a sub-agent's."""
    svc, eng = make(renderer)
    eid, _ = svc.create_execution()
    eng.script(*(renderer.encode(f"a{i}<|im_end|>") for i in range(3)))
    base = [ChatMessage("system", "S"), ChatMessage("user", "task")]
    claim = {"x-claude-code-agent-id": "agent-1", "x-claude-code-parent-agent-id": "agent-0"}

    async def go() -> None:
        await svc.complete(req(eid, base, headers=claim))  # the task prompt, claiming to be a sub-agent
        await svc.complete(req(eid, base + [ChatMessage("assistant", "a0"), ChatMessage("user", "more")],
                               headers=claim))
        await svc.complete(req(eid, [ChatMessage("system", "You are a sub-agent"), ChatMessage("user", "look")],
                               tools=(), headers={"x-claude-code-agent-id": "agent-7"}))

    run(go())
    assert [x.parent_id for x in svc.records(eid).calls] == [None, 0, None]
    assert svc.role_of(eid, 1).name == "MAIN_AGENT_TASK"
    assert svc.role_of(eid, 2).name == "SUB_AGENT_TASK"
    assert {t.leaf_id: t.role.name for t in svc.selected(eid, 8, 0)}.get(1) == "MAIN_AGENT_TASK"  # what selection sees
