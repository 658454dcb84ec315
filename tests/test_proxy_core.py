"""Parsing, tool-payload restoration and the text index of the TITO proxy (no server, no engine)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from gyre_core.proxy.context_index import ContextIndex, answer_tail
from gyre_core.proxy.parse import parse_output
from gyre_core.proxy.payloads import ToolPayloadCache
from gyre_core.proxy.render import ChatRenderer
from gyre_core.proxy.types import ChatMessage, ToolCall
from gyre_core.tiny_model import cached_tiny_model


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.from_model_dir(cached_tiny_model())


def test_parse_reasoning_content_and_tool_calls_keeps_exact_arguments() -> None:
    raw = '{"b": 1.0,  "a": "x\\u00e9"}'
    text = f'<think>\nplan\n</think>\n\nI will look.\n<tool_call>\n{{"name": "Bash", "arguments": {raw}}}\n</tool_call><|im_end|>'
    out = parse_output(text, eos_text="<|im_end|>")
    assert out.reasoning == "plan"
    assert out.content == "I will look."
    assert len(out.tool_calls) == 1
    call = out.tool_calls[0]
    assert call.name == "Bash" and call.arguments == raw and call.id.startswith("call_")


def test_parse_leaves_broken_tool_blocks_in_the_text() -> None:
    text = "<tool_call>\n{not json}\n</tool_call>"
    out = parse_output(text)
    assert out.tool_calls == () and out.content == text


def test_parse_mints_fresh_ids() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>' * 2
    ids = [c.id for c in parse_output(text, call_id_prefix="toolu_").tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("toolu_") for i in ids)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(args=st.dictionaries(st.text(min_size=1, max_size=6), json_values, max_size=4), indent=st.sampled_from([None, 1]))
def test_restoration_round_trips_to_the_sampled_tokens(renderer: ChatRenderer, args: dict, indent: int | None) -> None:
    """A harness re-serialises arguments (compact, sorted keys, ascii); restoring by id renders
    exactly the sampled text again, so the tokens are the sampled ones."""
    sampled = json.dumps(args, indent=indent, ensure_ascii=False)
    call = ToolCall("call_x", "Bash", sampled)
    cache = ToolPayloadCache()
    cache.put(call)
    resent = ToolCall("call_x", "Bash", json.dumps(json.loads(sampled), separators=(",", ":"), sort_keys=True))
    restored = cache.restore((ChatMessage("user", "go"), ChatMessage("assistant", "", None, (resent,))))
    assert restored[1].tool_calls[0] == call
    text = renderer.render(restored, add_generation_prompt=False)
    original = renderer.render((ChatMessage("user", "go"), ChatMessage("assistant", "", None, (call,))), add_generation_prompt=False)
    assert renderer.encode(text) == renderer.encode(original)


def test_restoration_keeps_a_real_edit_and_the_incoming_id() -> None:
    cache = ToolPayloadCache()
    cache.put(ToolCall("call_1", "f", '{"a": 1}'))
    edited = ToolCall("call_1", "f", '{"a": 2}')
    assert cache.restore_call(edited) == edited
    assert cache.restore_call(ToolCall("call_1", "f", '{"a":1.0}')) == ToolCall("call_1", "f", '{"a": 1}')
    assert cache.restore_call(ToolCall("call_1", "f", '{"a":true}')).arguments == '{"a":true}'  # True != 1
    unknown = ToolCall("call_9", "f", '{"a":1}')
    assert cache.restore_call(unknown) is unknown


def test_index_matches_deepest_path_branches_and_roots() -> None:
    idx = ContextIndex()
    idx.add(0, None, "SYS|U1|A1|", "\n")
    idx.add(1, 0, "U2|A2|", "")
    idx.add(2, 0, "X2|B2|", "")
    m = idx.match("SYS|U1|A1|U2|A2|U3|")
    assert (m.node_id, m.matched_chars, m.tail) == (1, len("SYS|U1|A1|U2|A2|"), "")
    m = idx.match("SYS|U1|A1|U9|")
    assert (m.node_id, m.tail) == (0, "\n")
    m = idx.match("OTHER")
    assert (m.node_id, m.matched_chars) == (None, 0)
    idx.add(3, None, None, "")  # never continued
    assert idx.match("anything").node_id is None


def test_answer_tail() -> None:
    assert answer_tail("hi<|im_end|>\n", "hi<|im_end|>", "<|im_end|>") == "\n"
    assert answer_tail("hi<|im_end|>\n", "hi", "<|im_end|>") == "<|im_end|>\n"
    # the template drops the thinking block: fall back on the EOS
    assert answer_tail("hi<|im_end|>\n", "<think>x</think>hi<|im_end|>", "<|im_end|>") == "\n"
    assert answer_tail("hi<|im_end|>\n", "<think>x</think>h", "<|im_end|>") == "<|im_end|>\n"
