"""The proxy's HTTP server (FastAPI on uvicorn): harness API faces plus Gyre's management routes.

Security by default: binds 127.0.0.1 unless told otherwise; every harness route needs an
execution's API key (``Authorization: Bearer`` or ``x-api-key``) and an execution reaches only its
own records; every ``/gyre/`` route needs the admin token. Limits (headers, body size, JSON depth,
Unicode, numbers), the per-execution caps on connections, calls and body bytes in flight, the
timeouts, and error rendering are the shared HTTP layer's (:mod:`gyre_core.proxy.http_layer`), so
malformed or abusive input gets a 4xx in the API's own shape, never a 500 or a dropped connection.

Faces are pluggable: ``build_app(service, admin_token=..., faces=[openai_face, anthropic_face])``;
a face is ``face(app, service) -> None`` that adds its routes (e.g. ``app.include_router(...)``)
and calls :func:`register_error_renderer` for its path prefix, so every error under that prefix
(including the framework's own 404/405) comes back in that API's error shape. Unclaimed paths get
OpenAI's shape. ``default_faces()`` is OpenAI plus, when present, the Anthropic face.

Management routes (admin token as ``Authorization: Bearer``):

* ``POST /gyre/executions`` ``{"execution_id"?, "sampling"?, "metadata"?}`` ->
  ``{"execution_id", "api_key"}`` (the key is shown once)
* ``POST /gyre/executions/{id}/close`` -- revoke the key; records stay readable
* ``DELETE /gyre/executions/{id}`` -- drop the execution and its records
* ``GET /gyre/executions/{id}/tree`` -- the trajectory tree (token ids, provenance, log-probs)
* ``GET /gyre/executions/{id}/records[?input_ids=1]`` -- the TITO record of every call
* ``GET /gyre/executions/{id}/selected?j_max=J&seed=S[&rows=1]`` -- selected trajectories
* ``GET /gyre/engines``, ``POST /gyre/engines/reroute`` ``{"engine", "destinations"?}``,
  ``POST /gyre/engines/restore`` ``{"engine"}``
"""

from __future__ import annotations

import hmac
import logging
from typing import Any, Iterable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from gyre_core.proxy import anthropic_api
from gyre_core.proxy.http_layer import (
    ExecutionLimits, WireGuard, WireLimits, api_key_of, check_headers, headers_of, openai_error_body, read_json,
    register_error_renderer, render_error,
)
from gyre_core.proxy.openai_api import openai_error, openai_face
from gyre_core.proxy.service import MAX_EXECUTION_ID, ProxyService
from gyre_core.proxy.types import ProxyError
from gyre_core.trajectory import TrajectoryRow

__all__ = [
    "Face",
    "anthropic_face",
    "api_key_of",
    "build_app",
    "default_faces",
    "headers_of",
    "openai_error",
    "openai_error_body",
    "read_json",
    "register_error_renderer",
]

log = logging.getLogger(__name__)

Face = Any
"""``face(app, service) -> None``: adds its routes and registers its error renderer."""


def _kind_for_status(status: int) -> str:
    return {401: "authentication", 403: "permission", 404: "not_found", 413: "request_too_large"}.get(
        status, "invalid_request" if status < 500 else "internal"
    )


def _require_admin(request: Request) -> None:
    given = api_key_of(check_headers(request)) or ""
    if not hmac.compare_digest(given.encode("utf-8", "replace"), request.app.state.admin_token.encode()):
        raise ProxyError(401, "authentication", "admin token required")


def _eid(raw: str) -> int:
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18 or int(raw) >= MAX_EXECUTION_ID:
        raise ProxyError(404, "not_found", f"no execution {raw[:40]!r}")
    return int(raw)


def _int_query(request: Request, name: str, default: int | None) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        if default is None:
            raise ProxyError(400, "invalid_request", f"query parameter {name} is required")
        return default
    if not (raw.isascii() and raw.lstrip("-").isdigit()) or len(raw) > 18:
        raise ProxyError(400, "invalid_request", f"query parameter {name} must be an integer")
    return int(raw)


def _management_router(service: ProxyService) -> APIRouter:
    r = APIRouter()
    limit = service.config.max_body_bytes

    @r.post("/gyre/executions")
    async def create(request: Request) -> Response:
        _require_admin(request)
        body = await read_json(request, limit, empty={})
        if not isinstance(body, dict):
            raise ProxyError(400, "invalid_request", "expected a JSON object")
        sampling, metadata = body.get("sampling") or {}, body.get("metadata") or {}
        if not isinstance(sampling, dict) or not isinstance(metadata, dict):
            raise ProxyError(400, "invalid_request", "sampling and metadata must be objects")
        eid, key = service.create_execution(body.get("execution_id"), sampling=sampling, metadata=metadata)
        return JSONResponse({"execution_id": eid, "api_key": key}, status_code=201)

    @r.post("/gyre/executions/{eid}/close")
    async def close(request: Request, eid: str) -> Response:
        _require_admin(request)
        service.close_execution(_eid(eid))
        return JSONResponse({"closed": True})

    @r.delete("/gyre/executions/{eid}")
    async def forget(request: Request, eid: str) -> Response:
        _require_admin(request)
        service.forget(_eid(eid))
        return JSONResponse({"deleted": True})

    @r.get("/gyre/executions/{eid}/tree")
    async def tree(request: Request, eid: str) -> Response:
        _require_admin(request)
        return JSONResponse(service.records(_eid(eid)).tree_json())

    @r.get("/gyre/executions/{eid}/records")
    async def records(request: Request, eid: str) -> Response:
        _require_admin(request)
        rec = service.records(_eid(eid))
        with_inputs = request.query_params.get("input_ids") in ("1", "true")
        return JSONResponse([c.to_json(rec.input_ids(c) if with_inputs else None) for c in rec.calls])

    @r.get("/gyre/executions/{eid}/selected")
    async def selected(request: Request, eid: str) -> Response:
        _require_admin(request)
        ex = _eid(eid)
        j_max, seed = _int_query(request, "j_max", None), _int_query(request, "seed", 0)
        if j_max < 0:
            raise ProxyError(400, "invalid_request", "j_max must be >= 0")
        chosen = service.selected(ex, j_max, seed)
        rows = request.query_params.get("rows") in ("1", "true")
        tree = service.records(ex).tree
        out = []
        for s in chosen:
            item: dict[str, Any] = {"leaf_id": s.leaf_id, "role": s.role.name, "targets": sorted(s.targets)}
            if rows:
                row = TrajectoryRow.from_tree(tree, s, group_id=0)
                item["token_ids"] = row.token_ids.tolist()
                item["loss_mask"] = row.loss_mask.tolist()
                item["behaviour_logprobs"] = row.behaviour_logprobs.tolist()
            out.append(item)
        return JSONResponse(out)

    @r.get("/gyre/engines")
    async def engines(request: Request) -> Response:
        _require_admin(request)
        return JSONResponse([
            {"url": s.url, "kind": s.kind, "cell_index": s.cell_index, "accepting": s.accepting,
             "executions": sorted(s.executions), "inflight": service.inflight(s.url)}
            for s in service.router.engines()
        ])

    async def _engine_body(request: Request) -> dict[str, Any]:
        _require_admin(request)
        body = await read_json(request, limit)
        if not isinstance(body, dict) or not isinstance(body.get("engine"), str):
            raise ProxyError(400, "invalid_request", 'expected {"engine": URL}')
        try:
            service.router.slot(body["engine"])
        except KeyError:
            raise ProxyError(404, "not_found", f"unknown engine {body['engine']!r}") from None
        return body

    @r.post("/gyre/engines/reroute")
    async def reroute(request: Request) -> Response:
        body = await _engine_body(request)
        dests = body.get("destinations")
        if dests is not None and not (isinstance(dests, list) and all(isinstance(d, str) for d in dests)):
            raise ProxyError(400, "invalid_request", "destinations must be a list of engine URLs")
        try:
            res = service.reroute(body["engine"], dests)
        except KeyError as exc:
            raise ProxyError(404, "not_found", str(exc)) from None
        return JSONResponse({"moved": {str(k): v for k, v in res.moved.items()}, "over_capacity": res.over_capacity})

    @r.post("/gyre/engines/restore")
    async def restore(request: Request) -> Response:
        body = await _engine_body(request)
        service.restore_engine(body["engine"])
        return JSONResponse({"restored": True})

    @r.get("/gyre/health")
    async def health() -> Response:
        return JSONResponse({"ok": True})

    return r


def anthropic_face(app: FastAPI, service: ProxyService) -> None:
    """Mount the Anthropic face (``anthropic_api.make_router``) with Anthropic's error shape."""
    app.include_router(anthropic_api.make_router(service, max_body_bytes=service.config.max_body_bytes))

    def render(err: ProxyError) -> Response:
        return JSONResponse(anthropic_api.error_body(err.kind, err.message), status_code=err.status)

    register_error_renderer(app, "/v1/messages", render)


def default_faces() -> list[Face]:
    """OpenAI's and Anthropic's faces."""
    return [openai_face, anthropic_face]


def build_app(service: ProxyService, *, admin_token: str, faces: Iterable[Face] | None = None) -> FastAPI:
    """The ASGI application: management routes plus the given faces (default: :func:`default_faces`)."""
    if len(admin_token) < 16:
        raise ValueError("admin token too short (16 characters at least)")
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.admin_token = admin_token
    app.state.error_renderers = []
    # the wire limits (http_layer): the middleware checks each request head before a route reads
    # its body; ``uvicorn_config`` finds the guard here and serves with the guarded h11 protocol
    guard = WireGuard(WireLimits.of(service.config), identify=service.execution_of_key, events=service.wire_events)
    app.state.wire_guard = guard
    app.add_middleware(ExecutionLimits, guard=guard)

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> Response:
        return render_error(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return render_error(request, ProxyError(exc.status_code, _kind_for_status(exc.status_code), str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return render_error(request, ProxyError(400, "invalid_request", "malformed request"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:  # a bug: never leak a traceback
        log.exception("proxy: internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return render_error(request, ProxyError(500, "internal", "internal proxy error"))

    app.include_router(_management_router(service))
    for face in default_faces() if faces is None else faces:
        face(app, service)
    return app
