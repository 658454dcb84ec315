"""How long a real SGLang server (CPU engine here) takes to start and to stop, and the CPU it burns.

Every end-to-end run starts two engines before its first step, and a watchdog restart starts one
more, so on a small machine the start is a fixed cost paid many times. Two start methods for the
server's scheduler and detokenizer: ``fork`` (Gyre's default for a CPU server: they inherit the
launcher's imports) and SGLang's own ``spawn`` (``GYRE_SGLANG_CPU_SPAWN=1``: each imports torch and
SGLang again). Each start is one server, started, stopped, in turn. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from gyre_core.tiny_model import cached_tiny_model
from gyre_sglang.testing import start_sglang_server


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def one(model: Path, log_dir: Path, name: str) -> dict[str, float]:
    cpu0, t0 = children_cpu_s(), time.monotonic()
    server = start_sglang_server(model, log_dir, name)
    started = time.monotonic() - t0
    t1 = time.monotonic()
    server.stop()
    return {"start_s": started, "stop_s": time.monotonic() - t1, "cpu_s": children_cpu_s() - cpu0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="starts per method")
    args = ap.parse_args()
    model = Path(cached_tiny_model())
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in ("fork", "spawn"):
            if method == "spawn":
                os.environ["GYRE_SGLANG_CPU_SPAWN"] = "1"
            else:
                os.environ.pop("GYRE_SGLANG_CPU_SPAWN", None)
            runs = [one(model, Path(tmp), f"{method}{i}") for i in range(args.repeats)]
            out[method] = {f"{k}_median": round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    os.environ.pop("GYRE_SGLANG_CPU_SPAWN", None)
    print(json.dumps({"benchmark": "sglang_engine_start", "repeats": args.repeats, **out}))


if __name__ == "__main__":
    main()
