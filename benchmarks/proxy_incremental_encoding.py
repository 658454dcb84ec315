"""Incremental encoding of the TITO proxy on a long synthetic execution (proxy only).

300 calls of one growing conversation whose contexts sum to ~1M tokens, served by ``FakeEngine``
(a stand-in that answers fixed tokens: this measures the proxy's own work, not a model). Reports
tokens encoded per call against the new content's tokens (should stay ~1), and the per-call proxy
time early vs late in the execution (should stay flat while the context grows ~300x), next to what
re-encoding the whole context would cost on the last call, and how the proxy rendered the calls
(tail renders vs full-render fallbacks, ``ProxyService.incremental_stats``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from gyre_core.proxy.fake_engine import FakeEngine
from gyre_core.proxy.render import ChatRenderer
from gyre_core.proxy.service import ProxyConfig, ProxyService
from gyre_core.proxy.types import ChatMessage, ChatRequest
from gyre_core.tiny_model import cached_tiny_model

WORDS = "read the file and run the tests then fix the bug in the parser output value error".split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--turn-words", type=int, default=14, help="words per new user turn")
    ap.add_argument("--window", type=int, default=50, help="calls in the first/last timing windows")
    args = ap.parse_args()

    renderer = ChatRenderer.from_model_dir(cached_tiny_model())
    svc = ProxyService(renderer, ProxyConfig(served_models=("tiny",), context_window=10**9, max_new_tokens=64))
    engine = FakeEngine("fake://echo", default_output=tuple(renderer.encode("ok, next step.<|im_end|>")))
    svc.add_engine(engine)
    eid, _ = svc.create_execution()
    messages = [ChatMessage("system", "You are a coding agent."), ChatMessage("user", "start")]
    per_call_s: list[float] = []
    encoded: list[int] = []
    new_content: list[int] = []
    contexts: list[int] = []

    async def run() -> None:
        for i in range(args.calls):
            t0 = time.perf_counter()
            resp = await svc.complete(ChatRequest(str(eid), "tiny", tuple(messages)))
            per_call_s.append(time.perf_counter() - t0)
            rec = svc.records(eid).calls[-1]
            encoded.append(len(rec.new_input_ids))
            contexts.append(rec.input_len)
            if i:
                prev = svc.records(eid).calls[-2]
                # new content: the tokens of the context that were not in the previous call's prompt+answer
                new_content.append(rec.input_len - prev.input_len - len(prev.output_ids))
            messages.append(ChatMessage("assistant", resp.content))
            words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(args.turn_words))
            messages.append(ChatMessage("user", f"{words} {i}"))

    asyncio.run(run())
    last_prompt = renderer.render(messages[:-2], add_generation_prompt=True)
    t0 = time.perf_counter()
    full = renderer.encode(last_prompt)
    full_encode_s = time.perf_counter() - t0
    k = max(1, args.calls // 10)
    w = max(1, min(args.window, args.calls // 2))
    first_w, last_w = per_call_s[1:w + 1], per_call_s[-w:]  # call 0 (the first, cold render) left out
    ratio = sum(encoded[1:]) / max(1, sum(new_content))
    print(json.dumps({
        "benchmark": "proxy_incremental_encoding",
        "engine": "FakeEngine (stand-in, fixed answer tokens; measures the proxy only)",
        "calls": args.calls,
        "context_tokens_sum": sum(contexts),
        "context_tokens_first_last": [contexts[0], contexts[-1]],
        "tokens_encoded_sum": sum(encoded),
        "encoded_over_new_content": round(ratio, 4),
        "max_encoded_per_call_after_first": max(encoded[1:]),
        "per_call_ms_first_10pct_median": round(1e3 * statistics.median(per_call_s[1:k + 1]), 3),
        "per_call_ms_last_10pct_median": round(1e3 * statistics.median(per_call_s[-k:]), 3),
        "window_calls": w,
        "per_call_ms_first_window_mean": round(1e3 * statistics.fmean(first_w), 3),
        "per_call_ms_last_window_mean": round(1e3 * statistics.fmean(last_w), 3),
        "per_call_ms_first_window_median": round(1e3 * statistics.median(first_w), 3),
        "per_call_ms_last_window_median": round(1e3 * statistics.median(last_w), 3),
        "last_over_first_window_mean": round(statistics.fmean(last_w) / statistics.fmean(first_w), 3),
        "rendering": svc.incremental_stats(),
        "full_reencode_last_context_ms": round(1e3 * full_encode_s, 3),
        "full_reencode_last_context_tokens": len(full),
        "tree_nodes": len(list(svc.records(eid).tree)),
    }))


if __name__ == "__main__":
    main()
