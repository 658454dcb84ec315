"""KV hand-off time against re-prefill time for the same request (two real SGLang servers).

For each prompt length a greedy request runs on server A; once it has streamed a few tokens it is
handed off to server B (pin, abort, Mooncake read of its KV into B's pool, acknowledgement) and
continued there for one token. The same continuation is then timed on B after a cache flush
(re-prefill of prompt + partial output). Both paths share the abort; the comparison is
``import_s + continue_s`` (hand-off) against ``reprefill_s``. Prints one JSON object.

On the CPU development machine the model is tiny (2 layers, 64 bytes of K or V per token and
layer), so the bytes are few and the fixed costs (HTTP and scheduler round trips) dominate; on
GPUs with RDMA the transfer is the same call and the prefill it saves is far larger.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gyre_sglang.client import SGLangClient, parse_generate
from gyre_sglang.kv_handoff import continue_on, hand_off
from gyre_sglang.server import SGLangServer

MOVE_AFTER = 3


async def _stream(url: str, prompt: list[int], params: dict[str, Any], rid: str, started: asyncio.Event) -> Any:
    import aiohttp

    body = {"input_ids": prompt, "sampling_params": params, "rid": rid, "stream": True}
    last = None
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", json=body) as r:
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    last = json.loads(line[5:])
                    if len(last["output_ids"]) >= MOVE_AFTER:
                        started.set()
    started.set()
    return parse_generate(last)


async def _point(a: SGLangClient, b: SGLangClient, n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 1000) for _ in range(n)]
    params = {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}
    started = asyncio.Event()
    task = asyncio.create_task(_stream(a.url, prompt, params, f"bench-{seed}", started))
    await started.wait()
    res = await hand_off(a, b, f"bench-{seed}", timeout=60)
    partial = await task
    one = dict(params, max_new_tokens=len(partial.output_ids) + 1)
    t0 = time.perf_counter()
    cont = await continue_on(b, prompt, partial, one)
    continue_s = time.perf_counter() - t0
    await b.flush_cache()
    t0 = time.perf_counter()
    again = await continue_on(b, prompt, partial, one)
    reprefill_s = time.perf_counter() - t0
    assert again.output_ids == cont.output_ids and again.cached_tokens == 0
    return {
        "prompt_tokens": n, "moved_tokens": res.prefix_tokens, "fell_back": res.fell_back,
        "kv_bytes": res.bytes, "cached_tokens_after_handoff": cont.cached_tokens,
        "pin_s": round(res.pin_s, 4), "drain_s": round(res.drain_s, 4),
        "import_s": round(res.import_s, 4), "transfer_s": round(res.transfer_s, 4),
        "handoff_total_s": round(res.total_s, 4), "continue_s": round(continue_s, 4),
        "handoff_path_s": round(res.import_s + continue_s, 4), "reprefill_s": round(reprefill_s, 4),
        "transfer_mb_per_s": round(res.bytes / res.transfer_s / 1e6, 1) if res.transfer_s else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--model-dir", default="")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gyre-bench-kv-"))
    model = a.model_dir
    if not model:
        from gyre_core.tiny_model import build_tiny_model

        model = str(build_tiny_model(work / "model"))
    servers: dict[str, SGLangServer] = {}
    key = secrets.token_urlsafe(24)  # one run's engines share one engine key

    def start(name: str) -> None:
        servers[name] = SGLangServer(model, log_path=work / f"{name}.log", max_total_tokens=16384,
                                     api_key=key).start(300)

    threads = [threading.Thread(target=start, args=(n,)) for n in ("A", "B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    async def run() -> list[dict[str, Any]]:
        async with servers["A"].client() as ca, servers["B"].client() as cb:
            return [await _point(ca, cb, int(n), i) for i, n in enumerate(a.lengths.split(","))]

    try:
        if set(servers) != {"A", "B"}:
            raise SystemExit(f"a server did not start; logs in {work}")
        points = asyncio.run(run())
    finally:
        for s in servers.values():
            s.stop()
    print(json.dumps({
        "benchmark": "sglang_kv_handoff", "transport": "mooncake tcp (loopback)",
        "note": "handoff_path_s = import_s + continue_s; reprefill_s = same continuation after a flush",
        "points": points,
    }))


if __name__ == "__main__":
    main()
