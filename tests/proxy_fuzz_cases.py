"""Hostile HTTP requests for the proxy, as hypothesis strategies, and the server they are sent to.

Shared by ``tests/test_proxy_fuzz.py`` (a bounded run in CI) and ``benchmarks/proxy_fuzz.py``
(a few thousand requests). The server is the real app (:func:`gyre_core.proxy.app.build_app`) under
uvicorn on loopback with the proxy's own settings, in front of ``FakeEngine`` (a named stand-in
engine: the fuzz is about the proxy's HTTP surface, not about a model).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

ADMIN = "admin-token-fuzz-0123456789"
BODY_LIMIT = 256 * 1024
CHAT_PATHS = ("/v1/chat/completions", "/v1/messages", "/v1/messages?beta=true")


@dataclass
class FuzzServer:
    """The app on 127.0.0.1:port, two executions ``a`` and ``b`` and what each has recorded."""

    port: int
    service: Any
    server: Any
    thread: threading.Thread
    keys: dict[str, str] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)
    answered: dict[str, int] = field(default_factory=lambda: {"a": 0, "b": 0})

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def start_server(body_limit: int = BODY_LIMIT) -> FuzzServer:
    import uvicorn

    from gyre_core.proxy.app import build_app
    from gyre_core.proxy.fake_engine import FakeEngine
    from gyre_core.proxy.http_layer import uvicorn_config
    from gyre_core.proxy.render import ChatRenderer
    from gyre_core.proxy.service import ProxyConfig, ProxyService
    from gyre_core.tiny_model import cached_tiny_model

    service = ProxyService(ChatRenderer.from_model_dir(cached_tiny_model()),
                           ProxyConfig(served_models=("tiny",), max_body_bytes=body_limit, max_new_tokens=4))
    service.add_engine(FakeEngine("http://fake"))
    app = build_app(service, admin_token=ADMIN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    fs = FuzzServer(port, service, server, thread)
    for name in ("a", "b"):
        fs.ids[name], fs.keys[name] = service.create_execution()
    return fs


# ------------------------------------------------------------------------------ strategies

# any code point, lone surrogates and bidi controls included; json.dumps escapes what it must
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12) | st.sampled_from(
    ["\ud800", "\udfff", "a\u202eb", "\u200f", "\x00", "\ufeff", "\U0010ffff"])
json_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
             | any_text)
json_any = st.recursive(json_leaf, lambda k: st.lists(k, max_size=3) | st.dictionaries(any_text, k, max_size=3),
                        max_leaves=12)

openai_body = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": st.just([{"role": "user", "content": "hi"}])},
    optional={"stream": st.booleans(), "max_tokens": st.integers(1, 8), "tools": st.just([])},
)
anthropic_body = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.integers(1, 8),
     "messages": st.just([{"role": "user", "content": "hi"}])},
    optional={"stream": st.booleans(), "system": st.just("be brief")},
)
FIELDS = ("model", "messages", "max_tokens", "stream", "tools", "system", "n", "stream_options",
          "max_completion_tokens", "metadata", "execution_id", "sampling", "engine", "destinations")


@st.composite
def mutated(draw: Any, base: Any) -> dict[str, Any]:
    """A valid body with a few fields replaced or removed, or a message's parts replaced."""
    body = dict(draw(base))
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(FIELDS))
        if draw(st.booleans()):
            body[name] = draw(json_any)
        else:
            body.pop(name, None)
    if draw(st.booleans()):
        msg = {"role": draw(st.sampled_from(["user", "assistant", "tool", "system", "developer", "x"])),
               "content": draw(json_any | any_text)}
        if draw(st.booleans()):
            msg[draw(st.sampled_from(["tool_calls", "tool_call_id", "name", "reasoning_content"]))] = draw(json_any)
        body["messages"] = [msg]
    return body


def _deep(n: int, inner: str = "1") -> str:
    return "[" * n + inner + "]" * n


@st.composite
def raw_body(draw: Any) -> bytes:
    """Bodies as bytes: valid-ish JSON, hostile JSON, or not JSON at all."""
    kind = draw(st.sampled_from(["openai", "anthropic", "any", "deep", "digits", "constant", "bytes",
                                 "truncated", "oversize", "empty"]))
    if kind == "openai":
        return json.dumps(draw(mutated(openai_body))).encode()
    if kind == "anthropic":
        return json.dumps(draw(mutated(anthropic_body)), ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    if kind == "any":
        return json.dumps(draw(json_any)).encode()
    if kind == "deep":
        depth = draw(st.sampled_from([63, 65, 1000, 5000, 100_000]))
        where = draw(st.sampled_from(["messages", "tools", "metadata", "content"]))
        if where == "content":
            return ('{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":' + _deep(depth, '"x"')
                    + '}]}').encode()
        return ('{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"x"}],"' + where + '":'
                + ('{"a":' * depth) + "1" + ("}" * depth) + "}").encode()
    if kind == "digits":
        digits = "9" * draw(st.sampled_from([19, 40, 4301, 5000]))
        field_ = draw(st.sampled_from(["max_tokens", "max_completion_tokens", "n", "execution_id"]))
        return ('{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"x"}],"' + field_ + '":'
                + draw(st.sampled_from(["", "-"])) + digits + "}").encode()
    if kind == "constant":
        c = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]))
        return ('{"model":"tiny","max_tokens":' + c + ',"messages":[{"role":"user","content":"x"}]}').encode()
    if kind == "bytes":
        return draw(st.binary(max_size=64)) + draw(st.sampled_from([b"", b"\xff\xfe", b"\xed\xa0\x80"]))
    if kind == "truncated":
        full = json.dumps(draw(openai_body)).encode()
        return full[: draw(st.integers(0, len(full) - 1))]
    if kind == "oversize":
        return b'{"model":"tiny","messages":[{"role":"user","content":"' + b"x" * draw(
            st.sampled_from([BODY_LIMIT + 1, 2 * BODY_LIMIT, 5 * BODY_LIMIT])) + b'"}]}'
    return b""


@st.composite
def credential(draw: Any) -> tuple[str, dict[str, str]]:
    """(who the request speaks as, its credential headers)."""
    who = draw(st.sampled_from(["a"] * 4 + ["b"] * 4 + ["admin"] * 2 + ["none", "garbage", "huge", "nonascii",
                                                                        "basic", "both"]))
    style = draw(st.sampled_from(["bearer", "x-api-key"]))

    def put(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if style == "bearer" else {"x-api-key": key}

    if who in ("a", "b"):
        return who, put(KEYS[who])
    if who == "admin":
        return who, put(ADMIN)
    if who == "garbage":
        return who, put(draw(st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=80)))
    if who == "huge":
        return who, put("k" * draw(st.sampled_from([513, 10_000, 100_000])))
    if who == "nonascii":
        return who, put(draw(st.sampled_from(["ké", "ключ", "\u202ekey"])))
    if who == "basic":
        return who, {"Authorization": "Basic " + KEYS["a"]}
    if who == "both":  # two different credentials: x-api-key wins, consistently
        return "b", {"x-api-key": KEYS["b"], "Authorization": f"Bearer {KEYS['a']}"}
    return who, {}


KEYS: dict[str, str] = {}
"""Filled in by the runner with the live executions' keys before drawing."""


ROUTES = tuple((p, "POST") for p in CHAT_PATHS) * 4 + (
    ("/v1/models", "GET"), ("/gyre/executions", "POST"), ("/gyre/executions/0/records", "GET"),
    ("/gyre/executions/1/tree", "GET"), ("/gyre/executions/99999999999999999999/records", "GET"),
    ("/gyre/executions/x/close", "POST"), ("/gyre/executions/1/selected?j_max=-1", "GET"),
    ("/gyre/executions/0/selected?j_max=99999999999999999999", "GET"), ("/gyre/engines", "GET"),
    ("/gyre/engines/reroute", "POST"), ("/gyre/engines/restore", "POST"), ("/gyre/health", "GET"),
    ("/nope", "POST"), ("/", "GET"),
)


@st.composite
def hostile_request(draw: Any) -> tuple[str, str, str, dict[str, str], bytes]:
    """(speaker, method, path, headers, body)."""
    who, cred = draw(credential())
    path, method = draw(st.sampled_from(ROUTES))
    if draw(st.integers(0, 6)) == 0:  # sometimes the wrong method
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]))
    ctype = draw(st.sampled_from(["application/json"] * 5 + ["text/plain", None, "application/json; charset=latin-1"]))
    headers = dict(cred)
    if ctype is not None:
        headers["Content-Type"] = ctype
    if draw(st.integers(0, 9)) == 0:
        headers["x-fuzz"] = "v" * draw(st.sampled_from([100, 70_000]))
    return who, method, path, headers, draw(raw_body())


# ------------------------------------------------------------------------------ one request

@dataclass(frozen=True)
class Outcome:
    status: int | None  # None: no HTTP answer (connection lost or timed out)
    body: bytes
    error: str | None = None


def send(port: int, method: str, path: str, headers: dict[str, str], body: bytes, timeout: float = 20.0) -> Outcome:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        wire = {k: v.encode("utf-8") for k, v in headers.items()}  # raw bytes: non-Latin-1 keys too
        conn.request(method, path, body=body if method in ("POST", "PUT", "DELETE") else None, headers=wire)
        resp = conn.getresponse()
        return Outcome(resp.status, resp.read())
    except Exception as exc:  # noqa: BLE001 - any failure to get an answer is the finding
        return Outcome(None, b"", f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def check(fs: FuzzServer, who: str, method: str, path: str, body: bytes, out: Outcome) -> str | None:
    """What is wrong with the answer, or None. Also counts the calls each execution got answered."""
    if out.status is None:
        return f"no answer: {out.error}"
    if out.status >= 500:
        return f"{out.status}: {out.body[:300]!r}"
    if path in CHAT_PATHS and method == "POST" and out.status == 200 and who in ("a", "b"):
        fs.answered[who] += 1
    if out.status >= 400:
        try:
            err = json.loads(out.body)
        except ValueError:
            return f"{out.status} without a JSON body: {out.body[:200]!r}"
        if path.startswith("/v1/messages"):
            ok = err.get("type") == "error" and isinstance(err.get("error", {}).get("message"), str)
        else:
            ok = isinstance(err.get("error"), dict) and isinstance(err["error"].get("message"), str)
        if not ok:
            return f"{out.status} not in the API's error shape: {err!r}"[:300]
    if path.startswith("/gyre/") and path != "/gyre/health" and who in ("a", "b") and out.status < 400:
        return f"an execution's key was accepted on {path}"
    for name in ("a", "b"):  # each execution holds exactly the calls answered with its own key
        got = len(fs.service.records(fs.ids[name]).calls)
        if got != fs.answered[name]:
            return f"execution {name} holds {got} calls, {fs.answered[name]} were answered with its key"
    return None
