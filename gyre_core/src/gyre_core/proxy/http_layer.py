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

Holding against one abusive execution (:class:`WireGuard`, settings in ``ProxyConfig``) takes two
levels, because a connection's credential is only known once its request head is read:

* the connection (:class:`GuardedH11Protocol`, uvicorn's h11 protocol extended): a global cap on
  open connections, sized below the process's descriptor limit. At the cap the oldest connection
  that has sent nothing yet (then the oldest idle keep-alive one) is closed to make room, so a flood
  of idle sockets evicts itself, not the harnesses that talk. A request head must arrive complete
  within ``header_timeout_s`` of the connection (or of the previous answer): neither an idle socket
  nor a slowly written head holds a descriptor for longer. uvicorn's own ``limit_concurrency`` is
  not used: it answers a bare-text 503 once a head was read, and bounds neither idle connections nor
  the time they are held.
* the request (:class:`ExecutionLimits`, an ASGI middleware, before any route reads the body):
  ``Content-Length`` against ``max_body_bytes`` (a chunked body is counted as it arrives), then per
  execution the connections it holds, its calls in flight and its body bytes in flight. Over a cap
  the answer is 413 or 429 in the API's own shape, counted per execution
  (``ProxyService.limit_events``); no cap ever fails the run. Between two body chunks at most
  ``body_idle_timeout_s`` may pass (408).

Every answer given before the body was read whole (an early 401, 413, 429) first reads and
discards the rest of the body, within :data:`DRAIN_MAX_BYTES` and :data:`DRAIN_TIMEOUT_S`: a
client that writes its whole body before it reads (urllib, ``http.client``) would otherwise see the
connection reset instead of the answer. Discarded bytes are never buffered.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping

from gyre_core.procutil import FDS_BASE, fd_soft_limit
from gyre_core.proxy.types import ProxyError

__all__ = [
    "CONNECTION_STATE",
    "ExecutionLimits",
    "LimitRefusal",
    "MAX_HEADER_BYTES",
    "WireGuard",
    "WireLimits",
    "guarded_h11_protocol",
    "MAX_JSON_CONTAINERS",
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
MAX_JSON_CONTAINERS = 100_000
"""Most arrays and objects in a body (counted as ``[`` and ``{`` bytes, an upper bound; 413
beyond). A 200K-token Claude Code conversation with its tool schemas holds a few tens of
thousands, braces in its code included."""
MAX_TOKENS_LIMIT = 2**31 - 1
"""Largest ``max_tokens`` a harness may send (it can only lower Gyre's own cap anyway)."""
OFF_LOOP_BYTES = 256 * 1024
"""Bodies at least this large are decoded and checked in a worker thread, off the event loop."""
DRAIN_FACTOR = 4
"""An oversized body is read and discarded up to this many times the limit (and at least
:data:`DRAIN_MAX_BYTES`) before the 413, so that a client which writes its whole body before
reading (urllib) still receives the answer."""
DRAIN_MAX_BYTES = 128 * 1024 * 1024
"""Most bytes discarded after an early answer; past it the connection is closed (the peer is
sending more than any harness would). Discarding costs loop time, not memory."""
DRAIN_TIMEOUT_S = 30.0
"""Longest time spent discarding the rest of a body after an early answer."""
CONNECTION_STATE = "gyre.connection"
"""Key of a request's connection (a :class:`GuardedH11Protocol`) in the ASGI scope's ``state``."""
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
    "rate_limit": "rate_limit_error",
    "request_timeout": "invalid_request_error",
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
    "request_timeout": "timeout_error",
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
    elif err.kind == "rate_limit":
        code = "rate_limit_exceeded"
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
    limit (at least :data:`DRAIN_MAX_BYTES`): a client that writes everything before reading its
    answer would otherwise see its connection reset instead of the 413. Beyond that bound the
    connection is given up. (Under :class:`ExecutionLimits` a declared oversized body never
    reaches a route: the middleware answers it.)
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
    bound = max(DRAIN_FACTOR * max_bytes, DRAIN_MAX_BYTES)
    if declared is None or not declared.isdigit() or int(declared) <= bound:
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > bound:
                    break
        except Exception:  # noqa: BLE001 - the client went away while we drained: nothing to answer
            pass
    shown = declared if declared is not None and declared.isdigit() else f"over {max_bytes}"
    raise ProxyError(413, "request_too_large",
                     f"request body is {shown} bytes; the limit is {max_bytes} bytes")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """``parse_float`` hook: ``1e999`` is valid JSON that Python reads as ``inf``, which no
    tokenizer, sampler setting or recorder accepts."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("a number is out of range")
    return value


def check_json(obj: Any, max_depth: int = MAX_JSON_DEPTH, *, texts: bool = True) -> Any:
    """``obj`` if its nesting is at most ``max_depth``, every number is finite and (with
    ``texts``) every string is valid Unicode.

    Iterative (no recursion, whatever the depth), and it visits containers only: scalars are
    filtered out in C, so a body's cost is its arrays and objects, which :func:`decode_json`
    has already counted. Lone UTF-16 surrogates (``"\\ud800"``) are legal JSON escapes but no
    valid text: they would fail later, in the tokenizer or the recorder.
    """
    level: list[Any] = [obj]
    depth = 0
    while level:
        if depth >= max_depth:
            raise ProxyError(400, "invalid_request", f"body: nested deeper than {max_depth} levels")
        nested: list[Any] = []
        for value in level:
            if isinstance(value, dict):
                if texts:
                    for k in value:
                        _check_text(k, "body: a key")
                children = list(value.values())
            elif isinstance(value, list):
                children = value
            else:
                children = [value]
            if texts:
                for s in [c for c in children if type(c) is str]:
                    _check_text(s, "body: a string")
            for f in [c for c in children if type(c) is float]:
                if not math.isfinite(f):
                    raise ProxyError(400, "invalid_request", "body: number out of range")
            nested += [c for c in children if type(c) is dict or type(c) is list]
        level = nested
        depth += 1
    return obj


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ProxyError(400, "invalid_request", f"{where}: invalid Unicode (a lone surrogate)") from None


def _may_hold_surrogate(raw: bytes) -> bool:
    """Whether ``raw`` (valid UTF-8) has a ``\\uD800``..``\\uDFFF`` escape: the only way a
    decoded string can hold a surrogate. A cheap byte search spares a walk over every string."""
    return b"\\ud" in raw or b"\\uD" in raw


def decode_json(raw: bytes, max_containers: int = MAX_JSON_CONTAINERS) -> Any:
    """Decode and check a body (see :func:`check_json`); any defect is a 400 naming it.

    Arrays and objects are counted before the parse (every ``[`` and ``{`` byte, those inside
    strings too, so the count is an upper bound): past ``max_containers`` the body is a 413.
    Parsing and walking cost time and memory per container, and a body of 30 MB of ``[],``
    would hold the interpreter for seconds and grow the process by a gigabyte.
    """
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > max_containers:
        raise ProxyError(413, "request_too_large",
                         f"request body has {containers} '[' and '{{' characters; at most {max_containers} "
                         "arrays and objects are accepted")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProxyError(400, "invalid_request", f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise ProxyError(400, "invalid_request", f"request body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, a number too long to convert, NaN / Infinity
        reason = "a number is out of range" if "integer string conversion" in str(exc) else str(exc)
        raise ProxyError(400, "invalid_request", f"request body is not valid JSON: {reason}") from None
    return check_json(obj, texts=_may_hold_surrogate(raw))


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


# ------------------------------------------------------------------------------- limits

@dataclass(frozen=True)
class WireLimits:
    """The wire limits; ``ProxyConfig`` holds them (see the module docstring for each one's why)."""

    max_body_bytes: int = 32 * 1024 * 1024
    max_connections: int = 4096
    max_connections_per_execution: int = 64
    max_calls_per_execution: int = 32
    max_body_bytes_in_flight: int = 64 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_idle_timeout_s: float = 30.0

    @classmethod
    def of(cls, config: Any) -> "WireLimits":
        """The limits an object (a ``ProxyConfig``) names; the defaults for those it lacks."""
        import dataclasses

        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if hasattr(config, f.name)})


class LimitRefusal(ProxyError):
    """A request over a cap; ``close``: answer with ``Connection: close`` (a connection cap)."""

    def __init__(self, status: int, kind: str, message: str, *, close: bool = False) -> None:
        super().__init__(status, kind, message)
        self.close = close


@dataclass
class _Ticket:
    """One admitted request's share of its execution's in-flight counts."""

    execution_id: int | None
    counted: bool = False
    body_bytes: int = 0
    declared: bool = False


class WireGuard:
    """What both levels share (module docstring): the open connections, in the order they became
    idle, for the global cap; per execution its connections, calls and body bytes in flight.

    Used on the server's event loop only (the protocol's callbacks and the middleware), so it
    needs no lock. ``identify`` maps an API key to its execution (None: unknown); ``events``
    counts refusals (:class:`gyre_core.proxy.call_stats.LimitEvents`).
    """

    def __init__(self, limits: WireLimits, identify: Callable[[str], int | None], events: Any) -> None:
        self.limits = limits
        self.identify = identify
        self.events = events
        soft = fd_soft_limit()  # the connections' cap leaves FDS_BASE to everything else
        self.max_connections = limits.max_connections if soft is None else \
            max(16, min(limits.max_connections, soft - FDS_BASE))
        """The global cap, fitted under the descriptor limit when this guard was made."""
        self._open: set[Any] = set()
        self._fresh: OrderedDict[Any, None] = OrderedDict()  # connected, no request head yet
        self._idle: OrderedDict[Any, None] = OrderedDict()  # between two requests (keep-alive)
        self._conns: dict[int, set[Any]] = {}
        self._calls: Counter[int] = Counter()
        self._bytes: Counter[int] = Counter()

    # -- connections (GuardedH11Protocol)

    def opened(self, conn: Any) -> bool:
        """Register a new connection; at the cap, close the oldest silent one to make room.
        False: every connection is busy with a request, the new one is to be closed."""
        if len(self._open) >= self.max_connections:
            victim = next(iter(self._fresh), None)
            if victim is None:
                victim = next(iter(self._idle), None)
            if victim is None:
                self.events.count(None, "connections_refused")
                return False
            self.events.count(None, "connections_evicted")
            self.closed(victim)
            victim.evict()
        self._open.add(conn)
        self._fresh[conn] = None
        return True

    def busy(self, conn: Any) -> None:
        if conn in self._open:
            self._fresh.pop(conn, None)
            self._idle.pop(conn, None)

    def idle(self, conn: Any) -> None:
        if conn in self._open:
            self._idle[conn] = None
            self._idle.move_to_end(conn)

    def closed(self, conn: Any) -> None:
        self._open.discard(conn)
        self._fresh.pop(conn, None)
        self._idle.pop(conn, None)
        self._detach(conn)

    def _detach(self, conn: Any) -> None:
        owner = getattr(conn, "owner", None)
        if owner is not None:
            mine = self._conns.get(owner)
            if mine is not None:
                mine.discard(conn)
                if not mine:
                    del self._conns[owner]
            conn.owner = None

    def connections(self, execution_id: int) -> int:
        return len(self._conns.get(execution_id, ()))

    # -- requests (ExecutionLimits)

    def execution_of(self, scope: Mapping[str, Any]) -> int | None:
        """The execution a request's credential names, or None (the route answers the 401)."""
        wanted = {b"x-api-key": "x-api-key", b"authorization": "authorization"}
        headers: dict[str, str] = {}
        for k, v in scope.get("headers", ()):
            name = wanted.get(k)
            if name is not None:
                text = v.decode("latin-1")
                headers[name] = f"{headers[name]},{text}" if name in headers else text
        try:
            key = api_key_of(headers)
        except ProxyError:
            return None
        return self.identify(key) if key else None

    def admit(self, scope: Mapping[str, Any], declared: int | None) -> _Ticket:
        """Check a request head against the caps, before its body is read; raise the 413 / 429."""
        lim = self.limits
        eid = self.execution_of(scope)
        if declared is not None and declared > lim.max_body_bytes:
            self.events.count(eid, "body_too_large")
            raise LimitRefusal(413, "request_too_large",
                               f"request body is {declared} bytes; the limit is {lim.max_body_bytes} bytes")
        ticket = _Ticket(eid, declared=declared is not None)
        if eid is None:
            return ticket
        conn = (scope.get("state") or {}).get(CONNECTION_STATE)
        if conn is not None and conn.owner != eid:
            mine = self._conns.get(eid, set())
            if len(mine) >= lim.max_connections_per_execution:
                self.events.count(eid, "connections")
                raise LimitRefusal(429, "rate_limit", f"this execution holds {len(mine)} connections; the limit is "
                                   f"{lim.max_connections_per_execution}: reuse or close some", close=True)
            self._detach(conn)
            self._conns.setdefault(eid, set()).add(conn)
            conn.owner = eid
        if self._calls[eid] >= lim.max_calls_per_execution:
            self.events.count(eid, "calls_in_flight")
            raise LimitRefusal(429, "rate_limit", f"this execution has {self._calls[eid]} calls in flight; the "
                               f"limit is {lim.max_calls_per_execution}")
        if declared and self._bytes[eid] + declared > lim.max_body_bytes_in_flight:
            self.events.count(eid, "body_bytes_in_flight")
            raise LimitRefusal(429, "rate_limit", f"this execution has {self._bytes[eid]} request body bytes in "
                               f"flight; {declared} more would pass the limit of {lim.max_body_bytes_in_flight}")
        self._calls[eid] += 1
        ticket.counted = True
        self._reserve(ticket, declared or 0)
        return ticket

    def add_body(self, ticket: _Ticket, n: int) -> None:
        """Count ``n`` more bytes of a chunked body (a declared one was reserved whole)."""
        if ticket.declared or not ticket.counted or ticket.execution_id is None:
            return
        eid = ticket.execution_id
        self._reserve(ticket, n)
        if self._bytes[eid] > self.limits.max_body_bytes_in_flight:
            self.events.count(eid, "body_bytes_in_flight")
            raise LimitRefusal(429, "rate_limit", f"this execution has over {self.limits.max_body_bytes_in_flight} "
                               "request body bytes in flight")

    def _reserve(self, ticket: _Ticket, n: int) -> None:
        if n and ticket.execution_id is not None:
            self._bytes[ticket.execution_id] += n
            ticket.body_bytes += n

    def release(self, ticket: _Ticket) -> None:
        eid = ticket.execution_id
        if eid is None or not ticket.counted:
            return
        ticket.counted = False
        self._calls[eid] -= 1
        self._bytes[eid] -= ticket.body_bytes
        if self._calls[eid] <= 0:
            del self._calls[eid]
        if self._bytes[eid] <= 0:
            del self._bytes[eid]

    def in_flight(self, execution_id: int) -> tuple[int, int]:
        """(calls, body bytes) the execution has in flight."""
        return self._calls.get(execution_id, 0), self._bytes.get(execution_id, 0)


def _header(scope: Mapping[str, Any], name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return bytes(v)
    return None


class _Body:
    """A request's ``receive`` with the between-chunks timeout, the count of a chunked body, and
    the drain that lets a client read an early answer (module docstring)."""

    def __init__(self, receive: Callable[[], Any], guard: WireGuard, scope: Mapping[str, Any]) -> None:
        self._receive = receive
        self.guard = guard
        self.ticket: _Ticket | None = None
        length = _header(scope, b"content-length")
        self.declared = int(length) if length is not None and length.strip().isdigit() else None
        chunked = b"chunked" in (_header(scope, b"transfer-encoding") or b"").lower()
        self.done = not chunked and not self.declared  # no body at all: nothing to wait for
        self.expect_continue = (_header(scope, b"expect") or b"").lower() == b"100-continue"
        self.started = False
        self.size = 0
        self.timed_out = False
        self.close = False

    @property
    def execution_id(self) -> int | None:
        return self.ticket.execution_id if self.ticket is not None else None

    async def receive(self) -> Any:
        if self.done:
            return await self._receive()  # the body is in: a route waits for the disconnect as it likes
        self.started = True
        idle = self.guard.limits.body_idle_timeout_s
        try:
            message = await asyncio.wait_for(self._receive(), idle)
        except asyncio.TimeoutError:
            self.timed_out = True
            self.guard.events.count(self.execution_id, "body_timeout")
            raise ProxyError(408, "request_timeout", f"no request body bytes for {idle:g} s") from None
        if message["type"] != "http.request":
            self.done = True
            return message
        n = len(message.get("body", b""))
        self.size += n
        if not message.get("more_body", False):
            self.done = True
        limit = self.guard.limits.max_body_bytes
        if self.size > limit:
            self.guard.events.count(self.execution_id, "body_too_large")
            raise ProxyError(413, "request_too_large", f"request body is over {limit} bytes; the limit is {limit} bytes")
        if self.ticket is not None:
            self.guard.add_body(self.ticket, n)
        return message

    async def drain(self) -> bool:
        """Read and discard the rest of the body, within the bounds; False when given up."""
        if self.declared is not None and self.declared - self.size > DRAIN_MAX_BYTES:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_TIMEOUT_S
        drained = 0
        while not self.done:
            left = deadline - loop.time()
            if left <= 0 or drained > DRAIN_MAX_BYTES:
                return False
            try:
                message = await asyncio.wait_for(self._receive(), min(left, self.guard.limits.body_idle_timeout_s))
            except asyncio.TimeoutError:
                return False
            if message["type"] != "http.request":
                self.done = True
                return False
            drained += len(message.get("body", b""))
            self.done = not message.get("more_body", False)
        return True

    def send(self, send: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``send``, draining first when the answer starts before the body was read whole."""

        async def guarded(message: Any) -> None:
            if message["type"] == "http.response.start":
                close = self.close
                if not self.done:
                    # a client waiting for "100 Continue" has sent nothing: it reads the answer as it is
                    skip = self.timed_out or (self.expect_continue and not self.started)
                    close = close or skip or not await self.drain() or not self.done
                if close:
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        return guarded


class ExecutionLimits:
    """ASGI middleware: the request-level limits (module docstring), checked from the request head
    before any route reads the body; a refusal is rendered in the API shape of the path."""

    def __init__(self, app: Any, guard: WireGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = _Body(receive, self.guard, scope)
        try:
            ticket = self.guard.admit(scope, body.declared)
        except LimitRefusal as err:
            await self._refuse(scope, body, send, err)
            return
        body.ticket = ticket
        try:
            await self.app(scope, body.receive, body.send(send))
        finally:
            self.guard.release(ticket)

    async def _refuse(self, scope: Any, body: _Body, send: Any, err: LimitRefusal) -> None:
        from starlette.requests import Request

        response = render_error(Request(scope), err) if "app" in scope else \
            _json_response(openai_error_body(err), err.status)
        if err.status == 429:
            response.headers["retry-after"] = "1"
        body.close = err.close
        await response(scope, body.receive, body.send(send))


def _json_response(content: Any, status: int) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(content, status_code=status)


@functools.lru_cache(maxsize=1)
def guarded_h11_protocol() -> type:
    """:class:`GuardedH11Protocol`, made on first use (it subclasses uvicorn's h11 protocol)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):  # type: ignore[misc]
        """uvicorn's h11 protocol plus the connection level of the limits (module docstring): the
        global cap with eviction of silent connections, and the deadline for a complete request
        head. The request level finds the connection in ``scope["state"][CONNECTION_STATE]``."""

        def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any], _loop: Any = None, *,
                     guard: WireGuard) -> None:
            super().__init__(config, server_state, app_state, _loop)
            self.guard = guard
            self.owner: int | None = None
            """The execution whose request this connection carried last (its connection count)."""
            self.app_state = {**app_state, CONNECTION_STATE: self}
            self._head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if not self.guard.opened(self):
                transport.close()
                return
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self.guard.closed(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            super().data_received(data)
            self._started(before)

        def on_response_complete(self) -> None:
            before = self.cycle
            super().on_response_complete()
            if not self._started(before) and not self.transport.is_closing():
                self.guard.idle(self)
                self._arm()

        def _started(self, before: Any) -> bool:
            """Whether a request head completed (a new cycle): its connection is busy, untimed."""
            if self.cycle is not None and self.cycle is not before:
                self._disarm()
                self.guard.busy(self)
                return True
            return False

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(self.guard.limits.header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.guard.events.count(None, "header_timeouts")
                self.transport.close()

        def evict(self) -> None:
            """Closed to make room under the global cap (it had sent nothing since its last answer)."""
            self._disarm()
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


# ------------------------------------------------------------------------------- server

def uvicorn_config(app: Any, **kwargs: Any) -> Any:
    """uvicorn's ``Config`` for the proxy: quiet, no lifespan, a head buffer that lets oversized
    headers reach the app (see :data:`UVICORN_MAX_HEADER_EVENT`), and, for an app of
    ``build_app`` (it carries a :class:`WireGuard`), the h11 protocol with the connection limits."""
    import uvicorn

    guard = getattr(getattr(app, "state", None), "wire_guard", None)
    if isinstance(guard, WireGuard):
        kwargs.setdefault("http", functools.partial(guarded_h11_protocol(), guard=guard))
    kwargs.setdefault("log_level", "warning")
    kwargs.setdefault("lifespan", "off")
    kwargs.setdefault("h11_max_incomplete_event_size", UVICORN_MAX_HEADER_EVENT)
    return uvicorn.Config(app, **kwargs)
