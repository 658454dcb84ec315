"""Benchmark-sized fuzz of the proxy's HTTP surface (both API faces and ``/gyre/``).

The same cases as ``tests/test_proxy_fuzz.py`` (``tests/proxy_fuzz_cases.py``: hostile requests,
and one in four a hostile policy output answered and echoed back), sent to the real app under
uvicorn on loopback with ``FakeEngine`` behind it, ``--requests`` of them (default 3000,
derandomised: the same requests every run). Prints one JSON object: answers by status, the
problems found (5xx, lost connections, wrong error shapes, non-strict JSON answers, crossings
between executions; all must be 0) and the request rate.

    .venv/bin/python benchmarks/proxy_fuzz.py --requests 3000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hypothesis import HealthCheck, given, settings  # noqa: E402

import proxy_fuzz_cases as cases  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000, help="cases to draw (a policy case with a follow-up "
                                                                 "sends two requests)")
    a = ap.parse_args()
    fs = cases.start_server()
    cases.KEYS.update(fs.keys)
    statuses: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    problems: list[str] = []
    t0 = time.monotonic()
    try:
        @settings(max_examples=a.requests, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases.any_case())
        def run(case: Any) -> None:
            kind = "policy" if isinstance(case, cases.PolicyCase) else "request"
            where = f"policy output via {case.path}" if kind == "policy" else f"{case[1]} {case[2]}"
            for out, problem in cases.run_case(fs, case):
                statuses["lost" if out.status is None else str(out.status)] += 1
                kinds[kind] += 1
                if problem is not None:
                    problems.append(f"{where}: {problem}"[:300])
                    fs.answered.update({k: len(fs.service.records(fs.ids[k]).calls) for k in ("a", "b")})

        run()
    finally:
        fs.stop()
    elapsed = time.monotonic() - t0
    sent = sum(statuses.values())
    classes = Counter(f"{k[0]}xx" if k != "lost" else k for k in statuses.elements())
    print(json.dumps({
        "benchmark": "proxy_fuzz", "requests": sent, "by_kind": {"hostile_requests": kinds["request"],
                                                                  "policy_output_calls": kinds["policy"]},
        "by_status": dict(sorted(statuses.items())),
        "by_class": dict(sorted(classes.items())), "problems": len(problems), "first_problems": problems[:10],
        "calls_recorded": {k: fs.answered[k] for k in ("a", "b")},
        "elapsed_s": round(elapsed, 1), "requests_per_s": round(sent / elapsed, 1),
    }))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
