"""Request-body reading and client-disconnect watching shared by both API faces.

Kept free of FastAPI imports at module level (requests are duck-typed Starlette ``Request``s) so
each face uses the same limits and the same cancellation without importing the other.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gyre_core.proxy.types import ProxyError

__all__ = ["read_body", "until_done_or_gone"]


async def read_body(request: Any, max_bytes: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed ``max_bytes`` -- never buffered whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ProxyError(413, "request_too_large", f"request body is {declared} bytes; the limit is {max_bytes}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ProxyError(413, "request_too_large", f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def until_done_or_gone(request: Any, task: asyncio.Future[Any], poll_s: float = 0.5) -> None:
    """Wait for ``task``; cancel it if the client goes away (the core then aborts the engine call)."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return
        if await request.is_disconnected():
            task.cancel()
            raise asyncio.CancelledError("client disconnected")
