"""Per-call proxy work proportional to the new content: message-trie matching and tail rendering.

* ``render_tail`` (render only the messages after a matched prefix) reproduces exactly the full
  render's suffix, over random conversations with system messages, tools, tool calls, grouped tool
  results and reasoning -- or refuses (None), never a wrong text.
* The message-by-message match finds the node the text walk over the full render finds, and the
  text it encodes is the same, over random executions (continuations, identical retries, branches,
  harness-side re-serialisation, sub-agents), also for templates that are not local (turn numbers,
  Qwen3-style reasoning dropping), where the proxy must fall back to the full render.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from gyre_core.proxy.context_index import ContextIndex
from gyre_core.proxy.fake_engine import FakeEngine
from gyre_core.proxy.render import ChatRenderer
from gyre_core.proxy.service import ProxyConfig, ProxyService
from gyre_core.proxy.types import ChatMessage, ChatRequest, ToolCall
from gyre_core.tiny_model import CHAT_TEMPLATE, cached_tiny_model

TOOLS = ({"type": "function", "function": {"name": "Bash", "description": "run a command",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}},)

# a template with global state: an assistant turn's thinking is shown only after the last user query
_QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    + CHAT_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' }}{%- if message.content %}",
        "{{- '<|im_start|>assistant\\n' }}"
        "{%- if message.reasoning_content and loop.index0 > ns.last_user %}"
        "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
        "{%- if message.content %}",
    )
)
# a template whose text for a turn depends on its position in the whole conversation
_NUMBERED = CHAT_TEMPLATE.replace("'<|im_start|>' + message.role + '\\n'", "'<|im_start|>' + message.role + ' ' + loop.index|string + '\\n'")


def _renderer(template: str | None = None) -> ChatRenderer:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(cached_tiny_model()))
    if template is not None:
        assert template != tok.chat_template
        tok.chat_template = template
    return ChatRenderer(tok)


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return _renderer()


@pytest.fixture(scope="module")
def qwen3_like() -> ChatRenderer:
    return _renderer(_QWEN3_LIKE)


@pytest.fixture(scope="module")
def numbered() -> ChatRenderer:
    return _renderer(_NUMBERED)


def _conversation(rng: random.Random, n_turns: int) -> tuple[ChatMessage, ...]:
    """A valid agent conversation: optional system, user turns, answers with tool calls and results."""
    msgs: list[ChatMessage] = []
    if rng.random() < 0.7:
        msgs.append(ChatMessage("system", rng.choice(["You are terse.", "Be careful.\nUse tools."])))
    msgs.append(ChatMessage("user", f"task {rng.randrange(100)}"))
    call_no = 0
    for t in range(n_turns):
        kind = rng.random()
        reasoning = f"think {t}" if rng.random() < 0.3 else None
        if kind < 0.4:
            calls = []
            for _ in range(rng.choice([1, 1, 2, 3])):
                call_no += 1
                calls.append(ToolCall(f"call_{call_no}", "Bash", json.dumps({"command": f"ls {call_no}"})))
            msgs.append(ChatMessage("assistant", rng.choice(["", "let me look"]), reasoning, tuple(calls)))
            for c in calls:
                msgs.append(ChatMessage("tool", f"out {c.id}\nline", tool_call_id=c.id))
            if rng.random() < 0.3:
                msgs.append(ChatMessage("user", f"also {t}"))
        else:
            msgs.append(ChatMessage("assistant", f"answer {t}", reasoning))
            if rng.random() < 0.15:
                msgs.append(ChatMessage("system", f"note {t}"))
            msgs.append(ChatMessage("user", f"next {t}"))
    return tuple(msgs)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n_turns=st.integers(1, 7), with_tools=st.booleans())
def test_tail_render_is_the_full_render_suffix(renderer: ChatRenderer, qwen3_like: ChatRenderer,
                                               numbered: ChatRenderer, seed: int, n_turns: int, with_tools: bool) -> None:
    conv = _conversation(random.Random(seed), n_turns)
    tools = TOOLS if with_tools else ()
    for r in (renderer, qwen3_like, numbered):
        for k in range(1, len(conv) + 1):
            if conv[k - 1].role != "assistant":
                continue
            head = r.render(conv[:k], tools, add_generation_prompt=False)
            for end in {k, min(k + 1, len(conv)), len(conv)}:
                for gen in (True, False):
                    full = r.render(conv[:end], tools, add_generation_prompt=gen)
                    tail = r.render_tail(conv[:end], k, tools, add_generation_prompt=gen, boundary=head)
                    if r is renderer:
                        # the tiny (ChatML/Hermes) template is local: the fast path always applies
                        assert tail is not None
                    if tail is not None and r.supports_tail_rendering():
                        assert full == head + tail


def test_probe_accepts_local_templates_and_rejects_position_dependent_ones(renderer: ChatRenderer,
                                                                          numbered: ChatRenderer) -> None:
    assert renderer.supports_tail_rendering() and renderer.tail_unsupported_reason is None
    assert not numbered.supports_tail_rendering()
    assert numbered.tail_unsupported_reason


def _answer_ids(r: ChatRenderer, rng: random.Random, i: int) -> list[int]:
    kind = rng.random()
    think = f"<think>\nplan {i}\n</think>\n\n" if rng.random() < 0.3 else ""
    if kind < 0.4:
        n = rng.choice([1, 2])
        blocks = "\n".join(
            f'<tool_call>\n{{"name": "Bash", "arguments": {{"command": "ls {i}.{j}",  "timeout": 1.0}}}}\n</tool_call>'
            for j in range(n))
        return r.encode(think + blocks + "<|im_end|>")
    if kind < 0.5:
        return r.encode(think + f"cut off {i}")  # a length-truncated answer, no EOS
    return r.encode(think + f"answer {i}<|im_end|>")


def _harness_copy(rng: random.Random, answer: ChatMessage) -> ChatMessage:
    """What a harness sends back: sometimes without the reasoning, tool arguments re-serialised."""
    reasoning = answer.reasoning if rng.random() < 0.5 else None
    calls = tuple(ToolCall(c.id, c.name, json.dumps(json.loads(c.arguments), separators=(",", ":"), sort_keys=True))
                  for c in answer.tool_calls)
    return ChatMessage("assistant", answer.content, reasoning, calls)


def _run_random_execution(r: ChatRenderer, seed: int, n_calls: int, verify: int = 0) -> ProxyService:
    rng = random.Random(seed)
    svc = ProxyService(r, ProxyConfig(served_models=("tiny",), context_window=10**9, max_new_tokens=256))
    svc.verify_tail_renders = verify  # default: test the fast path itself, not its safety net
    eng = FakeEngine("fake://x")
    svc.add_engine(eng)
    eid, _ = svc.create_execution()
    tools = TOOLS if rng.random() < 0.7 else ()
    main: list[ChatMessage] = [ChatMessage("system", "S"), ChatMessage("user", "go")]
    history: list[tuple[ChatMessage, ...]] = []  # every request sent so far

    async def one(messages: tuple[ChatMessage, ...], tl) -> ChatMessage:
        request = ChatRequest(str(eid), "tiny", messages, tl)
        prepared = svc.prepare(request)
        rec = svc.records(eid)
        # the reference: render everything, walk the text (the pre-incremental algorithm)
        full = r.render(rec.payloads.restore(messages), tl, add_generation_prompt=True)
        old = rec.index.match(full)
        assert prepared.match.node_id == old.node_id
        assert prepared.match.tail + prepared.prompt == old.tail + full[old.matched_chars:]
        assert prepared.input_ids == rec.path_ids(old.node_id) + r.encode(old.tail + full[old.matched_chars:])
        eng.script(_answer_ids(r, rng, len(rec.calls)))
        resp = await svc.execute(prepared)
        return ChatMessage("assistant", resp.content, resp.reasoning, resp.tool_calls)

    async def go() -> None:
        for i in range(n_calls):
            op = rng.random()
            if op < 0.6 or not history:  # continue the main conversation
                msgs, tl = tuple(main), tools
            elif op < 0.7:  # an identical retry of an earlier request
                msgs, tl = rng.choice(history), tools
            elif op < 0.8:  # compaction-like branch: an earlier prefix plus a different turn
                base = rng.choice(history)
                cut = rng.randrange(1, len(base) + 1)
                msgs, tl = base[:cut] + (ChatMessage("user", f"summarise {i}"),), tools
            elif op < 0.9:  # a sub-agent: its own conversation, its own tools
                msgs, tl = (ChatMessage("user", f"sub task {i % 3}"),), ()
            else:  # same conversation, tools dropped
                msgs, tl = tuple(main), ()
            history.append(msgs)
            answer = await one(msgs, tl)
            if msgs == tuple(main) and tl == tools:
                main.append(_harness_copy(rng, answer))
                for c in answer.tool_calls:
                    main.append(ChatMessage("tool", f"result of {c.id}", tool_call_id=c.id))
                if not answer.tool_calls or rng.random() < 0.3:
                    main.append(ChatMessage("user", f"next {i}"))

    asyncio.run(go())
    rec = svc.records(eid)
    for call, sent in zip(rec.calls, eng.calls):
        assert rec.input_ids(call) == list(sent.input_ids)
    return svc


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_message_match_finds_the_text_walks_node(renderer: ChatRenderer, seed: int) -> None:
    svc = _run_random_execution(renderer, seed, 14)
    stats = svc.incremental_stats()
    assert stats["full_render_fallbacks"] == 0 and stats["continuation_fallbacks"] == 0
    assert stats["tail_renders"] > 0


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_non_local_templates_fall_back_and_still_match(qwen3_like: ChatRenderer, numbered: ChatRenderer, seed: int) -> None:
    for r in (qwen3_like, numbered):
        _run_random_execution(r, seed, 10)
    assert _run_random_execution(numbered, seed, 3).incremental_stats()["tail_renders"] == 0


def test_run_time_check_disables_a_template_the_probe_missed() -> None:
    """The safety net: a non-local template that (pretending) passed the probe is caught by the
    first verified call, tail rendering is switched off, and every call still matches exactly."""
    r = _renderer(_NUMBERED)
    r._tail_supported = True  # as if the probe had not seen this shape
    svc = _run_random_execution(r, 7, 8, verify=8)
    stats = svc.incremental_stats()
    assert stats["verify_mismatches"] == 1 and not stats["tail_rendering"]
    # calls before the mismatch were verified exact; none after it was tail-rendered
    assert stats["full_render_fallbacks"] >= 1 and stats["tail_renders"] < stats["verified"]


def test_long_execution_encodes_only_new_turns_and_renders_only_tails(renderer: ChatRenderer) -> None:
    svc = ProxyService(renderer, ProxyConfig(served_models=("tiny",), context_window=10**9))
    eng = FakeEngine("fake://x", default_output=tuple(renderer.encode("ok<|im_end|>")))
    svc.add_engine(eng)
    eid, _ = svc.create_execution()
    msgs = [ChatMessage("system", "S"), ChatMessage("user", "go")]

    async def go() -> None:
        for i in range(60):
            a = await svc.complete(ChatRequest(str(eid), "tiny", tuple(msgs), TOOLS))
            msgs.extend([ChatMessage("assistant", a.content), ChatMessage("user", f"turn {i}")])

    asyncio.run(go())
    calls = svc.records(eid).calls
    assert [c.parent_id for c in calls] == [None] + list(range(59))
    stats = svc.incremental_stats()
    assert stats["root_renders"] == 1 and stats["tail_renders"] == 59 and stats["full_render_fallbacks"] == 0
    assert stats["verified"] == 8 and stats["verify_mismatches"] == 0
    for i, c in enumerate(calls[1:]):
        assert renderer.decode(c.new_input_ids) == f"\n<|im_start|>user\nturn {i}<|im_end|>\n<|im_start|>assistant\n"


def test_identical_retries_share_the_trie() -> None:
    """Many siblings with the same prompt: a request is matched by dict lookups, not by comparing siblings."""
    idx = ContextIndex()
    u = ChatMessage("user", "long prompt " * 100)
    for n in range(200):
        idx.add(n, None, f"P{n}|", "", messages=(u, ChatMessage("assistant", f"a{n}")))
    calls = []

    def equivalent(msgs, i, stored) -> bool:
        calls.append(stored)
        return False

    m = idx.match_messages("", (u, ChatMessage("assistant", "a137"), ChatMessage("user", "more")), equivalent)
    assert (m.node_id, m.matched_messages, m.matched_chars) == (137, 2, len("P137|"))
    assert calls == []  # found by hash, no sibling compared
    m = idx.match_messages("", (u, ChatMessage("assistant", "zzz")), equivalent)
    assert m.node_id is None and 0 < len(calls) <= 8  # bounded comparisons on a miss
    assert idx.match_messages("other tools", (u, ChatMessage("assistant", "a1"))).node_id is None


def test_equivalent_answer_becomes_an_alias(renderer: ChatRenderer) -> None:
    """A harness that drops reasoning the template never shows still continues the same node."""
    svc = ProxyService(renderer, ProxyConfig(served_models=("tiny",)))
    eng = FakeEngine("fake://x")
    svc.add_engine(eng)
    eid, _ = svc.create_execution()
    eng.script(renderer.encode("<think>\nhmm\n</think>\n\nhello<|im_end|>"), renderer.encode("bye<|im_end|>"),
               renderer.encode("again<|im_end|>"))
    base = [ChatMessage("system", "S"), ChatMessage("user", "hi")]

    async def go() -> None:
        a = await svc.complete(ChatRequest(str(eid), "tiny", tuple(base)))
        assert a.reasoning == "hmm"
        nxt = base + [ChatMessage("assistant", a.content), ChatMessage("user", "more")]
        await svc.complete(ChatRequest(str(eid), "tiny", tuple(nxt)))
        await svc.complete(ChatRequest(str(eid), "tiny", tuple(nxt[:3]) + (ChatMessage("user", "other"),)))

    asyncio.run(go())
    assert [c.parent_id for c in svc.records(eid).calls] == [None, 0, 0]
    assert svc.records(eid).index.aliases == 1  # rendered once, then found by hash
