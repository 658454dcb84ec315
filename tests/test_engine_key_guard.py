"""The SGLang plugin's guard on its ``/gyre/`` routes, as plain ASGI (no SGLang needed): the run's
engine key is required; with no key configured the routes are closed; other paths pass through.
The real server is checked in ``integration_tests/sglang/test_engine_auth.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from fastapi import FastAPI  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from gyre_sglang.server_plugin.guard import EngineKeyGuard  # noqa: E402


@pytest.fixture
def client(monkeypatch):
    app = FastAPI()
    app.add_api_route("/gyre/kv/pins", lambda: {"pins": []}, methods=["GET"])
    app.add_api_route("/health", lambda: {"ok": True}, methods=["GET"])
    app.add_middleware(EngineKeyGuard)
    return TestClient(app)


def test_key_required_on_gyre_routes(client, monkeypatch) -> None:
    monkeypatch.setenv("GYRE_ENGINE_KEY", "k" * 32)
    assert client.get("/gyre/kv/pins").status_code == 401
    assert client.get("/gyre/kv/pins", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/gyre/kv/pins", headers={"Authorization": "k" * 32}).status_code == 401
    assert client.get("/gyre/kv/pins", headers={"Authorization": "Bearer " + "k" * 32}).json() == {"pins": []}
    assert client.get("/health").status_code == 200


def test_no_key_configured_closes_the_routes(client, monkeypatch) -> None:
    monkeypatch.delenv("GYRE_ENGINE_KEY", raising=False)
    r = client.get("/gyre/kv/pins", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 403 and "GYRE_ENGINE_KEY" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200
