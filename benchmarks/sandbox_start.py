"""What the sandbox costs at a harness's start: launch to exit of a trivial harness, sandboxed or not.

Each launch goes through the real launcher (``gyre_launch_harness``, ``harness.kind = "command"``)
with ``python -c pass`` as the harness: unsandboxed, and under the full sandbox (bubblewrap, the
relay, the privilege drop when root, the seccomp filter). Also times ``sandbox_problem`` (the
preflight check that starts one real sandbox). Prints one JSON object.

    .venv/bin/python benchmarks/sandbox_start.py --launches 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gyre_core.interfaces import ExecutionSpec
from gyre_core.orchestrator.harness import gyre_launch_harness
from gyre_core.orchestrator.sandbox import SandboxSpec, sandbox_problem


def _launch(root: Path, i: int, sandbox: dict | None) -> float:
    workdir = root / "run" / "executions" / f"e{i:05d}"
    extra: dict = {"command": [sys.executable, "-c", "pass"]}
    if sandbox is not None:
        extra["sandbox"] = sandbox
    spec = ExecutionSpec(execution_id=i, workdir=str(workdir), proxy_base_url="http://127.0.0.1:9", api_key="k",
                         harness_timeout_s=60, overall_budget_s=120, harness="command", task="t", extra=extra)
    t0 = time.perf_counter()
    handle = gyre_launch_harness(spec=spec)
    code = handle.wait(60)
    took = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"launch {i} exited {code}: {(workdir.parent / f'{workdir.name}.log').read_text()[-500:]}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=10)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-sandbox-bench-") as d:
        root = Path(d)
        (root / "run" / "executions").mkdir(parents=True)
        sock_dir = root / "sock"
        sock_dir.mkdir(mode=0o711)
        (sock_dir / "proxy.sock").touch()
        sandbox = SandboxSpec((str(root / "run"),), str(sock_dir / "proxy.sock"), "127.0.0.1", 8399).as_extra()
        t0 = time.perf_counter()
        problem = sandbox_problem("bwrap")
        check_s = time.perf_counter() - t0
        plain = [_launch(root, i, None) for i in range(a.launches)]
        boxed = [_launch(root, 1000 + i, sandbox) for i in range(a.launches)]
    out = {"launches": a.launches, "as_root": os.geteuid() == 0, "sandbox_problem": problem,
           "preflight_check_s": round(check_s, 3),
           "unsandboxed_s": {"median": round(statistics.median(plain), 4), "max": round(max(plain), 4)},
           "sandboxed_s": {"median": round(statistics.median(boxed), 4), "max": round(max(boxed), 4)},
           "overhead_s_median": round(statistics.median(boxed) - statistics.median(plain), 4)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
