"""Sampled text -> visible text, reasoning and tool calls (Qwen/Hermes markup).

Reasoning is the text inside ``<think>...</think>`` (or before a lone ``</think>`` when the
template opened the block in the prompt). Tool calls are ``<tool_call>`` blocks holding
``{"name": ..., "arguments": {...}}``; each gets a fresh call id and keeps the *exact* arguments
text the model sampled, which is what goes into the payload cache. A block that is not valid JSON
with a string ``name`` and an object ``arguments`` stays in the visible text: the harness sees
what the model wrote, nothing is invented. Valid means strict JSON that an API answer can carry:
no ``NaN``/``Infinity``, no number beyond a double's range (``1e999``, which Python reads as
``inf`` and no JSON encoder writes back), no escaped lone surrogate, and no nesting deeper than
:data:`MAX_ARGUMENTS_DEPTH` (a policy under RL does emit all of them; a deep block would fail the
JSON encoder of the answer, or the harness's next request, which echoes it, would be refused).
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

from gyre_core.proxy.types import ToolCall

__all__ = ["MAX_ARGUMENTS_DEPTH", "ParsedOutput", "new_call_id", "parse_output"]

MAX_ARGUMENTS_DEPTH = 48
"""Deepest nesting of a tool call's ``arguments`` (below the 64 levels a request body may have,
so the harness can send the call back inside its next request)."""

_TOOL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ARGS_KEY = re.compile(r'"arguments"\s*:\s*')


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)
"""Strict JSON: ``NaN``, ``Infinity`` and out-of-range numbers (which Python's decoder accepts)
make a block invalid."""


def _carriable(obj: Any) -> bool:
    """No lone surrogate (a ``\\ud800``-style escape, which no UTF-8 answer can carry) and at most
    :data:`MAX_ARGUMENTS_DEPTH` levels deep. Iterative: the depth is the policy's choice."""
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if any("\ud800" <= ch <= "\udfff" for ch in value):
                return False
        elif isinstance(value, (dict, list)):
            if depth > MAX_ARGUMENTS_DEPTH:
                return False
            items = [x for kv in value.items() for x in kv] if isinstance(value, dict) else value
            stack.extend((v, depth + 1) for v in items)
    return True


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]


def new_call_id(prefix: str = "call_") -> str:
    """A fresh, unguessable tool-call id (OpenAI style ``call_...``, Anthropic ``toolu_...``)."""
    return prefix + secrets.token_hex(12)


def _raw_arguments(block: str) -> str | None:
    """The exact text of the ``arguments`` value inside one tool-call block, or None."""
    try:
        obj, end = _DECODER.raw_decode(block.strip())
    except (ValueError, RecursionError):  # RecursionError: nested beyond the decoder's own limit
        return None
    if block.strip()[end:].strip() or not isinstance(obj, dict):
        return None
    name, args = obj.get("name"), obj.get("arguments")
    if not isinstance(name, str) or not name or not isinstance(args, dict) or not _carriable(obj):
        return None
    stripped = block.strip()
    # the *last* top-level "arguments" key is the one json.loads kept; scan candidates from the end
    for m in reversed(list(_ARGS_KEY.finditer(stripped))):
        try:
            value, stop = _DECODER.raw_decode(stripped, m.end())
        except ValueError:
            continue
        if value == args:
            return stripped[m.end():stop]
    return None  # pragma: no cover - raw_decode found the value, one candidate must match


def parse_output(text: str, *, eos_text: str = "", call_id_prefix: str = "call_") -> ParsedOutput:
    """Split one sampled answer (special tokens kept) into content, reasoning and tool calls."""
    if eos_text and text.endswith(eos_text):
        text = text[: -len(eos_text)]
    reasoning: str | None = None
    if "</think>" in text:
        head, _, text = text.partition("</think>")
        start = head.find("<think>")
        reasoning = (head[start + len("<think>"):] if start >= 0 else head).strip()
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for m in _TOOL_BLOCK.finditer(text):
        raw = _raw_arguments(m.group(1))
        if raw is None:
            continue
        name = _DECODER.decode(m.group(1).strip())["name"]
        calls.append(ToolCall(id=new_call_id(call_id_prefix), name=name, arguments=raw))
        kept.append(text[last:m.start()])
        last = m.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text.strip()
    return ParsedOutput(content=content, reasoning=reasoning, tool_calls=tuple(calls))
