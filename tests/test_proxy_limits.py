"""The proxy holds against one abusive execution: its wire limits, on loopback, with the real app
under uvicorn (``tests/proxy_fuzz_cases.py`` starts it; ``FakeEngine`` stands in for the engine).

* a flood of idle connections evicts itself (oldest silent connection first), another execution's
  call is served;
* over a per-execution cap (connections, calls in flight) the answer is a 429 in the API's own
  shape, counted per execution; a body over the limit is a 413 in the API's shape, also for a
  40 MB body from a client that writes it whole before it reads, and for a chunked one;
* a connection that sends nothing, or its head too slowly, is closed; a body that stalls gets 408;
* the context window is refused before a huge prompt is encoded whole, and one execution's huge
  requests do not hold up another's preparation.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest

pytest.importorskip("transformers")
pytest.importorskip("uvicorn")

import proxy_fuzz_cases as cases  # noqa: E402

from gyre_core.proxy.render import PIECE_CHARS, ChatRenderer  # noqa: E402
from gyre_core.proxy.types import ChatMessage, ChatRequest, ProxyError  # noqa: E402

OPENAI, ANTHROPIC = "/v1/chat/completions", "/v1/messages"


def chat(path: str, content: str = "hi", **extra: Any) -> bytes:
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}
    if path.startswith(ANTHROPIC):
        body.setdefault("max_tokens", 8)
    return json.dumps(body).encode()


def headers(fs: cases.FuzzServer, who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {fs.keys[who]}", "Content-Type": "application/json"}


def assert_shape(path: str, status: int, body: bytes, etype: str) -> dict[str, Any]:
    err = json.loads(body)
    if path.startswith(ANTHROPIC):
        assert err["type"] == "error" and err["error"]["type"] == etype, err
    else:
        assert isinstance(err["error"]["message"], str) and err["error"]["type"], err
    return err


@pytest.fixture(scope="module")
def caps() -> Iterator[cases.FuzzServer]:
    """Small caps, so a test reaches each one with a handful of connections."""
    fs = cases.start_server(max_connections=40, max_connections_per_execution=3, max_calls_per_execution=2,
                            header_timeout_s=5.0)
    cases.KEYS.update(fs.keys)
    yield fs
    fs.stop()


def _closed(sock: socket.socket, within: float) -> bool:
    """Whether the server closed ``sock`` within ``within`` seconds (EOF or reset)."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_an_idle_connection_flood_does_not_stop_another_executions_call(caps: cases.FuzzServer) -> None:
    before = caps.service.limit_summary()["wire"].get("connections_evicted", 0)
    # execution a: keep-alive connections left idle after a call, then a flood of silent sockets
    keyed = [http.client.HTTPConnection("127.0.0.1", caps.port, timeout=5) for _ in range(2)]
    for c in keyed:
        c.request("GET", "/v1/models", headers=headers(caps, "a"))
        assert c.getresponse().read() and True
    flood = [socket.create_connection(("127.0.0.1", caps.port)) for _ in range(150)]
    try:
        t0 = time.monotonic()
        out = cases.send(caps.port, "POST", OPENAI, headers(caps, "b"), chat(OPENAI))
        took = time.monotonic() - t0
        assert out.status == 200, out
        assert took < 2.0, f"b's call took {took:.2f} s behind 150 idle sockets"
        evicted = caps.service.limit_summary()["wire"]["connections_evicted"] - before
        assert evicted >= 150 + 2 - caps.guard.max_connections
        assert all(_closed(s, 0.5) for s in flood[:20])  # the oldest silent sockets went first
    finally:
        for s in flood:
            s.close()
        for c in keyed:
            c.close()


@pytest.mark.parametrize("path", [OPENAI, ANTHROPIC])
def test_calls_over_the_cap_get_429_in_the_apis_shape_and_are_counted(caps: cases.FuzzServer, path: str) -> None:
    guard = caps.guard
    caps.engine.delay_s = 1.0
    before = caps.service.limit_events(caps.ids["a"]).get("calls_in_flight", 0)
    slow = [threading.Thread(target=cases.send, args=(caps.port, "POST", path, headers(caps, "a"), chat(path)))
            for _ in range(2)]
    try:
        for t in slow:
            t.start()
        deadline = time.monotonic() + 5
        while guard.in_flight(caps.ids["a"])[0] < 2:
            assert time.monotonic() < deadline, "the two slow calls never got in flight"
            time.sleep(0.01)
        out = cases.send(caps.port, "POST", path, headers(caps, "a"), chat(path))
        assert out.status == 429, out
        err = assert_shape(path, 429, out.body, "rate_limit_error")
        assert "calls in flight" in json.dumps(err)
        assert caps.service.limit_events(caps.ids["a"])["calls_in_flight"] == before + 1
        other = cases.send(caps.port, "POST", path, headers(caps, "b"), chat(path))
        assert other.status == 200, other  # the cap is a's alone
    finally:
        for t in slow:
            t.join(10)
        caps.engine.delay_s = 0.0
    assert guard.in_flight(caps.ids["a"]) == (0, 0)  # released when the calls ended


@pytest.mark.parametrize("path", [OPENAI, ANTHROPIC])
def test_connections_over_the_cap_get_429_and_are_closed(caps: cases.FuzzServer, path: str) -> None:
    eid = caps.ids["a"]
    before = caps.service.limit_events(eid).get("connections", 0)
    held = [http.client.HTTPConnection("127.0.0.1", caps.port, timeout=5) for _ in range(3)]
    extra = http.client.HTTPConnection("127.0.0.1", caps.port, timeout=5)
    try:
        for c in held:  # three keep-alive connections that carried a's calls: a's cap
            c.request("POST", path, body=chat(path), headers=headers(caps, "a"))
            assert c.getresponse().read() and True
        extra.request("POST", path, body=chat(path), headers=headers(caps, "a"))
        resp = extra.getresponse()
        body = resp.read()
        assert resp.status == 429 and resp.getheader("connection") == "close", (resp.status, body)
        assert_shape(path, 429, body, "rate_limit_error")
        assert caps.service.limit_events(eid)["connections"] == before + 1
        held[0].request("POST", path, body=chat(path), headers=headers(caps, "a"))  # a's own still serve
        assert held[0].getresponse().status == 200
    finally:
        for c in [*held, extra]:
            c.close()


@pytest.mark.parametrize("path", [OPENAI, ANTHROPIC])
def test_a_40_mb_body_gets_its_413_in_the_apis_shape(caps: cases.FuzzServer, path: str) -> None:
    """urllib writes the whole body, then reads (and asks to close the connection): the answer
    must still arrive, not a reset."""
    eid = caps.ids["a"]
    before = caps.service.limit_events(eid).get("body_too_large", 0)
    req = urllib.request.Request(f"http://127.0.0.1:{caps.port}{path}", data=b"x" * 40_000_000,
                                 headers=headers(caps, "a"))
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 413
    err = assert_shape(path, 413, info.value.read(), "request_too_large")
    assert "40000000" in json.dumps(err)
    assert caps.service.limit_events(eid)["body_too_large"] == before + 1


def test_a_chunked_body_is_counted_as_it_arrives(caps: cases.FuzzServer) -> None:
    before = caps.service.limit_events(caps.ids["b"]).get("body_too_large", 0)
    conn = http.client.HTTPConnection("127.0.0.1", caps.port, timeout=10)
    chunks = (b"x" * 65536 for _ in range(4 * cases.BODY_LIMIT // 65536))
    conn.request("POST", ANTHROPIC, body=chunks, headers=headers(caps, "b"), encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413
    assert_shape(ANTHROPIC, 413, resp.read(), "request_too_large")
    conn.close()
    assert caps.service.limit_events(caps.ids["b"])["body_too_large"] == before + 1


def test_silent_and_slow_connections_are_closed_and_a_stalled_body_gets_408() -> None:
    fs = cases.start_server(header_timeout_s=0.5, body_idle_timeout_s=0.5)
    try:
        idle = socket.create_connection(("127.0.0.1", fs.port))
        slow = socket.create_connection(("127.0.0.1", fs.port))
        t0 = time.monotonic()
        for piece in (b"POST /v1/messages HTTP/1.1\r\n", b"Host: x\r\n", b"x-a: b\r\n", b"x-c: d\r\n"):
            slow.sendall(piece)  # a head written a line every 0.2 s: past the 0.5 s deadline
            time.sleep(0.2)
        assert _closed(slow, 1.0) and _closed(idle, 1.0)
        assert time.monotonic() - t0 < 2.5
        assert fs.service.limit_summary()["wire"]["header_timeouts"] == 2
        # a head on time, then a body that stops: 408, in the API's shape
        stalled = socket.create_connection(("127.0.0.1", fs.port))
        head = (f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: {fs.keys['a']}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
        stalled.sendall(head.encode())
        stalled.settimeout(3)
        answer = stalled.recv(65536).decode()
        assert answer.startswith("HTTP/1.1 408"), answer
        assert json.loads(answer.split("\r\n\r\n", 1)[1])["error"]["type"] == "timeout_error"
        assert fs.service.limit_events(fs.ids["a"])["body_timeout"] == 1
        for s in (idle, slow, stalled):
            s.close()
    finally:
        fs.stop()


# ------------------------------------------------------------------------------ tokenizing


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    from gyre_core.tiny_model import cached_tiny_model

    return ChatRenderer.from_model_dir(cached_tiny_model())


class CountingRenderer(ChatRenderer):
    """The tiny model's renderer, counting the characters it was asked to encode."""

    encoded = 0

    def encode(self, text: str) -> list[int]:
        CountingRenderer.encoded += len(text)
        return super().encode(text)


def _service(renderer: ChatRenderer, **cfg: Any) -> Any:
    from gyre_core.proxy.fake_engine import FakeEngine
    from gyre_core.proxy.service import ProxyConfig, ProxyService

    svc = ProxyService(renderer, ProxyConfig(served_models=("tiny",), **cfg))
    svc.add_engine(FakeEngine("http://fake"))
    return svc


@pytest.mark.parametrize("chars", [3_000_000, 200_000])
def test_the_context_window_is_refused_before_the_prompt_is_encoded_whole(renderer: ChatRenderer, chars: int) -> None:
    """3 M characters cannot fit 8,192 tokens whatever they are (no token stands for more than 64
    characters): refused without encoding. 200 k could only fit at over 8 characters a token: the
    first piece already holds more tokens than the window, the rest is never encoded."""
    r = CountingRenderer(renderer.tokenizer)
    svc = _service(r, context_window=8192)
    eid, _ = svc.create_execution()
    request = ChatRequest(execution_id=str(eid), model="tiny", messages=(ChatMessage("user", "word " * (chars // 5)),))
    CountingRenderer.encoded = 0
    with pytest.raises(ProxyError) as info:
        svc.prepare(request)
    assert info.value.status == 400 and info.value.message.startswith("context_length_exceeded")
    assert CountingRenderer.encoded <= PIECE_CHARS + 100, CountingRenderer.encoded
    assert svc.records(eid).calls == []


def test_a_prompt_that_fits_is_encoded_exactly_as_before(renderer: ChatRenderer) -> None:
    text = "hello world, this is text.\n" * 20_000  # 540 k characters, 10 tokens a line: fits 10**6
    assert renderer.encode_within(text, 10**6) == renderer.encode(text)


def test_one_executions_huge_requests_do_not_hold_up_anothers(renderer: ChatRenderer) -> None:
    """Execution 1 sends three prompts that take most of a second each to encode; execution 2's
    small call is prepared meanwhile, on another worker, not after them."""
    svc = _service(renderer, context_window=10**9)
    big, small = svc.create_execution()[0], svc.create_execution()[0]

    def request(eid: int, text: str) -> ChatRequest:
        return ChatRequest(execution_id=str(eid), model="tiny", messages=(ChatMessage("user", text),))

    async def scenario() -> tuple[float, float]:
        t0 = time.monotonic()
        burst = [asyncio.ensure_future(svc.prepare_async(request(big, f"{i} " + "word " * 100_000)))
                 for i in range(3)]
        await asyncio.sleep(0.05)
        t1 = time.monotonic()
        await svc.prepare_async(request(small, "hi"))
        took = time.monotonic() - t1
        await asyncio.gather(*burst)
        return took, time.monotonic() - t0

    took, burst_s = asyncio.run(scenario())
    assert took < 0.5 and took < burst_s / 3, f"the small call waited {took:.2f} s behind a {burst_s:.2f} s burst"
