"""Intake gate and in-flight listing: the first steps of a serving side's switch to training.

- ``POST /gyre/intake {"open": false}`` closes the gate: new generation requests (``/generate``,
  ``/v1/...``) get ``503`` with ``{"error": {"type": "engine_leaving_rollout", ...}}`` at once, so
  the proxy retries them on another engine instead of queueing them on one about to stop.
  Requests already admitted keep running until they are handed off or aborted.
- ``GET /gyre/requests`` lists the rids the engine is working on (the tokenizer manager's own
  table), which are the requests the orchestrator must re-route.
- ``GET /gyre/intake`` reports the gate's state.
- ``POST /gyre/abort {"rid"}`` aborts one request and answers 404 for a rid the engine does not
  know (SGLang's own ``/abort_request`` ignores unknown rids silently, which hides routing bugs).
"""

from __future__ import annotations

from typing import Any

GATED_PREFIXES = ("/generate", "/v1/")

_state: dict[str, Any] = {"open": True}


def register() -> None:
    try:
        from sglang.srt.entrypoints import http_server
    except Exception:  # not the HTTP server process
        return
    app = http_server.app
    if any(getattr(r, "path", None) == "/gyre/intake" for r in app.routes):
        return
    from fastapi.responses import JSONResponse

    class IntakeGate:
        """Plain ASGI middleware (outermost): answers gated requests itself while closed."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
            if (scope["type"] == "http" and not _state["open"] and scope["method"] == "POST"
                    and scope["path"].startswith(GATED_PREFIXES)):
                refusal = JSONResponse(
                    {"error": {"type": "engine_leaving_rollout",
                               "message": "this engine is leaving rollout; retry on another engine"}},
                    status_code=503,
                )
                await refusal(scope, receive, send)
                return
            await self.inner(scope, receive, send)

    app.add_middleware(IntakeGate)

    async def set_intake(body: dict) -> dict:
        if not isinstance(body.get("open"), bool):
            return JSONResponse({"error": {"type": "invalid_request", "message": "'open' must be a boolean"}},
                                status_code=400)
        _state["open"] = body["open"]
        return {"open": _state["open"]}

    async def get_intake() -> dict:
        return {"open": _state["open"]}

    async def in_flight() -> dict:
        tm = http_server.get_global_state().tokenizer_manager
        return {"rids": sorted(str(r) for r in list(tm.rid_to_state.keys()))}

    async def abort_known(body: dict) -> Any:
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            return JSONResponse({"error": {"type": "invalid_request", "message": "'rid' must be a non-empty string"}},
                                status_code=400)
        tm = http_server.get_global_state().tokenizer_manager
        if rid not in tm.rid_to_state:
            return JSONResponse({"error": {"type": "not_found", "message": f"no request {rid!r} on this engine"}},
                                status_code=404)
        tm.abort_request(rid=rid)
        return {"aborted": rid}

    app.add_api_route("/gyre/abort", abort_known, methods=["POST"])
    app.add_api_route("/gyre/intake", set_intake, methods=["POST"])
    app.add_api_route("/gyre/intake", get_intake, methods=["GET"])
    app.add_api_route("/gyre/requests", in_flight, methods=["GET"])
