"""OpenAI face: ``POST /v1/chat/completions`` (streaming and not, tools, usage) <-> the core types.

Only translation lives here. Sampling fields of the request (temperature, top_p, seed, ...) are
accepted and ignored -- Gyre's configuration decides sampling -- except ``max_tokens`` /
``max_completion_tokens``, which may only lower the cap. ``n > 1`` is refused (one call, one
record). Streaming follows the chunk format the official SDK parses: a role chunk, content and
tool-call deltas, a finish chunk, an optional usage chunk, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Mapping

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from gyre_core.proxy.http_layer import (
    api_key_of, check_headers, check_max_tokens, event_stream, openai_error_body, read_json,
    register_error_renderer, until_done_or_gone, with_pings,
)
from gyre_core.proxy.service import ProxyService
from gyre_core.proxy.types import ChatMessage, ChatRequest, ChatResponse, ProxyError, ToolCall, recordable_headers

__all__ = ["openai_error", "openai_face", "request_from_openai", "response_to_openai"]

KEEPALIVE_S = 10.0
_ROLE_ALIASES = {"developer": "system"}


def openai_error(err: ProxyError) -> Response:
    return JSONResponse(openai_error_body(err), status_code=err.status)


def _bad(message: str) -> ProxyError:
    return ProxyError(400, "invalid_request", message)


def _text(content: Any, where: str) -> str:
    """OpenAI content: a string, null, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{j}]: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where}.content: expected a string or a list of text parts")


def _tool_calls(raw: Any, where: str) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _bad(f"{where}.tool_calls: expected a list")
    out = []
    for j, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(c.get("id"), str) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}.tool_calls[{j}]: expected {{id, type: function, function: {{name, arguments}}}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, (dict, list)):
            args = json.dumps(args)
        if not isinstance(args, str):
            raise _bad(f"{where}.tool_calls[{j}].function.arguments: expected JSON text")
        out.append(ToolCall(id=c["id"], name=fn["name"], arguments=args))
    return tuple(out)


def _message(raw: Any, i: int) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(raw, Mapping):
        raise _bad(f"{where}: expected an object")
    role = raw.get("role")
    role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    if role not in ("system", "user", "assistant", "tool"):
        raise _bad(f"{where}.role: unsupported role {raw.get('role')!r}")
    reasoning = raw.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise _bad(f"{where}.reasoning_content: expected a string")
    tool_call_id = raw.get("tool_call_id") if role == "tool" else None
    if role == "tool" and not isinstance(tool_call_id, str):
        raise _bad(f"{where}: a tool message needs a string tool_call_id")
    return ChatMessage(
        role=role,
        content=_text(raw.get("content"), where),
        reasoning=reasoning if role == "assistant" else None,
        tool_calls=_tool_calls(raw.get("tool_calls"), where) if role == "assistant" else (),
        tool_call_id=tool_call_id,
    )


def request_from_openai(body: Any, execution_id: str, headers: Mapping[str, str]) -> tuple[ChatRequest, bool]:
    """The core request, and whether the client asked for a usage chunk at the end of a stream."""
    if not isinstance(body, Mapping):
        raise _bad("expected a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model: required string")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages: required non-empty list")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise _bad("tools: expected a list of objects")
    n = body.get("n", 1)
    if n not in (1, None):
        raise _bad("n: only n=1 is supported")
    max_tokens = check_max_tokens(body.get("max_completion_tokens", body.get("max_tokens")))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream: expected a boolean")
    opts = body.get("stream_options") or {}
    include_usage = bool(opts.get("include_usage")) if isinstance(opts, Mapping) else False
    request = ChatRequest(
        execution_id=execution_id,
        model=model,
        messages=tuple(_message(m, i) for i, m in enumerate(msgs)),
        tools=tuple(tools),
        max_tokens=max_tokens,
        stream=stream,
        api="openai",
        headers=recordable_headers(headers),
    )
    return request, include_usage


def _usage(resp: ChatResponse) -> dict[str, Any]:
    u = resp.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _tool_call_json(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def response_to_openai(resp: ChatResponse, created: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": resp.content or None}
    if resp.reasoning is not None:
        message["reasoning_content"] = resp.reasoning
    if resp.tool_calls:
        message["tool_calls"] = [_tool_call_json(c) for c in resp.tool_calls]
    return {
        "id": "chatcmpl-" + resp.call_id,
        "object": "chat.completion",
        "created": created,
        "model": resp.model,
        "choices": [{"index": 0, "message": message, "finish_reason": resp.finish_reason, "logprobs": None}],
        "usage": _usage(resp),
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _stream(service: ProxyService, request: ChatRequest, include_usage: bool) -> Response:
    prepared = await service.prepare_async(request)  # a 4xx raised here still gets its HTTP status
    created = int(time.time())
    cid = "chatcmpl-" + prepared.call_id

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": request.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    task = asyncio.ensure_future(service.execute(prepared))

    async def events() -> AsyncIterator[bytes]:
        yield _sse(chunk({"role": "assistant", "content": ""}))
        async for ping in with_pings(task, KEEPALIVE_S, b": keep-alive\n\n"):
            yield ping
        try:
            resp = task.result()
        except ProxyError as err:
            yield _sse(openai_error_body(err))
            return
        if resp.reasoning is not None:
            yield _sse(chunk({"reasoning_content": resp.reasoning}))
        if resp.content:
            yield _sse(chunk({"content": resp.content}))
        for i, c in enumerate(resp.tool_calls):
            yield _sse(chunk({"tool_calls": [{"index": i, **_tool_call_json(c)}]}))
        yield _sse(chunk({}, resp.finish_reason))
        if include_usage:
            yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                        "model": request.model, "choices": [], "usage": _usage(resp)})
        yield b"data: [DONE]\n\n"

    return event_stream(events, task)


def openai_face(app: FastAPI, service: ProxyService) -> None:
    """Mount ``/v1/chat/completions`` and ``/v1/models``, errors in OpenAI's shape."""
    limit = service.config.max_body_bytes

    async def chat_completions(http: Request) -> Response:
        headers = check_headers(http)
        execution_id = service.authenticate(api_key_of(headers))
        body = await read_json(http, limit)
        request, include_usage = request_from_openai(body, execution_id, headers)
        if request.stream:
            return await _stream(service, request, include_usage)
        prepared = await service.prepare_async(request)
        task = asyncio.ensure_future(service.execute(prepared))
        try:
            await until_done_or_gone(http, task)
        except asyncio.CancelledError:
            return Response(status_code=499)
        return JSONResponse(response_to_openai(task.result(), int(time.time())))

    async def models(http: Request) -> Response:
        service.authenticate(api_key_of(check_headers(http)))
        return JSONResponse({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "gyre"} for m in service.config.served_models
        ]})

    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    register_error_renderer(app, "/v1/chat/", openai_error)
    register_error_renderer(app, "/v1/models", openai_error)
