"""Hostile HTTP requests for the proxy, as hypothesis strategies, and the server they are sent to.

Shared by ``tests/test_proxy_fuzz.py`` (a bounded run in CI) and ``benchmarks/proxy_fuzz.py``
(a few thousand requests). The server is the real app (:func:`gyre_core.proxy.app.build_app`) under
uvicorn on loopback with the proxy's own settings, in front of ``FakeEngine`` (a named stand-in
engine: the fuzz is about the proxy's HTTP surface, not about a model).

Two kinds of cases (:func:`any_case`): hostile requests (:func:`hostile_request`: what a broken or
malicious harness sends) and policy outputs (:func:`policy_case`: what a policy under RL samples --
tool calls holding ``NaN``, ``1e999``, lone surrogates or 5,000 levels of nesting, stray special
tokens, random token ids, non-finite log-probs -- answered through both faces, streamed or not,
and sent back by the harness in its next request). :func:`run_case` sends one and says what is
wrong with the answers.
"""

from __future__ import annotations

import http.client
import json
import math
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
    engine: Any = None
    guard: Any = None
    """The app's wire limits (``http_layer.WireGuard``): in-flight counts, the global cap."""
    keys: dict[str, str] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)
    answered: dict[str, int] = field(default_factory=lambda: {"a": 0, "b": 0})

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def start_server(body_limit: int = BODY_LIMIT, **config: Any) -> FuzzServer:
    """The server; ``config``: more ``ProxyConfig`` fields (the wire limits, the window)."""
    import uvicorn

    from gyre_core.proxy.app import build_app
    from gyre_core.proxy.fake_engine import FakeEngine
    from gyre_core.proxy.http_layer import uvicorn_config
    from gyre_core.proxy.render import ChatRenderer
    from gyre_core.proxy.service import ProxyConfig, ProxyService
    from gyre_core.tiny_model import cached_tiny_model

    config.setdefault("max_new_tokens", 4096)  # policy outputs are scripted whole; requests may lower it
    service = ProxyService(ChatRenderer.from_model_dir(cached_tiny_model()),
                           ProxyConfig(served_models=("tiny",), max_body_bytes=body_limit, **config))
    engine = FakeEngine("http://fake")
    service.add_engine(engine)
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
    fs = FuzzServer(port, service, server, thread, engine, app.state.wire_guard)
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
    if kind == "oversize":  # 40 MB: far past the drain factor, it must still get its 413, not a reset
        return b'{"model":"tiny","messages":[{"role":"user","content":"' + b"x" * draw(
            st.sampled_from([BODY_LIMIT + 1, 2 * BODY_LIMIT, 5 * BODY_LIMIT, 40_000_000])) + b'"}]}'
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


# ------------------------------------------------------------------------------ policy outputs

def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


POLICY_ARGUMENTS = (
    '{"command": "ls"}', '{"x": NaN}', '{"x": Infinity}', '{"x": -Infinity}', '{"x": 1e999}', '{"x": -1e999}',
    '{"x": 1.5e308}', '{"x": "\\ud800"}', '{"\\udfff": 1}', '{"x": ["ok", "\\udc00"]}', '{"x": "\\u0000"}',
    '{"x": ' + "9" * 4300 + '}', '{"x": ' + "9" * 5000 + '}', '{"a": 1, "a": 2}', '"not an object"', "[]",
    '{"x": ' + _nested(40) + '}', '{"x": ' + _nested(47) + '}', '{"x": ' + _nested(48) + '}',
    '{"x": ' + _nested(63) + '}', '{"x": ' + _nested(900) + '}', '{"x": ' + _nested(5000) + '}',
    '{"x": "a\\u202eb", "y": "\\ud83d\\ude00"}', '{"x": {"y": {"z": [null, true, false, -0.0, 1e-400]}}}',
)
"""Tool-call arguments a policy under RL does sample (strict JSON or not, deep or not)."""

POLICY_FRAGMENTS = (
    "<think>", "</think>", "<think>reasoning</think>", "<tool_call>", "</tool_call>", "<tool_response>x</tool_response>",
    "<|im_start|>user\nhi<|im_end|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\x00", "\ufeff", "\u202e",
    "plain text ", "{", "}", '"', "\\", "\n\n", "\U0010ffff", "",
)


@st.composite
def policy_text(draw: Any) -> str:
    """A sampled answer: fragments of markup and text around tool-call blocks of hostile arguments."""
    parts: list[str] = []
    for _ in range(draw(st.integers(0, 3))):
        parts.append(draw(st.sampled_from(POLICY_FRAGMENTS)))
        if draw(st.booleans()):
            name = draw(st.sampled_from(['"Bash"', '""', "1", "null", '"a\\ud800"']))
            parts.append('<tool_call>\n{"name": ' + name + ', "arguments": ' + draw(st.sampled_from(POLICY_ARGUMENTS))
                         + "}\n</tool_call>")
    parts.append(draw(st.sampled_from(["", "<|im_end|>"])))
    return "".join(parts)


@dataclass(frozen=True)
class PolicyCase:
    """One call whose answer is a hostile policy output (``text`` encoded, or raw token ``ids``)."""

    who: str
    path: str
    stream: bool
    text: str | None
    ids: tuple[int, ...]
    logprob: float
    follow_up: bool
    """Send the answer back, as the harness does, in a second call (tool results for its calls)."""


@st.composite
def policy_case(draw: Any) -> PolicyCase:
    random_ids = draw(st.integers(0, 3)) == 0
    return PolicyCase(
        who=draw(st.sampled_from(["a", "b"])), path=draw(st.sampled_from(CHAT_PATHS)), stream=draw(st.booleans()),
        text=None if random_ids else draw(policy_text()),
        ids=tuple(draw(st.lists(st.integers(0, 2**20), max_size=24))) if random_ids else (),
        logprob=draw(st.sampled_from([-0.5, -0.5, 0.0, float("nan"), float("-inf"), float("inf")])),
        follow_up=draw(st.booleans()),
    )


def any_case() -> Any:
    """Hostile requests, and one case in four a policy output."""
    return st.one_of(hostile_request(), hostile_request(), hostile_request(), policy_case())


def _chat_body(path: str, messages: list[dict[str, Any]], stream: bool) -> bytes:
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "stream": stream}
    if path.startswith("/v1/messages"):
        body["max_tokens"] = 4096
    return json.dumps(body).encode()


def _echo(path: str, answer: dict[str, Any]) -> list[dict[str, Any]]:
    """The next request's messages: the first turn, the answer as the harness keeps it, the tool
    results it owes (or another user turn)."""
    first = {"role": "user", "content": "hi"}
    if path.startswith("/v1/messages"):
        calls = [b["id"] for b in answer["content"] if b.get("type") == "tool_use"]
        results: Any = [{"type": "tool_result", "tool_use_id": c, "content": "ok"} for c in calls] or "go on"
        return [first, {"role": "assistant", "content": answer["content"]}, {"role": "user", "content": results}]
    message = answer["choices"][0]["message"]
    tail = [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in message.get("tool_calls") or []]
    return [first, message, *tail, {"role": "user", "content": "go on"}]


def _strict(obj_text: bytes) -> Any:
    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} in an answer")

    return json.loads(obj_text, parse_constant=no_constant)


def check_answer(out: Outcome) -> str | None:
    """A 200 answer must be strict JSON (or SSE events of strict JSON) with no error inside."""
    if out.status != 200:
        return None
    body = out.body
    try:
        if body.startswith((b"data:", b"event:", b":")):
            for line in body.decode("utf-8").split("\n"):
                if line.startswith("event: error"):
                    return f"an error event in a 200 stream: {body[-300:]!r}"
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = _strict(line[6:].encode())
                    if isinstance(event, dict) and ("error" in event or event.get("type") == "error"):
                        return f"an error in a 200 stream: {line[:300]!r}"
        else:
            _strict(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"a 200 answer that is not strict JSON ({exc}): {body[:200]!r}"
    return None


def run_case(fs: FuzzServer, case: Any) -> list[tuple[Outcome, str | None]]:
    """Send one case (a hostile request or a :class:`PolicyCase`); each answer and its problem."""
    if not isinstance(case, PolicyCase):
        who, method, path, headers, body = case
        out = send(fs.port, method, path, headers, body)
        return [(out, check(fs, who, method, path, body, out))]
    renderer, engine = fs.service.renderer, fs.engine
    engine.outputs.clear()
    engine.logprob = case.logprob
    vocab = len(renderer.tokenizer)
    engine.script(renderer.encode(case.text) if case.text is not None else [i % vocab for i in case.ids])
    headers = {"Authorization": f"Bearer {KEYS[case.who]}", "Content-Type": "application/json"}
    body = _chat_body(case.path, [{"role": "user", "content": "hi"}], case.stream)
    out = send(fs.port, "POST", case.path, headers, body)
    results = [(out, check(fs, case.who, "POST", case.path, body, out) or check_answer(out))]
    if case.follow_up and out.status == 200 and not case.stream and results[0][1] is None:
        engine.outputs.clear()
        engine.logprob = -0.5
        engine.script(renderer.encode("fine<|im_end|>"))
        body2 = _chat_body(case.path, _echo(case.path, json.loads(out.body)), False)
        out2 = send(fs.port, "POST", case.path, headers, body2)
        problem = check(fs, case.who, "POST", case.path, body2, out2) or check_answer(out2)
        if problem is None and out2.status != 200:
            problem = f"the harness's echo of a policy output was refused: {out2.status} {out2.body[:300]!r}"
        results.append((out2, problem))
    engine.outputs.clear()
    engine.logprob = -0.5
    return results


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
