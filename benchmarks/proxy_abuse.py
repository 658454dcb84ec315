"""One abusive execution against the proxy: what a well-behaved execution's calls cost meanwhile.

The real app (``build_app``) under uvicorn (``uvicorn_config``, so with the wire limits) runs in a
process of its own on loopback, with ``FakeEngine`` behind it (a named stand-in that answers after
``--engine-delay`` seconds, the time a short generation takes; no model). A well-behaved execution
holds a conversation of Claude-Code-like size (a 20 KB system prompt, 2 KB tool results) over one
keep-alive connection, ``--calls`` calls in a row, first alone, then while a second process abuses
the proxy with another execution's key:

* an idle-connection flood: ``--idle`` sockets opened and never written to, reopened as the
  proxy closes them;
* huge bodies: 30 MB prompts (far past the window), 30 MB of JSON structure (``[[],[],...]``),
  and 40 MB bodies (past the 32 MiB limit), back to back from ``--huge-threads`` threads;
* many concurrent calls: ``--call-threads`` threads calling as fast as they are answered.

The server's descriptor limit is set to ``--fd-limit`` (1024: the common default) so that the
flood is larger than what the process could hold without the global cap. Prints one JSON object:
the well-behaved execution's p50 / p99 call latency alone and under abuse, the server's RSS
(before, peak during, after), what the abuser got back by status, and the proxy's refusal counts.

    .venv/bin/python benchmarks/proxy_abuse.py
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ------------------------------------------------------------------------------ the server


def serve(args: argparse.Namespace) -> None:
    """The proxy process: writes ``{port, keys, pid}`` to ``--info`` once serving, its refusal
    counts to ``--info``.stats when stopped (SIGTERM)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if args.fd_limit:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(args.fd_limit, hard), hard))
    import uvicorn

    from gyre_core.proxy.app import build_app
    from gyre_core.proxy.fake_engine import FakeEngine
    from gyre_core.proxy.http_layer import uvicorn_config
    from gyre_core.proxy.render import ChatRenderer
    from gyre_core.proxy.service import ProxyConfig, ProxyService
    from gyre_core.tiny_model import cached_tiny_model

    renderer = ChatRenderer.from_model_dir(cached_tiny_model())
    # a 128 k window, as served models have (the tiny model's own is 8 k)
    svc = ProxyService(renderer, ProxyConfig(served_models=("tiny",), context_window=131072, max_new_tokens=16))
    svc.add_engine(FakeEngine("fake://bench", default_output=tuple(renderer.encode("fine.<|im_end|>")),
                              delay_s=args.engine_delay))
    (good, good_key), (bad, bad_key) = svc.create_execution(), svc.create_execution()
    app = build_app(svc, admin_token="admin-" + "0" * 24)
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=0, timeout_graceful_shutdown=1))

    def announce() -> None:
        while not server.started:
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        Path(args.info).write_text(json.dumps({"port": port, "good": good_key, "bad": bad_key, "pid": os.getpid()}))

    threading.Thread(target=announce, daemon=True).start()
    server.run()
    Path(args.info + ".stats").write_text(json.dumps({
        "limit_events": svc.limit_summary(), "fd_soft_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "global_connection_cap": app.state.wire_guard.max_connections,
        "good_calls_recorded": len(svc.records(good).calls), "bad_calls_recorded": len(svc.records(bad).calls),
    }))


# ------------------------------------------------------------------------------ the abuser


def abuse(args: argparse.Namespace) -> None:
    """The abusive execution, for ``--seconds``; prints what it got back, as JSON."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    stop = time.monotonic() + args.seconds
    got: Counter[str] = Counter()
    lock = threading.Lock()
    auth = {"Authorization": f"Bearer {args.key}", "Content-Type": "application/json"}

    def note(what: str) -> None:
        with lock:
            got[what] += 1

    def post(conn: http.client.HTTPConnection | None, path: str, body: bytes) -> http.client.HTTPConnection | None:
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=60)
            conn.request("POST", path, body=body, headers=auth)
            resp = conn.getresponse()
            resp.read()
            note(str(resp.status))
            if resp.getheader("connection") == "close":
                conn.close()
                return None
            return conn
        except Exception as exc:  # noqa: BLE001 - counted: the abuser does not care
            note(type(exc).__name__)
            if conn is not None:
                conn.close()
            return None

    def idle_flood() -> None:
        sel = selectors.DefaultSelector()
        held = 0
        while time.monotonic() < stop:
            while held < args.idle:
                try:
                    s = socket.create_connection(("127.0.0.1", args.port), timeout=5)
                except OSError:
                    note("idle_connect_failed")
                    break
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ)
                held += 1
                note("idle_opened")
            for key, _ in sel.select(timeout=0.2):  # readable: the proxy closed it
                sel.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
                held -= 1
                note("idle_closed_by_proxy")
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]

    huge_prompt = b'{"model":"tiny","messages":[{"role":"user","content":"' + b"word " * 6_000_000 + b'"}]}'
    structure = b'{"model":"tiny","messages":[{"role":"user","content":"x"}],"metadata":[' + b"[]," * 10_000_000 + b"1]}"
    oversize = b'{"model":"tiny","messages":[{"role":"user","content":"' + b"x" * 40_000_000 + b'"}]}'

    def huge(i: int) -> None:
        conn = None
        n = i
        while time.monotonic() < stop:
            path = "/v1/messages" if n % 2 else "/v1/chat/completions"
            body = (huge_prompt, structure, oversize)[n % 3]
            if path == "/v1/messages" and body is huge_prompt:
                body = body[:-1] + b',"max_tokens":8}'
            conn = post(conn, path, body)
            n += 1

    small = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "again " * 50}]}).encode()

    def calls() -> None:
        conn = None
        while time.monotonic() < stop:
            conn = post(conn, "/v1/chat/completions", small)

    threads = [threading.Thread(target=idle_flood)]
    threads += [threading.Thread(target=huge, args=(i,)) for i in range(args.huge_threads)]
    threads += [threading.Thread(target=calls) for _ in range(args.call_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(dict(sorted(got.items()))))


# ------------------------------------------------------------------------------ the measurement


def _rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def conversation_calls(port: int, key: str, calls: int) -> tuple[list[float], Counter[str]]:
    """``calls`` calls of a well-behaved execution over one keep-alive connection: latencies, answers."""
    system = "You are a coding agent. " + "Follow the repository's conventions. " * 550  # ~20 KB
    tool_result = "src/module.py:12: def handler(request):\n" * 50  # ~2 KB
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    conn: http.client.HTTPConnection | None = None
    messages: list[dict[str, Any]] = []
    took: list[float] = []
    status: Counter[str] = Counter()
    for i in range(calls):
        if i % 20 == 0:  # a new task every 20 calls
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"task {i}: fix the bug"}]
        body = json.dumps({"model": "tiny", "messages": messages}).encode()
        t0 = time.perf_counter()
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("POST", "/v1/chat/completions", body=body, headers=auth)
            resp = conn.getresponse()
            answer = resp.read()
            status[str(resp.status)] += 1
        except Exception as exc:  # noqa: BLE001 - a lost connection is a finding: counted, then reconnect
            status[type(exc).__name__] += 1
            if conn is not None:
                conn.close()
            conn = None
            took.append(time.perf_counter() - t0)
            continue
        took.append(time.perf_counter() - t0)
        if resp.status == 200:
            content = json.loads(answer)["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": tool_result}]
    if conn is not None:
        conn.close()
    return took, status


def measure(args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="gyre-abuse-")
    info = os.path.join(tmp, "server.json")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    server = subprocess.Popen([sys.executable, str(HERE), "--role", "server", "--info", info,
                               "--fd-limit", str(args.fd_limit), "--engine-delay", str(args.engine_delay)],
                              env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(info):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the proxy did not start")
            time.sleep(0.1)
        time.sleep(0.2)
        srv = json.loads(Path(info).read_text())
        conversation_calls(srv["port"], srv["good"], 10)  # warm-up: template probe, caches
        rss_before = _rss_mb(srv["pid"])
        alone, alone_status = conversation_calls(srv["port"], srv["good"], args.calls)

        abuser = subprocess.Popen([sys.executable, str(HERE), "--role", "abuser", "--port", str(srv["port"]),
                                   "--key", srv["bad"], "--seconds", str(args.abuse_seconds), "--idle", str(args.idle),
                                   "--huge-threads", str(args.huge_threads), "--call-threads", str(args.call_threads)],
                                  env=env, stdout=subprocess.PIPE, text=True)
        peak = [rss_before]
        sampling = True

        def sample() -> None:
            while sampling:
                peak.append(_rss_mb(srv["pid"]))
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        time.sleep(args.ramp_s)  # the flood is up, the huge bodies are on their way
        t0 = time.monotonic()
        abused, abused_status = conversation_calls(srv["port"], srv["good"], args.calls)
        abused_s = time.monotonic() - t0
        out, _ = abuser.communicate(timeout=args.abuse_seconds + 180)
        sampling = False
        sampler.join()
        abuse_report = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        time.sleep(1.0)
        rss_after = _rss_mb(srv["pid"])
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    stats = json.loads(Path(info + ".stats").read_text()) if os.path.exists(info + ".stats") else {}
    if abused_s > args.abuse_seconds - args.ramp_s:
        print(f"note: the calls under abuse took {abused_s:.0f} s, past the abuser's run", file=sys.stderr)
    p50a, p50b = _pct(alone, 0.5), _pct(abused, 0.5)
    print(json.dumps({
        "benchmark": "proxy_abuse",
        "engine": f"FakeEngine (stand-in: answers after {args.engine_delay} s, no model)",
        "calls_per_phase": args.calls,
        "well_behaved_alone": {"p50_s": round(p50a, 3), "p99_s": round(_pct(alone, 0.99), 3),
                               "answers": dict(alone_status)},
        "well_behaved_under_abuse": {"p50_s": round(p50b, 3), "p99_s": round(_pct(abused, 0.99), 3),
                                     "answers": dict(abused_status)},
        "p50_ratio": round(p50b / p50a, 2), "p99_ratio": round(_pct(abused, 0.99) / _pct(alone, 0.99), 2),
        "abuser": {"idle_sockets": args.idle, "huge_body_threads": args.huge_threads,
                   "call_threads": args.call_threads, "got": abuse_report},
        "server": {"rss_mb_before": round(rss_before, 1), "rss_mb_peak": round(max(peak), 1),
                   "rss_mb_after": round(rss_after, 1), "rss_growth_mb_peak": round(max(peak) - rss_before, 1),
                   **stats},
        "machine": f"{os.cpu_count()} CPU cores shared by the proxy, the abuser and the client",
    }))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["measure", "server", "abuser"], default="measure", help=argparse.SUPPRESS)
    ap.add_argument("--calls", type=int, default=60, help="well-behaved calls per phase")
    ap.add_argument("--engine-delay", type=float, default=0.2)
    ap.add_argument("--fd-limit", type=int, default=1024, help="the proxy process's descriptor limit")
    ap.add_argument("--idle", type=int, default=800, help="idle sockets the abuser keeps open")
    ap.add_argument("--huge-threads", type=int, default=2)
    ap.add_argument("--call-threads", type=int, default=48)
    ap.add_argument("--abuse-seconds", type=float, default=40.0)
    ap.add_argument("--ramp-s", type=float, default=3.0)
    ap.add_argument("--info", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--key", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=30.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    {"measure": measure, "server": serve, "abuser": abuse}[args.role](args)


if __name__ == "__main__":
    main()
