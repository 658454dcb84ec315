"""Every engine route Gyre uses needs the run's engine key; only the health probes are open.

Against the shared real SGLang server (CPU engine): SGLang's own ``--api-key`` guards generate and
weight updates, Gyre's plugin guard (:mod:`gyre_sglang.server_plugin.guard`) its ``/gyre/`` routes.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(300)]

ROUTES = [
    ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": []}),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/flush_cache", {}),
    ("GET", "/gyre/info", None),
    ("POST", "/gyre/intake", {"open": False}),
    ("GET", "/gyre/requests", None),
    ("POST", "/gyre/abort", {"rid": "x"}),
    ("POST", "/gyre/kv/pin", {"rid": "x"}),
    ("GET", "/gyre/kv/pins", None),
    ("POST", "/gyre/kv/import", {"descriptor": {}}),
    ("POST", "/gyre/kv/release", {"handle": "x"}),
]


def _call(url: str, method: str, path: str, body: object, key: str | None) -> int:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[p for _, p, _ in ROUTES])
@pytest.mark.parametrize("key", ["none", "wrong"])
def test_route_refused_without_the_engine_key(sglang_server, method: str, path: str, body: object, key: str) -> None:
    status = _call(sglang_server.url, method, path, body, None if key == "none" else "not-the-key")
    assert status in (401, 403), f"{method} {path} without the key answered {status}"


def test_with_the_key_the_routes_answer_and_health_needs_none(sglang_server) -> None:
    assert _call(sglang_server.url, "GET", "/health_generate", None, None) == 200
    assert _call(sglang_server.url, "GET", "/gyre/info", None, sglang_server.api_key) == 200
    assert _call(sglang_server.url, "GET", "/gyre/intake", None, sglang_server.api_key) == 200
    assert _call(sglang_server.url, "POST", "/generate",
                 {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}, sglang_server.api_key) == 200
