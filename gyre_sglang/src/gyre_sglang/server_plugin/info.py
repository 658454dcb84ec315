"""``GET /gyre/info``: proves the plugin is loaded in the HTTP server (and which version)."""

from __future__ import annotations

import os


def register() -> None:
    from gyre_sglang import __version__

    try:
        from sglang.srt.entrypoints.http_server import app
    except Exception:  # not the HTTP server process (or a different SGLang layout)
        return
    if any(getattr(r, "path", None) == "/gyre/info" for r in app.routes):
        return

    async def gyre_info() -> dict:
        return {"plugin": "gyre-sglang", "version": __version__, "pid": os.getpid()}

    app.add_api_route("/gyre/info", gyre_info, methods=["GET"])
