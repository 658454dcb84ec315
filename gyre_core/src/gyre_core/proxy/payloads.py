"""The tool-call payload cache: call id -> the exact arguments text the model sampled.

Harnesses re-serialise tool-call arguments before sending history back (Claude Code compacts JSON,
unescapes unicode, writes ``120000.0`` as ``120000`` and fixes key orders; see
``notes/claude-code-harness.md``). Rendering that history would not reproduce the sampled tokens,
so before rendering, the proxy puts the sampled text back by call id -- but only when the incoming
arguments still *mean* the same JSON: a harness that really edited a call gets its edit rendered
(a divergence, hence a new branch), not silently overwritten.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from gyre_core.proxy.types import ChatMessage, ToolCall

__all__ = ["CachedPayload", "ToolPayloadCache"]

_UNPARSED = object()


@dataclass(frozen=True)
class CachedPayload:
    name: str
    arguments: str
    """Exactly the arguments text inside the sampled ``<tool_call>`` block."""


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return _UNPARSED


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values (``120000.0 == 120000``; key order and spacing ignored; no bool/int mixing)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


class ToolPayloadCache:
    """Per-execution map from a tool-call id the proxy minted to the payload it sampled."""

    def __init__(self) -> None:
        self._by_id: dict[str, CachedPayload] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._by_id

    def put(self, call: ToolCall) -> None:
        self._by_id[call.id] = CachedPayload(call.name, call.arguments)

    def get(self, call_id: str) -> CachedPayload | None:
        return self._by_id.get(call_id)

    def restore_call(self, call: ToolCall) -> ToolCall:
        """``call`` with the sampled arguments text if the incoming one means the same; id kept."""
        cached = self._by_id.get(call.id)
        if cached is None or cached.name != call.name:
            return call
        if call.arguments == cached.arguments:
            return call
        incoming, original = _loads(call.arguments), _loads(cached.arguments)
        if incoming is _UNPARSED or original is _UNPARSED or not _same_json(incoming, original):
            return call
        return replace(call, arguments=cached.arguments)

    def restore(self, messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
        """Messages with every known assistant tool call's payload restored."""
        if not self._by_id:
            return messages
        out = []
        for m in messages:
            if m.role == "assistant" and m.tool_calls:
                calls = tuple(self.restore_call(c) for c in m.tool_calls)
                if calls != m.tool_calls:
                    m = replace(m, tool_calls=calls)
            out.append(m)
        return tuple(out)
