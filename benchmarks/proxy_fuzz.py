"""Benchmark-sized fuzz of the proxy's HTTP surface (both API faces and ``/gyre/``).

The same hostile requests as ``tests/test_proxy_fuzz.py`` (``tests/proxy_fuzz_cases.py``), sent
to the real app under uvicorn on loopback with ``FakeEngine`` behind it, ``--requests`` of them
(default 3000, derandomised: the same requests every run). Prints one JSON object: answers by
status, the problems found (5xx, lost connections, wrong error shapes, crossings between
executions; all must be 0) and the request rate.

    .venv/bin/python benchmarks/proxy_fuzz.py --requests 3000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hypothesis import HealthCheck, given, settings  # noqa: E402

import proxy_fuzz_cases as cases  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    a = ap.parse_args()
    fs = cases.start_server()
    cases.KEYS.update(fs.keys)
    statuses: Counter[str] = Counter()
    problems: list[str] = []
    t0 = time.monotonic()
    try:
        @settings(max_examples=a.requests, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(req=cases.hostile_request())
        def run(req: tuple) -> None:
            who, method, path, headers, body = req
            out = cases.send(fs.port, method, path, headers, body)
            statuses["lost" if out.status is None else str(out.status)] += 1
            problem = cases.check(fs, who, method, path, body, out)
            if problem is not None:
                problems.append(f"{method} {path}: {problem}"[:300])
                fs.answered.update({k: len(fs.service.records(fs.ids[k]).calls) for k in ("a", "b")})

        run()
    finally:
        fs.stop()
    elapsed = time.monotonic() - t0
    sent = sum(statuses.values())
    classes = Counter(f"{k[0]}xx" if k != "lost" else k for k in statuses.elements())
    print(json.dumps({
        "benchmark": "proxy_fuzz", "requests": sent, "by_status": dict(sorted(statuses.items())),
        "by_class": dict(sorted(classes.items())), "problems": len(problems), "first_problems": problems[:10],
        "calls_recorded": {k: fs.answered[k] for k in ("a", "b")},
        "elapsed_s": round(elapsed, 1), "requests_per_s": round(sent / elapsed, 1),
    }))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
