"""Every ``/gyre/`` route of the plugin needs the run's engine key (``Authorization: Bearer``).

The key comes from ``GYRE_ENGINE_KEY``, which :class:`gyre_sglang.server.SGLangServer` sets and
:mod:`gyre_sglang.launch_server` also makes SGLang's own API key (never ``--api-key``: a command
line is world-readable), so generate and weight updates are guarded by SGLang, the plugin's routes
by this check, whatever SGLang's own auth rules become. Without the
variable the routes are refused outright (403): a server someone started by hand with the plugin
enabled must not expose KV export, aborts and weight loading to anyone who reaches its port.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

PREFIX = "/gyre/"


def _refusal(status: int, message: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"type": "authentication_error" if status == 401 else "permission_error",
                                   "message": message}}, status_code=status)


class EngineKeyGuard:
    """Plain ASGI middleware: requests under ``/gyre/`` without the engine key never reach a route."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            key = os.environ.get("GYRE_ENGINE_KEY", "")
            if not key:
                await _refusal(403, "GYRE_ENGINE_KEY is not set on this engine: its /gyre/ routes are closed")(
                    scope, receive, send)
                return
            given = b""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    given = value
            if not hmac.compare_digest(given, b"Bearer " + key.encode()):
                await _refusal(401, "the engine key is required on /gyre/ routes")(scope, receive, send)
                return
        await self.inner(scope, receive, send)


def register() -> None:
    try:
        from sglang.srt.entrypoints.http_server import app
    except Exception:  # not the HTTP server process
        return
    if getattr(app.state, "gyre_key_guard", False):
        return
    app.state.gyre_key_guard = True
    app.add_middleware(EngineKeyGuard)
