"""What ``gyre-score unittest`` costs per evaluation, against the plain evaluator it replaced.

Scores one example task (``examples/tasks/train.jsonl``'s first record, fixed) ``--repeats`` times
each way, as a run calls an evaluator (``run_evaluator_command`` in a real bubblewrap sandbox):
``gyre-score unittest`` (a scorer process plus an isolated test process), and the old shape, a
script that runs ``python -m unittest`` and trusts its exit code. Prints one JSON object: each
one's median and p90 wall time and the rewards seen (all must be 1.0).

    .venv/bin/python benchmarks/scoring_cost.py --repeats 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gyre_core.orchestrator.sandbox import SandboxSpec, prepare_dirs
from gyre_core.tasks.file_tasks import run_evaluator_command

ROOT = Path(__file__).resolve().parents[1]
PLAIN = ("import subprocess, sys\n"
         "sys.exit(subprocess.run([sys.executable, '-B', '-m', 'unittest', '-q'], capture_output=True).returncode)\n")
FIXES = {"add": "a + b", "mul": "a * b", "clamp": "max(lo, min(x, hi))", "last": "xs[-1]", "total": "sum(xs)",
         "count_even": "sum(1 for x in xs if x % 2 == 0)", "first_n": "xs[:n]", "is_adult": "age >= 18",
         "square": "x * x", "reverse": "s[::-1]"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    record = json.loads((ROOT / "examples" / "tasks" / "train.jsonl").read_text().splitlines()[0])
    base = Path(tempfile.mkdtemp(prefix="gyre-scoring-cost-"))
    base.chmod(0o755)
    try:
        sock = base / "sock"
        sock.mkdir(mode=0o711)
        (sock / "proxy.sock").touch()
        sandbox = SandboxSpec((), str(sock / "proxy.sock"), "127.0.0.1", 8399).as_extra()
        plain = base / "plain.py"
        plain.write_text(PLAIN)
        plain.chmod(0o644)
        scorer = shutil.which("gyre-score") or str(Path(sys.executable).with_name("gyre-score"))
        ways = {"gyre_score": [scorer, "unittest"], "plain_unittest": [sys.executable, str(plain)]}
        out: dict[str, object] = {"benchmark": "scoring_cost", "repeats": a.repeats, "cpus": os.cpu_count()}
        for name, cmd in ways.items():
            times, rewards = [], []
            for i in range(a.repeats):
                work, home = base / f"{name}{i}", base / f"{name}{i}.home"
                work.mkdir()
                home.mkdir()
                for f, content in record["workspace"].items():
                    if not f.startswith("test_"):
                        content = content[:content.index("return ") + 7] + FIXES[record["function"]] + "\n"
                    (work / f).write_text(content)
                prepare_dirs(work, home)
                t0 = time.perf_counter()
                value, detail = run_evaluator_command(cmd, str(work), 60.0, sandbox, record)
                times.append(time.perf_counter() - t0)
                rewards.append(value)
            times.sort()
            out[name] = {"median_s": round(statistics.median(times), 3),
                         "p90_s": round(times[min(len(times) - 1, int(0.9 * len(times)))], 3),
                         "rewards": sorted(set(map(str, rewards)))}
        print(json.dumps(out))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
