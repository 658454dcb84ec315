"""The one HTTP layer both API faces and the management routes share.

Everything that touches the wire before a face translates a request lives here, once: header and
credential checks, body reading with its size limit (and the drain that lets every client read
its 413), JSON decoding with limits on nesting, numbers and Unicode, error rendering in the shape
of the API a path belongs to, server-sent-event streams with keep-alives, and the uvicorn settings
the proxy is served with. Faces import this module and nothing of each other or of ``app``, so
there is no import cycle; ``app`` mounts them.

Why each limit: a hostile or broken harness must get a clear 4xx in its API's own shape, never a
500 and never a dropped connection (that would look like an engine fault and be retried), and no
single request may stall the event loop that serves every other execution.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, AsyncIterator, Callable, Mapping

from gyre_core.proxy.types import ProxyError

__all__ = [
    "MAX_HEADER_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_KEY_CHARS",
    "MAX_TOKENS_LIMIT",
    "anthropic_error_body",
    "api_key_of",
    "check_headers",
    "check_json",
    "check_max_tokens",
    "decode_json",
    "event_stream",
    "headers_of",
    "openai_error_body",
    "read_body",
    "read_json",
    "register_error_renderer",
    "render_error",
    "uvicorn_config",
    "until_done_or_gone",
    "with_pings",
]

MAX_HEADER_BYTES = 64 * 1024
"""Total size of a request's header names and values (431 beyond)."""
MAX_KEY_CHARS = 512
"""Longest credential looked up; Gyre's keys are 48 characters (401 beyond, without a lookup)."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects in a body; tool schemas in practice stay below 20."""
MAX_TOKENS_LIMIT = 2**31 - 1
"""Largest ``max_tokens`` a harness may send (it can only lower Gyre's own cap anyway)."""
OFF_LOOP_BYTES = 256 * 1024
"""Bodies at least this large are decoded and checked in a worker thread, off the event loop."""
DRAIN_FACTOR = 4
"""An oversized body is read and discarded up to this many times the limit before the 413, so
that a client which writes its whole body before reading (urllib) still receives the answer."""
UVICORN_MAX_HEADER_EVENT = 1024 * 1024
"""h11's buffer for an incomplete request head: large enough that an oversized header reaches the
app and gets its 431 in the API's shape instead of a bare 400 or a reset."""


# ------------------------------------------------------------------------------------ errors

_OPENAI_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "request_too_large": "invalid_request_error",
    "headers_too_large": "invalid_request_error",
    "unsupported_media_type": "invalid_request_error",
    "overloaded": "server_error",
    "engine": "server_error",
    "conflict": "invalid_request_error",
    "permission": "permission_error",
    "internal": "server_error",
}

_ANTHROPIC_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "request_too_large": "request_too_large",
    "headers_too_large": "invalid_request_error",
    "unsupported_media_type": "invalid_request_error",
    "conflict": "invalid_request_error",
    "rate_limit": "rate_limit_error",
    "overloaded": "overloaded_error",
    "engine": "api_error",
}


def openai_error_body(err: ProxyError) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "code", "param"}}``."""
    code = err.kind
    if err.status == 404 and err.message.startswith("model "):
        code = "model_not_found"
    elif err.message.startswith("context_length_exceeded"):
        code = "context_length_exceeded"
    return {"error": {"message": err.message, "type": _OPENAI_TYPES.get(err.kind, "invalid_request_error"),
                      "code": code, "param": None}}


def anthropic_error_body(kind: str, message: str) -> dict[str, Any]:
    """Anthropic's error shape, which its SDKs turn into typed exceptions."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(kind, "api_error"), "message": message}}


ErrorRenderer = Callable[[ProxyError], Any]


def register_error_renderer(app: Any, prefix: str, renderer: ErrorRenderer) -> None:
    """Render every error under ``prefix`` with ``renderer`` (longest prefix wins)."""
    app.state.error_renderers.append((prefix, renderer))
    app.state.error_renderers.sort(key=lambda p: -len(p[0]))


def render_error(request: Any, err: ProxyError) -> Any:
    """The response for ``err`` in the shape of the API that ``request``'s path belongs to."""
    from starlette.responses import JSONResponse

    for prefix, fn in request.app.state.error_renderers:
        if request.url.path.startswith(prefix):
            return fn(err)
    return JSONResponse(openai_error_body(err), status_code=err.status)


# ------------------------------------------------------------------------------- headers

def headers_of(request: Any) -> dict[str, str]:
    """Request headers, names lower-cased (repeated headers joined by ``,``)."""
    out: dict[str, str] = {}
    for k, v in request.headers.items():
        out[k] = f"{out[k]},{v}" if k in out else v
    return out


def check_headers(request: Any) -> dict[str, str]:
    """The lower-cased headers, or 431 when they are larger than :data:`MAX_HEADER_BYTES`."""
    size = sum(len(k) + len(v) for k, v in request.headers.raw)
    if size > MAX_HEADER_BYTES:
        raise ProxyError(431, "headers_too_large",
                         f"request headers are {size} bytes; the limit is {MAX_HEADER_BYTES}")
    return headers_of(request)


def api_key_of(headers: Mapping[str, str]) -> str | None:
    """The credential of lower-cased headers: ``x-api-key``, else ``Authorization: Bearer``.

    A key too long or not printable ASCII is refused here (401) rather than looked up: Gyre's keys
    are short URL-safe text, and the check keeps oversized or binary keys out of the hash.
    """
    key = (headers.get("x-api-key") or "").strip()
    if not key:
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else ""
    if not key:
        return None
    if len(key) > MAX_KEY_CHARS or not key.isascii() or not key.isprintable():
        raise ProxyError(401, "authentication", "malformed API key")
    return key


# ---------------------------------------------------------------------------------- bodies

async def read_body(request: Any, max_bytes: int) -> bytes:
    """The body, or 413 once it is known to exceed ``max_bytes`` (never buffered whole).

    Before the 413 the rest of the body is read and discarded, up to ``DRAIN_FACTOR`` times the
    limit: a client that writes everything before reading its answer would otherwise see its
    connection reset instead of the 413. Beyond that bound the connection is given up.
    """
    declared = request.headers.get("content-length")
    size = 0
    chunks: list[bytes] = []
    too_large = declared is not None and declared.isdigit() and int(declared) > max_bytes
    if not too_large:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                too_large = True
                break
            chunks.append(chunk)
        else:
            return b"".join(chunks)
    chunks.clear()
    if declared is None or not declared.isdigit() or int(declared) <= DRAIN_FACTOR * max_bytes:
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > DRAIN_FACTOR * max_bytes:
                    break
        except Exception:  # noqa: BLE001 - the client went away while we drained: nothing to answer
            pass
    shown = declared if declared is not None and declared.isdigit() else f"over {max_bytes}"
    raise ProxyError(413, "request_too_large",
                     f"request body is {shown} bytes; the limit is {max_bytes} bytes")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def check_json(obj: Any, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``obj`` if its nesting is at most ``max_depth`` and every string is valid Unicode.

    Iterative (no recursion, whatever the depth). Lone UTF-16 surrogates (``"\\ud800"``) are legal
    JSON escapes but no valid text: they would fail later, in the tokenizer or the recorder.
    """
    stack: list[tuple[Any, int, str]] = [(obj, 0, "body")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, (dict, list)):
            if depth >= max_depth:
                raise ProxyError(400, "invalid_request", f"{where}: nested deeper than {max_depth} levels")
            if isinstance(value, dict):
                for k, v in value.items():
                    _check_text(k, f"{where}: a key")
                    stack.append((v, depth + 1, f"{where}.{k}" if len(where) < 200 else where))
            else:
                for i, v in enumerate(value):
                    stack.append((v, depth + 1, f"{where}[{i}]" if len(where) < 200 else where))
        elif isinstance(value, float) and not math.isfinite(value):
            raise ProxyError(400, "invalid_request", f"{where}: number out of range")
    return obj


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ProxyError(400, "invalid_request", f"{where}: invalid Unicode (a lone surrogate)") from None


def decode_json(raw: bytes) -> Any:
    """Decode and check a body (see :func:`check_json`); any defect is a 400 naming it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProxyError(400, "invalid_request", f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ProxyError(400, "invalid_request", f"request body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, a number too long to convert, NaN / Infinity
        reason = "a number is out of range" if "integer string conversion" in str(exc) else str(exc)
        raise ProxyError(400, "invalid_request", f"request body is not valid JSON: {reason}") from None
    return check_json(obj)


async def read_json(request: Any, max_bytes: int, *, empty: Any = None) -> Any:
    """The body as checked JSON after the content-type check; ``empty`` for an empty body if given.

    Large bodies are decoded in a worker thread so the event loop keeps serving other requests.
    """
    raw = await read_body(request, max_bytes)
    if empty is not None and not raw.strip():
        return empty
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise ProxyError(415, "unsupported_media_type",
                         f"Content-Type must be application/json, got {ctype or 'none'!r}")
    if len(raw) >= OFF_LOOP_BYTES:
        return await asyncio.to_thread(decode_json, raw)
    return decode_json(raw)


def check_max_tokens(value: Any, name: str = "max_tokens") -> int | None:
    """A harness's ``max_tokens``: absent, or an integer in 1..:data:`MAX_TOKENS_LIMIT`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise ProxyError(400, "invalid_request", f"{name}: must be an integer in 1..{MAX_TOKENS_LIMIT}")
    return value


# ------------------------------------------------------------------------------- calls

async def until_done_or_gone(request: Any, task: asyncio.Future[Any], poll_s: float = 0.5) -> None:
    """Wait for ``task``; cancel it if the client goes away (the core then aborts the engine call)."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return
        if await request.is_disconnected():
            task.cancel()
            raise asyncio.CancelledError("client disconnected")


async def with_pings(task: asyncio.Future[Any], every_s: float, ping: bytes) -> AsyncIterator[bytes]:
    """Yield ``ping`` every ``every_s`` while ``task`` runs (keeps the harness's read timeout at bay)."""
    while not task.done():
        await asyncio.wait({task}, timeout=every_s)
        if not task.done():
            yield ping


def event_stream(events: Callable[[], AsyncIterator[bytes]], task: asyncio.Future[Any]) -> Any:
    """A server-sent-event response over ``events()``; the engine call ``task`` is cancelled if the
    client goes away before it finished (nothing is recorded for it)."""
    from starlette.responses import StreamingResponse

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in events():
                yield chunk
        finally:
            if not task.done():
                task.cancel()

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


# ------------------------------------------------------------------------------- server

def uvicorn_config(app: Any, **kwargs: Any) -> Any:
    """uvicorn's ``Config`` for the proxy: quiet, no lifespan, a head buffer that lets oversized
    headers reach the app (see :data:`UVICORN_MAX_HEADER_EVENT`)."""
    import uvicorn

    kwargs.setdefault("log_level", "warning")
    kwargs.setdefault("lifespan", "off")
    kwargs.setdefault("h11_max_incomplete_event_size", UVICORN_MAX_HEADER_EVENT)
    return uvicorn.Config(app, **kwargs)
