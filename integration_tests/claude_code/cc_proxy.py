"""Helpers and fixtures for running the real Claude Code CLI through the real proxy in front of real SGLang.

A module with a unique name (``conftest.py`` re-exports its fixtures), so test modules can import
its helpers without clashing with the other folders' ``conftest`` modules.

The proxy runs in this process (uvicorn in a thread, 127.0.0.1) so tests can read its records
directly. A tiny random model does not choose tools on its own, so :class:`ConstrainedProxyService`
adds an engine-side ``regex`` chosen per request by the test: it is the real proxy core (rendering,
recording, payload cache, routing are untouched); the regex only reaches SGLang's sampling
parameters, and the core records the forced tokens as not trainable, as it must.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from claude_cli import CLIUnavailable, ensure_cli  # noqa: E402

MODEL = "gyre-tiny"
FIXTURE = HERE / "fixtures" / "claude_code_2.1.197_requests.json"


def tool_call_regex(name: str, arguments_text: str) -> str:
    """A regex that makes the model emit exactly one Hermes tool call with these arguments."""
    return re.escape('<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, arguments_text))


def text_regex(text: str) -> str:
    return re.escape(text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServedProxy:
    """The proxy app (all faces, management routes) on uvicorn in a background thread."""

    def __init__(self, service: Any, admin_token: str) -> None:
        import uvicorn

        from gyre_core.proxy.app import build_app

        self.service = service
        self.admin_token = admin_token
        self.bodies: list[dict[str, Any]] = []
        app = build_app(service, admin_token=admin_token)

        @app.middleware("http")
        async def keep_bodies(request: Any, call_next: Any) -> Any:
            # An observer: what the harness really sent, to compare with what was recorded.
            if request.url.path == "/v1/messages":
                raw = await request.body()
                try:
                    self.bodies.append({"headers": dict(request.headers), "body": json.loads(raw)})
                except ValueError:
                    pass
            return await call_next(request)

        async def close_engine_clients() -> None:
            for slot in service.router.engines():
                await slot.client.close()

        app.router.on_shutdown.append(close_engine_clients)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True, name="gyre-proxy")

    def start(self) -> "ServedProxy":
        self._thread.start()
        deadline = time.time() + 30
        while not self._server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError("the proxy did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(15)


def make_constrained_service(model_dir: Path, engine_url: str, engine_key: str | None = None, **config: Any) -> Any:
    from gyre_core.proxy.classify import DefaultRoleClassifier
    from gyre_core.proxy.render import ChatRenderer
    from gyre_core.proxy.service import ProxyConfig, ProxyService
    from gyre_sglang.client import SGLangClient

    class ConstrainedProxyService(ProxyService):
        """The real proxy core; ``regex_for(request)`` may add an engine-side regex to one call."""

        regex_for: Callable[[Any], str | None] | None = None

        def _sampling(self, ex: Any, request: Any, prompt_len: int) -> dict[str, Any]:
            params = super()._sampling(ex, request, prompt_len)
            regex = self.regex_for(request) if self.regex_for is not None else None
            if regex is not None:
                params["regex"] = regex
            return params

    classifier = DefaultRoleClassifier()
    cfg = ProxyConfig(served_models=(MODEL,), **{"max_new_tokens": 256, **config})
    service = ConstrainedProxyService(
        ChatRenderer.from_model_dir(model_dir), cfg, classify=lambda leaf: classifier.gyre_classify_role(leaf)
    )
    service.add_engine(SGLangClient(engine_url, api_key=engine_key))
    return service


@pytest.fixture
def served_proxy(tiny_model_dir: Path, sglang_server: Any) -> Iterator[ServedProxy]:
    service = make_constrained_service(tiny_model_dir, sglang_server.url, sglang_server.api_key)
    proxy = ServedProxy(service, admin_token=secrets.token_urlsafe(24)).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture(scope="session")
def claude_cli() -> Path:
    """The pinned Claude Code CLI, installed with npm on first use (skips without node/npm)."""
    try:
        return ensure_cli()
    except CLIUnavailable as exc:
        pytest.skip(str(exc))


def captured_requests() -> Mapping[str, list[dict[str, Any]]]:
    """Request bodies the real CLI sent (see ``capture_cli_requests.py``), by scenario, in order."""
    data = json.loads(FIXTURE.read_text())
    return {k: v for k, v in data.items() if isinstance(v, list)}
