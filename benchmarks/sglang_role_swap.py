"""Each role-swap phase of a real SGLang server (CPU engine here), over several round trips.

Per round: start ``--inflight`` long requests, switch the serving side to training (stop intake,
hand off, abort, flush, release memory), then back to rollout (resume memory, load the tiny
model's weights from disk as a new version, reopen intake). Prints one JSON object with the
median and maximum of each phase. On the CPU engine release/resume are no-ops, so the figures
that matter here are the control-path costs (intake, hand-off listing, abort and drain, flush,
weight load of a tiny model); device memory moves are measured by the GPU test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from gyre_core.interfaces import WeightsRef
from gyre_core.tiny_model import build_tiny_model
from gyre_sglang.client import SGLangClient
from gyre_sglang.server import SGLangServer
from gyre_sglang.serving_side import SGLangServingSide


async def rounds(url: str, key: str, model_dir: str, n_rounds: int, inflight: int) -> dict[str, list[float]]:
    side = SGLangServingSide(url, cell=1, api_key=key)
    out: dict[str, list[float]] = defaultdict(list)
    async with SGLangClient(url, api_key=key) as c:
        for r in range(n_rounds):
            tasks = [asyncio.create_task(c.generate([3 + i, 4, 5], {"max_new_tokens": 2000, "ignore_eos": True},
                                                    rid=f"b{r}-{i}")) for i in range(inflight)]
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            down = await side.ato_training(lambda rids: None)
            t1 = time.monotonic()
            await asyncio.gather(*tasks)
            up = await side.ato_rollout(WeightsRef(version=r + 1, location=model_dir))
            t2 = time.monotonic()
            for p in (*down, *up):
                out[f"{p.transition}.{p.phase}"].append(p.duration)
            out["to_training.total"].append(t1 - t0)
            out["to_rollout.total"].append(t2 - t1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inflight", type=int, default=4)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        with SGLangServer(model, log_path=Path(tmp) / "server.log") as server:
            got = asyncio.run(rounds(server.url, str(server.api_key), str(model), a.rounds, a.inflight))
    phases = {k: {"median_s": round(statistics.median(v), 4), "max_s": round(max(v), 4)} for k, v in got.items()}
    print(json.dumps({"benchmark": "sglang_role_swap", "engine": "sglang-0.5.23-cpu", "rounds": a.rounds,
                      "inflight_requests": a.inflight, "phases": phases}))


if __name__ == "__main__":
    main()
