"""A small request/reply side channel from the HTTP server process into the scheduler's own loop.

Why a side channel: the radix tree, the token pools and the KV pool live in the scheduler process
and are not thread-safe, and SGLang's existing control paths do not fit. ``RpcReqInput`` (used by
``Engine.collective_rpc``) is not reachable from the HTTP server and only answers success/message;
the tokenizer manager's typed communicators need a new request *and* output type registered in
three processes. Instead, the scheduler (rank 0) binds a ZMQ ROUTER socket on an IPC path derived
from the server's host and port, and polls it without blocking once per scheduler iteration (an
``ingest_requests`` hook), so every operation runs *between* batches, on the scheduler thread.
When SGLang's idle sleeper is on, the socket is added to its poller so a request wakes it.

Messages are JSON: ``{"op": name, "key": K, ...}`` in, ``{"ok": true, ...}`` or ``{"ok": false,
"error": msg}`` out. Handlers are plain functions ``(scheduler, message) -> dict`` registered with
:func:`op`.

Who may talk to it: only the engine's own processes. The socket lives in the server's ``TMPDIR``
(a private 0700 folder Gyre gives each server), and every message must carry the server's API key
(``server_args.api_key``), compared in constant time; a message without it is refused before any
handler runs. Without the key, the channel would hand out another execution's token ids
(``kv_handle``), release its pins or import KV under chosen tokens, bypassing the engine's key.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import tempfile
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

Handler = Callable[[Any, dict[str, Any]], dict[str, Any]]
_HANDLERS: dict[str, Handler] = {}
_TICKS: list[Callable[[Any], None]] = []


class ChannelError(RuntimeError):
    """The scheduler side channel did not answer, or answered with an error."""


def ipc_path(host: str, port: int) -> str:
    """The IPC endpoint of the scheduler channel of the server listening on ``host:port``."""
    safe = host.replace(":", "_").replace("/", "_")
    return "ipc://" + os.path.join(tempfile.gettempdir(), f"gyre-sched-{safe}-{port}.ipc")


def op(name: str) -> Callable[[Handler], Handler]:
    """Register a scheduler-side handler for ``{"op": name}`` messages."""

    def deco(fn: Handler) -> Handler:
        _HANDLERS[name] = fn
        return fn

    return deco


def on_tick(fn: Callable[[Any], None]) -> Callable[[Any], None]:
    """Register a function called with the scheduler once per iteration (e.g. lease expiry)."""
    _TICKS.append(fn)
    return fn


class SchedulerEndpoint:
    """The scheduler-side socket; :meth:`poll` serves every pending message without blocking."""

    def __init__(self, scheduler: Any) -> None:
        import zmq

        args = scheduler.server_args
        self.key: str | None = getattr(args, "api_key", None)
        self.address = ipc_path(args.host, int(args.port))
        path = self.address[len("ipc://"):]
        if os.path.exists(path):
            os.unlink(path)  # a stale socket file from a killed server on the same port
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.address)
        import atexit

        atexit.register(lambda: os.path.exists(path) and os.unlink(path))  # a SIGKILL leaves it behind
        self._zmq = zmq
        sleeper = getattr(scheduler, "idle_sleeper", None)
        poller = getattr(sleeper, "poller", None)
        if poller is not None:
            poller.register(self.sock, zmq.POLLIN)
        logger.info("gyre scheduler channel listening on %s", self.address)

    def poll(self, scheduler: Any) -> None:
        for tick in _TICKS:
            try:
                tick(scheduler)
            except Exception:  # a tick must never take the scheduler down
                logger.exception("gyre scheduler tick failed")
        while True:
            try:
                frames = self.sock.recv_multipart(flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                return
            ident, body = frames[0], frames[-1]
            reply = _dispatch(scheduler, body, self.key)
            self.sock.send_multipart([ident, b"", json.dumps(reply).encode()])


def authorised(msg: Any, key: str | None) -> bool:
    """The message carries the server's key (an engine without a key serves no channel op)."""
    given = msg.get("key") if isinstance(msg, dict) else None
    return bool(key) and isinstance(given, str) and hmac.compare_digest(given.encode(), str(key).encode())


def _dispatch(scheduler: Any, body: bytes, key: str | None) -> dict[str, Any]:
    try:
        msg = json.loads(body)
        if not authorised(msg, key):
            return {"ok": False, "error": "refused: the message does not carry the engine's key"}
        msg.pop("key", None)
        handler = _HANDLERS.get(msg.get("op", ""))
        if handler is None:
            return {"ok": False, "error": f"unknown op {msg.get('op')!r}; known: {sorted(_HANDLERS)}"}
        out = handler(scheduler, msg)
        return {"ok": True, **out}
    except Exception as exc:  # reported to the caller, never raised into the scheduler loop
        logger.exception("gyre scheduler op failed")
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _is_channel_rank(scheduler: Any) -> bool:
    """Only the first scheduler (TP rank 0, DP rank 0/None) owns the channel."""
    tp_rank = getattr(scheduler, "tp_rank", 0) or 0
    dp_rank = getattr(scheduler, "dp_rank", 0) or 0
    return tp_rank == 0 and dp_rank == 0


def ingest_hook(original_fn: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on ``Scheduler.ingest_requests``: serve the channel, then SGLang's own intake."""
    endpoint = self.__dict__.get("_gyre_channel", False)
    if endpoint is False:
        endpoint = None
        if _is_channel_rank(self):
            try:
                endpoint = SchedulerEndpoint(self)
            except Exception:
                logger.exception("gyre scheduler channel could not start")
        self.__dict__["_gyre_channel"] = endpoint
    if endpoint is not None:
        endpoint.poll(self)
    return original_fn(self, *args, **kwargs)


_installed = False


def install_scheduler_hook() -> None:
    """Register the ``ingest_requests`` hook with SGLang's HookRegistry (once per process)."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.ingest_requests", ingest_hook, HookType.AROUND
    )
    _installed = True


async def call(host: str, port: int, message: dict[str, Any], timeout: float = 30.0, *,
               key: str | None = None) -> dict[str, Any]:
    """Send one message to the scheduler of ``host:port`` and wait for its reply (HTTP process
    side); ``key`` is the server's API key, which the scheduler requires."""
    import asyncio

    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(ipc_path(host, port))
        await sock.send_multipart([b"", json.dumps({**message, "key": key}).encode()])
        t0 = time.monotonic()
        try:
            frames = await asyncio.wait_for(sock.recv_multipart(), timeout)
        except asyncio.TimeoutError:
            raise ChannelError(
                f"scheduler did not answer {message.get('op')!r} within {timeout:.0f} s "
                f"({time.monotonic() - t0:.1f} s waited)"
            ) from None
        return dict(json.loads(frames[-1]))
    finally:
        sock.close()
