"""The TITO proxy in front of the session's real SGLang server, for SDK and harness tests.

``proxy_server`` runs the proxy app (every face: OpenAI and Anthropic) in-process on a free
loopback port, on its own event loop in a background thread, so tests can drive it with the
official SDKs (blocking clients) and read the records straight from the service.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import pytest

MODEL_NAME = "gyre-tiny"


@dataclass
class ProxyHandle:
    url: str
    """Base URL, e.g. ``http://127.0.0.1:PORT`` (OpenAI SDK: ``url + "/v1"``)."""
    admin_token: str
    service: Any
    """The in-process :class:`gyre_core.proxy.service.ProxyService`."""
    engine_url: str
    engine_headers: dict[str, str]
    """The engine key's header, for tests that call the engine directly."""
    model: str = MODEL_NAME

    def create_execution(self, sampling: Mapping[str, Any] | None = None) -> tuple[int, str]:
        """A new execution through the admin API: ``(execution_id, api_key)``."""
        import httpx

        r = httpx.post(f"{self.url}/gyre/executions", headers={"Authorization": f"Bearer {self.admin_token}"},
                       json={"sampling": dict(sampling or {})}, timeout=30)
        r.raise_for_status()
        body = r.json()
        return body["execution_id"], body["api_key"]

    def admin_get(self, path: str) -> Any:
        import httpx

        r = httpx.get(self.url + path, headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=60)
        r.raise_for_status()
        return r.json()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def proxy_server(sglang_server, tiny_model_dir: Path) -> Iterator[ProxyHandle]:
    pytest.importorskip("uvicorn")
    import uvicorn

    from gyre_core.proxy.app import build_app
    from gyre_core.proxy.render import ChatRenderer
    from gyre_core.proxy.service import ProxyConfig, ProxyService

    renderer = ChatRenderer.from_model_dir(tiny_model_dir)
    service = ProxyService(renderer, ProxyConfig(served_models=(MODEL_NAME,), max_new_tokens=256,
                                                 sampling={"temperature": 1.0, "top_p": 1.0}))
    engine = sglang_server.client()
    service.add_engine(engine)
    admin = secrets.token_urlsafe(24)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(service, admin_token=admin), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))

    async def serve() -> None:
        try:
            await server.serve()
        finally:
            await engine.close()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), name="gyre-proxy", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the proxy did not start")
        time.sleep(0.05)
    try:
        yield ProxyHandle(f"http://127.0.0.1:{port}", admin, service, sglang_server.url, engine.auth_headers)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
