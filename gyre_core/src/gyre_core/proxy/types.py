"""The proxy's API-neutral request and answer: what both HTTP faces translate to and from.

The OpenAI face (``openai_api``) and the Anthropic face (``anthropic_api``) only translate
between their wire format and these types; rendering to token ids, recording, tool-payload
restoration and routing happen once, in the API-neutral core (``records``/``service``), so both
APIs record exactly the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

__all__ = ["ChatMessage", "ChatRequest", "ChatResponse", "ProxyError", "ToolCall", "Usage"]


class ProxyError(Exception):
    """A request the proxy refuses; each face renders it in its API's own error shape.

    ``kind`` is a stable machine-readable category (``invalid_request``, ``authentication``,
    ``not_found``, ``request_too_large``, ``overloaded``, ``engine``); ``status`` the HTTP status.
    """

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class ToolCall:
    """One tool call. ``arguments`` is the JSON text of the arguments *as this side has it*: on
    the way in, as the harness re-sent it (possibly re-serialised); on the way out, exactly as the
    model produced it. ``id`` is the call id the harness sees and sends back."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    """One message in API-neutral form.

    ``role`` is ``system``, ``user``, ``assistant`` or ``tool``. ``content`` is plain text (blocks
    already joined by the face). ``reasoning`` is an assistant message's thinking text, if any.
    ``tool_calls`` belong to assistant messages; ``tool_call_id`` to tool messages (a tool result).
    """

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True)
class ChatRequest:
    """A model call, as the core sees it.

    ``tools`` are OpenAI-style function tools (``{"type": "function", "function": {"name",
    "description", "parameters"}}``); the Anthropic face converts ``input_schema`` to
    ``parameters``. ``max_tokens`` is the harness's cap (the proxy may lower it, never raise it).
    ``headers`` are the request's HTTP headers, lower-cased (role classification reads the
    harness's agent-id headers from them). ``api`` names the face the call came through.
    """

    execution_id: str
    model: str
    messages: tuple[ChatMessage, ...]
    tools: tuple[Mapping[str, Any], ...] = ()
    max_tokens: int | None = None
    stream: bool = False
    api: Literal["openai", "anthropic"] = "openai"
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class ChatResponse:
    """The parsed answer of one model call.

    ``content`` is the visible text, ``reasoning`` the thinking text (between ``<think>`` tags),
    ``tool_calls`` with fresh ids minted by the proxy (the payload cache maps them back to the
    exact arguments text sampled). ``finish_reason`` is ``"stop"``, ``"length"`` or
    ``"tool_calls"``. ``call_id`` identifies the record of this call in its execution.
    """

    call_id: str
    model: str
    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: Literal["stop", "length", "tool_calls"]
    usage: Usage


RECORDED_HEADERS = frozenset({"user-agent", "anthropic-version", "anthropic-beta", "x-app", "content-type",
                              "accept", "openai-beta"})
"""Request headers the proxy may keep (in a call's metadata, hence trajectories and the journal),
besides those under :data:`RECORDED_HEADER_PREFIXES`. An allowlist: a credential under a name
nobody foresaw (``x-auth-token``, ``anthropic-api-key``, ``x-goog-api-key``...) is never recorded."""

RECORDED_HEADER_PREFIXES = ("x-gyre-", "x-claude-code-", "x-stainless-", "x-agent-")
"""Header families that describe the harness and its agents (ids, SDK versions), never credentials."""


def recordable_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` lower-cased and cut down to the allowlist (:data:`RECORDED_HEADERS`, prefixes)."""
    out: dict[str, str] = {}
    for k, v in headers.items():
        name = str(k).lower()
        if (name in RECORDED_HEADERS or name.startswith(RECORDED_HEADER_PREFIXES)) and "key" not in name \
                and "token" not in name and "auth" not in name and "secret" not in name:
            out[name] = v
    return out
