"""Request checks that run before anything is rendered, sent or recorded (every failure is a 400).

A request that fails here leaves the execution's tree exactly as it was: nothing about it is
recorded, and no engine sees it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from gyre_core.proxy.types import ChatMessage, ProxyError

__all__ = ["validate_messages", "validate_tools"]

_ROLES = ("system", "user", "assistant", "tool")


def _bad(message: str) -> ProxyError:
    return ProxyError(400, "invalid_request", message)


def validate_messages(messages: Sequence[ChatMessage]) -> None:
    """Roles known, text is text, every tool result answers a tool call made earlier (once)."""
    if not messages:
        raise _bad("messages: at least one message is required")
    called: set[str] = set()
    answered: set[str] = set()
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise _bad(f"messages[{i}]: unknown role {m.role!r}")
        if not isinstance(m.content, str) or (m.reasoning is not None and not isinstance(m.reasoning, str)):
            raise _bad(f"messages[{i}]: content must be text")
        if m.tool_calls and m.role != "assistant":
            raise _bad(f"messages[{i}]: only assistant messages carry tool calls")
        for c in m.tool_calls:
            if not (isinstance(c.id, str) and c.id) or not (isinstance(c.name, str) and c.name):
                raise _bad(f"messages[{i}]: a tool call needs an id and a name")
            if not isinstance(c.arguments, str):
                raise _bad(f"messages[{i}]: tool call {c.id!r}: arguments must be JSON text")
            if c.id in called:
                raise _bad(f"messages[{i}]: tool call id {c.id!r} used twice")
            called.add(c.id)
        if m.role == "tool":
            if not (isinstance(m.tool_call_id, str) and m.tool_call_id):
                raise _bad(f"messages[{i}]: a tool message needs tool_call_id")
            if not called:
                raise _bad(f"messages[{i}]: tool result {m.tool_call_id!r} without a preceding tool call")
            if m.tool_call_id not in called:
                raise _bad(f"messages[{i}]: unknown tool call id {m.tool_call_id!r}")
            if m.tool_call_id in answered:
                raise _bad(f"messages[{i}]: tool call {m.tool_call_id!r} answered twice")
            answered.add(m.tool_call_id)
        elif m.tool_call_id is not None:
            raise _bad(f"messages[{i}]: tool_call_id only belongs to tool messages")


def validate_tools(tools: Sequence[Mapping[str, Any]]) -> None:
    """OpenAI-style function tools with a name; names unique."""
    names: set[str] = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise _bad(f"tools[{i}]: expected {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}]: a function tool needs a name")
        if name in names:
            raise _bad(f"tools[{i}]: tool {name!r} declared twice")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise _bad(f"tools[{i}]: parameters must be a JSON schema object")
        names.add(name)
