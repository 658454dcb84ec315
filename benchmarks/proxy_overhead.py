"""Latency the TITO proxy adds per model call, and the call rate it sustains.

Sequential calls through the proxy's OpenAI endpoint (HTTP, auth, rendering, incremental
encoding, recording) against the same engine called directly with the same ``input_ids``.
Default engine: ``FakeEngine`` (a stand-in answering fixed tokens, so the numbers are the proxy's
own cost); ``--engine-url`` uses a real SGLang server instead (direct = its ``/generate``).
Sustained rate: ``--concurrency`` executions calling back to back for ``--seconds``.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import socket
import statistics
import threading
import time

import httpx
import uvicorn

from gyre_core.proxy.app import build_app
from gyre_core.proxy.fake_engine import FakeEngine
from gyre_core.proxy.render import ChatRenderer
from gyre_core.proxy.service import ProxyConfig, ProxyService
from gyre_core.tiny_model import cached_tiny_model


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--engine-url", help="a running SGLang server (default: FakeEngine stand-in)")
    ap.add_argument("--engine-key", help="that server's --api-key")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()

    renderer = ChatRenderer.from_model_dir(cached_tiny_model())
    svc = ProxyService(renderer, ProxyConfig(served_models=("tiny",), max_new_tokens=args.max_tokens,
                                             sampling={"temperature": 0.0}))
    if args.engine_url:
        from gyre_sglang.client import SGLangClient

        engine = SGLangClient(args.engine_url, api_key=args.engine_key)
    else:
        engine = FakeEngine("fake://bench", default_output=tuple(renderer.encode("fine.<|im_end|>")))
    svc.add_engine(engine)
    admin = secrets.token_urlsafe(24)
    port = _port()
    server = uvicorn.Server(uvicorn.Config(build_app(svc, admin_token=admin), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"

    def new_key(client: httpx.Client) -> str:
        return client.post(f"{base}/gyre/executions", headers={"Authorization": f"Bearer {admin}"}, json={}).json()["api_key"]

    body = {"model": "tiny", "messages": [{"role": "system", "content": "You are a coding agent."},
                                          {"role": "user", "content": "list the files in the repository please"}]}
    with httpx.Client(timeout=120) as client:
        key = new_key(client)
        hdr = {"Authorization": f"Bearer {key}"}
        for _ in range(5):  # warm-up
            client.post(f"{base}/v1/chat/completions", headers=hdr, json=body).raise_for_status()
        prompt_ids = svc.records(0).input_ids(svc.records(0).calls[-1])
        via_proxy, direct = [], []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            client.post(f"{base}/v1/chat/completions", headers=hdr, json=body).raise_for_status()
            via_proxy.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            if args.engine_url:
                client.post(f"{args.engine_url}/generate", json={"input_ids": prompt_ids, "return_logprob": True,
                            "sampling_params": {"temperature": 0.0, "max_new_tokens": args.max_tokens}}).raise_for_status()
            else:
                asyncio.run(engine.generate(prompt_ids, {"max_new_tokens": args.max_tokens}))
            direct.append(time.perf_counter() - t0)
        keys = [new_key(client) for _ in range(args.concurrency)]

    async def sustained() -> int:
        done = 0
        stop = time.perf_counter() + args.seconds
        async with httpx.AsyncClient(timeout=120) as ac:
            async def worker(k: str) -> None:
                nonlocal done
                while time.perf_counter() < stop:
                    r = await ac.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {k}"}, json=body)
                    r.raise_for_status()
                    done += 1
            await asyncio.gather(*(worker(k) for k in keys))
        return done

    t0 = time.perf_counter()
    n = asyncio.run(sustained())
    elapsed = time.perf_counter() - t0
    added = [p - d for p, d in zip(via_proxy, direct)]
    server.should_exit = True
    print(json.dumps({
        "benchmark": "proxy_overhead",
        "engine": args.engine_url or "FakeEngine (stand-in: fixed answer, no model; measures the proxy only)",
        "calls": args.calls,
        "prompt_tokens": len(prompt_ids),
        "proxy_ms_p50": round(1e3 * statistics.median(via_proxy), 3),
        "direct_ms_p50": round(1e3 * statistics.median(direct), 3),
        "added_ms_p50": round(1e3 * statistics.median(added), 3),
        "added_ms_p99": round(1e3 * _pct(added, 0.99), 3),
        "sustained_calls_per_s": round(n / elapsed, 1),
        "sustained_concurrency": args.concurrency,
        "note": "client and proxy share the machine's 2 cores",
    }))


if __name__ == "__main__":
    main()
