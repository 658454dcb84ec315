"""The proxy's Anthropic face: ``POST /v1/messages`` (streaming and not), as Claude Code speaks it.

This module only translates. A Messages request becomes a :class:`~gyre_core.proxy.types.ChatRequest`
and a :class:`~gyre_core.proxy.types.ChatResponse` becomes a Message (or its SSE stream); rendering,
recording, tool-payload restoration and routing happen once in the API-neutral core, so a call
records the same way whichever API it came through.

Translation rules (why each one):

* ``system`` (string or text blocks) becomes the first system message; ``role: "system"``
  messages inside ``messages`` (Claude Code sends them) stay system messages in place. Text blocks
  of one message are joined with a blank line; an assistant's text blocks are joined as they are
  (they came out of one model answer).
* Assistant ``thinking`` blocks become the message's ``reasoning``; ``redacted_thinking`` is
  dropped (no text to render). ``tool_use`` blocks become tool calls whose ``arguments`` are the
  input as the harness re-sent it; the core restores the sampled text by call id.
* ``tool_result`` blocks become ``tool`` messages (string or text-block content); a tool result
  must answer a ``tool_use`` of the assistant message just before it, as in Anthropic's API.
  ``is_error`` is not rendered separately: the harness already writes the error into the content.
* Images and documents are replaced by a short placeholder (the served models read text only;
  refusing would kill an execution over a screenshot a tool returned).
* ``tools[].input_schema`` becomes OpenAI-style ``parameters``; server tools (typed tools
  without a schema) are dropped, since only the harness can run tools here.
* ``cache_control``, ``metadata``, ``context_management``, ``output_config``, ``thinking``,
  ``temperature``, ``top_p``, ``top_k``, ``stop_sequences``, ``tool_choice`` are ignored:
  sampling is Gyre's decision, not the harness's.
* ``max_tokens`` is required, as in Anthropic's API (it can only lower Gyre's own cap).
* Credentials, body limits, JSON checks, error shapes and the SSE response come from the shared
  HTTP layer (:mod:`gyre_core.proxy.http_layer`); recorded headers are an allowlist, so no
  credential ever reaches trajectory metadata.

The SSE stream of one answer is, in order::

    message_start, ping,
    (content_block_start, content_block_delta+, content_block_stop) per block:
        thinking (thinking_delta, then signature_delta), text (text_delta),
        tool_use (input_json_delta carrying the arguments text exactly as sampled),
    message_delta (stop_reason, usage), message_stop

If the answer takes longer than ``ping_after_s``, the stream is opened early and ``ping`` events
are sent every ``ping_every_s`` until it is ready, so the harness's HTTP timeout does not cut a
call that is only queued behind a role switch; an error after that point is sent as an SSE
``error`` event (the HTTP status is already 200), an error before it as a normal HTTP error.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Mapping, Protocol

from gyre_core.proxy.http_layer import (
    anthropic_error_body, api_key_of, check_headers, check_max_tokens, event_stream, read_json,
    until_done_or_gone, with_pings,
)
from gyre_core.proxy.types import ChatMessage, ChatRequest, ChatResponse, ProxyError, ToolCall, recordable_headers

if TYPE_CHECKING:
    from fastapi import APIRouter
    from starlette.requests import Request
    from starlette.responses import JSONResponse

__all__ = [
    "MAX_BODY_BYTES",
    "CompletionService",
    "make_router",
    "STOP_REASONS",
    "encode_sse",
    "error_body",
    "message_events",
    "response_message",
    "to_chat_request",
]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024
"""Largest request body accepted, as Anthropic's own limit (Claude Code histories reach MBs)."""

STOP_REASONS: Mapping[str, str] = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

_IGNORED_BLOCK_TYPES = frozenset({"redacted_thinking"})
_PLACEHOLDER = {"image": "[image omitted: text-only model]", "document": "[document omitted: text-only model]"}


# ---------------------------------------------------------------------------------------------
# errors


error_body = anthropic_error_body
"""The body Anthropic sends with an error (the shared layer's renderer)."""


def _invalid(message: str) -> ProxyError:
    return ProxyError(400, "invalid_request", message)


# ---------------------------------------------------------------------------------------------
# request: wire -> ChatRequest


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _invalid(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _text_of(blocks: Any, where: str, *, allow: frozenset[str] = frozenset({"text"})) -> list[str]:
    """Texts of a string or a list of text(-like) blocks; anything else is an invalid request."""
    if isinstance(blocks, str):
        return [blocks]
    if not isinstance(blocks, list):
        raise _invalid(f"{where}: content must be a string or a list of content blocks, got {type(blocks).__name__}")
    out: list[str] = []
    for i, block in enumerate(blocks):
        btype = block.get("type") if isinstance(block, dict) else None
        if btype == "text" and "text" in allow:
            text = block.get("text")
            if not isinstance(text, str):
                raise _invalid(f"{where}.{i}.text: must be a string")
            out.append(text)
        elif btype in _PLACEHOLDER and btype in allow:
            out.append(_PLACEHOLDER[btype])
        else:
            raise _invalid(f"{where}.{i}: unexpected content block type {btype!r}")
    return out


def _tools(raw: Any) -> tuple[dict[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _invalid("tools: must be a list")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise _invalid(f"tools.{i}: must be an object")
        ttype = tool.get("type")
        if ttype not in (None, "custom") and "input_schema" not in tool:
            log.debug("dropping server tool %r (%s)", tool.get("name"), ttype)
            continue
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _invalid(f"tools.{i}.name: required string")
        if not isinstance(schema, dict):
            raise _invalid(f"tools.{i}.input_schema: required object")
        fn: dict[str, Any] = {"name": name}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return tuple(out)


def _assistant(content: Any, where: str) -> tuple[ChatMessage, list[str]]:
    """An assistant message and the ids of its tool calls (for pairing with tool results)."""
    if isinstance(content, str):
        return ChatMessage(role="assistant", content=content), []
    if not isinstance(content, list):
        raise _invalid(f"{where}.content: must be a string or a list of content blocks")
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[ToolCall] = []
    for i, block in enumerate(content):
        btype = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{i}"
        if btype == "text":
            texts.extend(_text_of([block], where + ".content"))
        elif btype == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise _invalid(f"{at}.thinking: must be a string")
            thinking.append(block["thinking"])
        elif btype in _IGNORED_BLOCK_TYPES:
            continue
        elif btype == "tool_use":
            cid, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(cid, str) or not cid:
                raise _invalid(f"{at}.id: required string")
            if not isinstance(name, str) or not name:
                raise _invalid(f"{at}.name: required string")
            if not isinstance(args, dict):
                raise _invalid(f"{at}.input: must be an object")
            calls.append(ToolCall(id=cid, name=name, arguments=json.dumps(args, ensure_ascii=False)))
        else:
            raise _invalid(f"{at}: unexpected content block type {btype!r} in an assistant message")
    ids = [c.id for c in calls]
    if len(set(ids)) != len(ids):
        raise _invalid(f"{where}: duplicate tool_use ids")
    msg = ChatMessage(
        role="assistant",
        content="".join(texts),
        reasoning="".join(thinking) if thinking else None,
        tool_calls=tuple(calls),
    )
    return msg, ids


def _user(content: Any, where: str, open_calls: list[str]) -> list[ChatMessage]:
    """A user message: its tool results as ``tool`` messages and its text as user messages, in order."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _invalid(f"{where}.content: must be a string or a list of content blocks")
    out: list[ChatMessage] = []
    texts: list[str] = []
    answered: set[str] = set()

    def flush() -> None:
        if texts:
            out.append(ChatMessage(role="user", content="\n\n".join(texts)))
            texts.clear()

    for i, block in enumerate(content):
        btype = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{i}"
        if btype == "tool_result":
            cid = block.get("tool_use_id")
            if not isinstance(cid, str) or not cid:
                raise _invalid(f"{at}.tool_use_id: required string")
            if cid not in open_calls:
                raise _invalid(
                    f"{at}: unexpected tool_use_id {cid!r} in tool_result: each tool_result must answer a "
                    "tool_use block of the previous assistant message"
                )
            if cid in answered:
                raise _invalid(f"{at}: a second tool_result for tool_use_id {cid!r}")
            answered.add(cid)
            raw = block.get("content", "")
            result = "\n\n".join(_text_of(raw, at + ".content", allow=frozenset({"text", "image", "document"})))
            flush()
            out.append(ChatMessage(role="tool", content=result, tool_call_id=cid))
        elif btype in ("text", "image", "document"):
            texts.extend(_text_of([block], where + ".content", allow=frozenset({"text", "image", "document"})))
        else:
            raise _invalid(f"{at}: unexpected content block type {btype!r} in a user message")
    flush()
    missing = [c for c in open_calls if c not in answered]
    if missing:
        raise _invalid(
            f"{where}: tool_use ids were found without tool_result blocks immediately after: {', '.join(missing)}"
        )
    return out


def to_chat_request(body: Mapping[str, Any], *, execution_id: str, headers: Mapping[str, str]) -> ChatRequest:
    """Translate a Messages request body into the core's :class:`ChatRequest` (see module doc)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("model: required string")
    if body.get("max_tokens") is None:
        raise _invalid("max_tokens: required (the Messages API requires it)")
    max_tokens = check_max_tokens(body.get("max_tokens"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("stream: must be a boolean")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _invalid("messages: required non-empty list")

    messages: list[ChatMessage] = []
    system = body.get("system")
    if system is not None:
        messages.append(ChatMessage(role="system", content="\n\n".join(_text_of(system, "system"))))
    open_calls: list[str] = []
    for i, msg in enumerate(raw_messages):
        where = f"messages.{i}"
        if not isinstance(msg, dict):
            raise _invalid(f"{where}: must be an object")
        role, content = msg.get("role"), msg.get("content")
        if role == "assistant":
            if open_calls:
                raise _invalid(f"{where}: tool_use ids were found without tool_result blocks immediately after: "
                               + ", ".join(open_calls))
            translated, open_calls = _assistant(content, where)
            messages.append(translated)
        elif role == "user":
            messages.extend(_user(content, where, open_calls))
            open_calls = []
        elif role == "system":
            if open_calls:
                raise _invalid(f"{where}: tool_use ids were found without tool_result blocks immediately after: "
                               + ", ".join(open_calls))
            messages.append(ChatMessage(role="system", content="\n\n".join(_text_of(content, where + ".content"))))
        else:
            raise _invalid(f"{where}.role: must be 'user', 'assistant' or 'system', got {role!r}")
    # A trailing assistant message with tool_use (a prefill) is left for the core to judge.

    return ChatRequest(
        execution_id=execution_id,
        model=model,
        messages=tuple(messages),
        tools=_tools(body.get("tools")),
        max_tokens=max_tokens,
        stream=stream,
        api="anthropic",
        headers=recordable_headers(headers),
    )


# ---------------------------------------------------------------------------------------------
# answer: ChatResponse -> wire


def _signature(resp: ChatResponse) -> str:
    """Thinking blocks carry a signature in Anthropic's API; ours names the record that produced it."""
    return f"gyre:{resp.call_id}"


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _tool_input(call: ToolCall) -> dict[str, Any]:
    """The parsed input; the core only emits JSON-object arguments, anything else is sent as ``{}``."""
    if not _is_object(call.arguments):
        log.warning("tool call %s: arguments are not a JSON object; sent as {}", call.id)
        return {}
    return json.loads(call.arguments)


def _usage(resp: ChatResponse) -> dict[str, int]:
    """Anthropic counts cached prompt tokens apart from ``input_tokens``; the sum is the context size."""
    cached = min(resp.usage.cached_tokens, resp.usage.prompt_tokens)
    return {
        "input_tokens": resp.usage.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": resp.usage.completion_tokens,
    }


def _blocks(resp: ChatResponse) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if resp.reasoning:
        blocks.append({"type": "thinking", "thinking": resp.reasoning, "signature": _signature(resp)})
    if resp.content or not (resp.tool_calls or blocks):
        blocks.append({"type": "text", "text": resp.content})
    for call in resp.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _tool_input(call)})
    return blocks


def _message_id(resp: ChatResponse) -> str:
    return f"msg_{resp.call_id}"


def response_message(resp: ChatResponse, model: str) -> dict[str, Any]:
    """A non-streaming Messages answer. ``model`` is echoed as the harness named it."""
    return {
        "id": _message_id(resp),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _blocks(resp),
        "stop_reason": STOP_REASONS[resp.finish_reason],
        "stop_sequence": None,
        "usage": _usage(resp),
    }


def message_events(resp: ChatResponse, model: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The SSE events of one answer, in the order the SDKs and Claude Code expect (module doc)."""
    usage = _usage(resp)
    yield "message_start", {
        "type": "message_start",
        "message": {
            "id": _message_id(resp),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage, "output_tokens": 0},
        },
    }
    yield "ping", {"type": "ping"}
    calls = iter(resp.tool_calls)
    for index, block in enumerate(_blocks(resp)):
        btype = block["type"]
        if btype == "thinking":
            start: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": block["thinking"]},
                      {"type": "signature_delta", "signature": block["signature"]}]
        elif btype == "text":
            start = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": block["text"]}] if block["text"] else []
        else:
            call = next(calls)
            start = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            # The arguments text exactly as sampled (the SDK parses the concatenated deltas).
            text = call.arguments if _is_object(call.arguments) else "{}"
            deltas = [{"type": "input_json_delta", "partial_json": text}]
        yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": start}
        for delta in deltas:
            yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield "message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": STOP_REASONS[resp.finish_reason], "stop_sequence": None},
        "usage": usage,
    }
    yield "message_stop", {"type": "message_stop"}


def encode_sse(event: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


# ---------------------------------------------------------------------------------------------
# HTTP


class CompletionService(Protocol):
    """What this face needs of the proxy core (:class:`gyre_core.proxy.service.ProxyService`)."""

    def authenticate(self, api_key: str | None) -> str: ...

    async def complete(self, request: ChatRequest) -> ChatResponse: ...


def _error_response(exc: BaseException) -> "JSONResponse":
    from starlette.responses import JSONResponse

    if isinstance(exc, ProxyError):
        return JSONResponse(error_body(exc.kind, exc.message), status_code=exc.status)
    log.exception("internal error in /v1/messages", exc_info=exc)
    return JSONResponse(error_body("internal", f"internal error ({type(exc).__name__})"), status_code=500)


def _error_event(exc: BaseException) -> bytes:
    if isinstance(exc, ProxyError):
        return encode_sse("error", error_body(exc.kind, exc.message))
    log.exception("internal error in a /v1/messages stream", exc_info=exc)
    return encode_sse("error", error_body("engine", f"internal error ({type(exc).__name__})"))


def make_router(
    service: CompletionService,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    ping_after_s: float = 2.0,
    ping_every_s: float = 10.0,
) -> "APIRouter":
    """FastAPI routes of the Anthropic face: ``POST /v1/messages`` and harmless ``GET``/``HEAD /``."""
    from fastapi import APIRouter
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    router = APIRouter()

    @router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> Response:
        # Claude Code probes the base URL at start; answer without revealing anything.
        return JSONResponse({"status": "ok"})

    async def messages(request: Request) -> Response:
        try:
            headers = check_headers(request)
            execution_id = service.authenticate(api_key_of(headers))
            body = _object(await read_json(request, max_body_bytes))
            chat = to_chat_request(body, execution_id=execution_id, headers=headers)
        except Exception as exc:  # noqa: BLE001 - every refusal is rendered in Anthropic's shape
            return _error_response(exc)

        task: asyncio.Future[ChatResponse] = asyncio.ensure_future(service.complete(chat))
        if not chat.stream:
            try:
                await until_done_or_gone(request, task)
                return JSONResponse(response_message(task.result(), chat.model))
            except asyncio.CancelledError:
                task.cancel()
                return Response(status_code=499)
            except Exception as exc:  # noqa: BLE001
                return _error_response(exc)

        # Short calls answer before the stream opens, so their errors keep a real HTTP status.
        done, _ = await asyncio.wait({task}, timeout=ping_after_s)
        if done and task.exception() is not None:
            return _error_response(task.exception())  # type: ignore[arg-type]

        ping = encode_sse("ping", {"type": "ping"})

        async def events() -> AsyncIterator[bytes]:
            yield ping
            async for beat in with_pings(task, ping_every_s, ping):
                yield beat
            if task.exception() is not None:
                yield _error_event(task.exception())  # type: ignore[arg-type]
                return
            for event, data in message_events(task.result(), chat.model):
                yield encode_sse(event, data)

        return event_stream(events, task)

    # Annotations are strings here (postponed evaluation) naming imports local to this function,
    # which FastAPI could not resolve: hand it the classes.
    messages.__annotations__ = {"request": Request, "return": Response}
    router.add_api_route("/v1/messages", messages, methods=["POST"])
    return router
