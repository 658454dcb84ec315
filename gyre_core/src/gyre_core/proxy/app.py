"""The proxy's HTTP server (FastAPI on uvicorn): harness API faces plus Gyre's management routes.

Security by default: binds 127.0.0.1 unless told otherwise; every harness route needs an
execution's API key (``Authorization: Bearer`` or ``x-api-key``) and an execution reaches only its
own records; every ``/gyre/`` route needs the admin token; bodies are size-limited while read.

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
import json
import logging
from typing import Any, Callable, Iterable, Mapping

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from gyre_core.proxy.http_io import read_body
from gyre_core.proxy.service import ProxyService
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
    "read_json",
    "register_error_renderer",
]

log = logging.getLogger(__name__)

Face = Callable[[FastAPI, ProxyService], None]
ErrorRenderer = Callable[[ProxyError], Response]

_OPENAI_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "request_too_large": "invalid_request_error",
    "overloaded": "server_error",
    "engine": "server_error",
    "conflict": "invalid_request_error",
    "permission": "permission_error",
    "internal": "server_error",
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


def openai_error(err: ProxyError) -> Response:
    return JSONResponse(openai_error_body(err), status_code=err.status)


def register_error_renderer(app: FastAPI, prefix: str, renderer: ErrorRenderer) -> None:
    """Render every error under ``prefix`` with ``renderer`` (longest prefix wins)."""
    app.state.error_renderers.append((prefix, renderer))
    app.state.error_renderers.sort(key=lambda p: -len(p[0]))


def _render_error(request: Request, err: ProxyError) -> Response:
    for prefix, fn in request.app.state.error_renderers:
        if request.url.path.startswith(prefix):
            return fn(err)
    return openai_error(err)


def api_key_of(headers: Mapping[str, str]) -> str | None:
    """The bearer token or ``x-api-key`` of lower-cased headers."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return headers.get("x-api-key") or None


def headers_of(request: Request) -> dict[str, str]:
    """Request headers, names lower-cased (repeated headers joined by ``,``)."""
    out: dict[str, str] = {}
    for k, v in request.headers.items():
        out[k] = f"{out[k]},{v}" if k in out else v
    return out


async def read_json(request: Request, max_bytes: int) -> Any:
    """The body as JSON after the content-type check, read incrementally up to ``max_bytes``."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise ProxyError(415, "invalid_request", f"Content-Type must be application/json, got {ctype or 'none'!r}")
    raw = await read_body(request, max_bytes)
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProxyError(400, "invalid_request", f"malformed JSON body: {exc}") from None


def _kind_for_status(status: int) -> str:
    return {401: "authentication", 403: "permission", 404: "not_found", 413: "request_too_large"}.get(
        status, "invalid_request" if status < 500 else "internal"
    )


def _require_admin(request: Request) -> None:
    given = api_key_of(headers_of(request)) or ""
    if not hmac.compare_digest(given.encode("utf-8", "replace"), request.app.state.admin_token.encode()):
        raise ProxyError(401, "authentication", "admin token required")


def _eid(raw: str) -> int:
    if not raw.isdigit() or len(raw) > 18:
        raise ProxyError(404, "not_found", f"no execution {raw!r}")
    return int(raw)


def _int_query(request: Request, name: str, default: int | None) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        if default is None:
            raise ProxyError(400, "invalid_request", f"query parameter {name} is required")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ProxyError(400, "invalid_request", f"query parameter {name} must be an integer") from None


def _management_router(service: ProxyService) -> APIRouter:
    r = APIRouter()
    limit = service.config.max_body_bytes

    @r.post("/gyre/executions")
    async def create(request: Request) -> Response:
        _require_admin(request)
        raw = await request.body() if request.headers.get("content-length", "0") != "0" else b""
        body = json.loads(raw) if raw.strip() else {}
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
    from gyre_core.proxy import anthropic_api

    app.include_router(anthropic_api.make_router(service, max_body_bytes=service.config.max_body_bytes))

    def render(err: ProxyError) -> Response:
        return JSONResponse(anthropic_api.error_body(err.kind, err.message), status_code=err.status)

    register_error_renderer(app, "/v1/messages", render)


def default_faces() -> list[Face]:
    from gyre_core.proxy.openai_api import openai_face

    faces: list[Face] = [openai_face]
    try:
        from gyre_core.proxy import anthropic_api

        if hasattr(anthropic_api, "make_router"):
            faces.append(anthropic_face)
    except ImportError:  # pragma: no cover - the Anthropic face ships in the same package
        pass
    return faces


def build_app(service: ProxyService, *, admin_token: str, faces: Iterable[Face] | None = None) -> FastAPI:
    """The ASGI application: management routes plus the given faces (default: :func:`default_faces`)."""
    if len(admin_token) < 16:
        raise ValueError("admin token too short (16 characters at least)")
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.admin_token = admin_token
    app.state.error_renderers = []

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> Response:
        return _render_error(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _render_error(request, ProxyError(exc.status_code, _kind_for_status(exc.status_code), str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return _render_error(request, ProxyError(400, "invalid_request", "malformed request"))

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(request: Request, exc: json.JSONDecodeError) -> Response:
        return _render_error(request, ProxyError(400, "invalid_request", f"malformed JSON body: {exc}"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:  # a bug: never leak a traceback
        log.exception("proxy: internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return _render_error(request, ProxyError(500, "internal", "internal proxy error"))

    app.include_router(_management_router(service))
    for face in default_faces() if faces is None else faces:
        face(app, service)
    return app
