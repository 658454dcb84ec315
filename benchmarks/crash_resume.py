"""Kill the orchestrator again and again at random points of a real run, resume each time.

``gyre-orchestrate run`` (the embedded job) is SIGKILLed ``--kills`` times, each time right after
the journal has recorded a randomly chosen kind of progress (an execution's end, a step's end, a
publication, a role switch), and after half of the kills a torn half-record is appended to the
journal, as a crash mid-write would leave it. Each time it is resumed with ``--resume``; the last
resume runs to the end. Then: the final step count is reached, every execution that the journal
saw finish is still accounted for, none ended twice, no rollout group trained in two steps.
Prints one JSON object (also used by ``integration_tests/e2e/test_resume.py`` with few kills).

    python benchmarks/crash_resume.py [--kills 20] [--steps 10] [--seed 0] [--out runs/crash]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

KINDS = ("ExecutionEnded", "MicroStepsDone", "published", "TransitionDone")


def journal(out: Path) -> list[dict[str, Any]]:
    p = out / "journal.jsonl"
    recs = []
    if p.exists():
        for line in p.read_text(errors="replace").splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return recs


def count(recs: list[dict[str, Any]], kind: str) -> int:
    if kind == "published":
        return sum(1 for r in recs if r["kind"] == "published")
    return sum(1 for r in recs if r["kind"] == "event" and r["event"]["type"] == kind)


def steps_done(recs: list[dict[str, Any]]) -> int:
    return count(recs, "MicroStepsDone")


def _descendants(pid: int) -> list[Any]:
    try:
        import psutil
    except ImportError:  # the check needs psutil; without it nothing is counted
        return []
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _outliving(started: list[Any], within_s: float = 45.0) -> int:
    """How many of a killed run's processes are still alive ``within_s`` later (they should die
    with it through PR_SET_PDEATHSIG); any left are killed, so the chain goes on clean."""
    if not started:
        time.sleep(2.0)
        return 0
    import psutil

    def alive(p: Any) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + within_s
    left = [p for p in started if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = [p for p in left if alive(p)]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return len(left)


def _said(log: Path, out: Path) -> str:
    """What a segment that stopped by itself printed, and the run's error log: why it stopped."""
    parts = [f"--- {log.name} (tail)\n" + log.read_text(errors="replace")[-3000:]]
    err = out / "error.log"
    if err.exists():
        parts.append("--- error.log (tail)\n" + err.read_text(errors="replace")[-6000:])
    return "\n".join(parts)


def crash_chain(out: Path, kills: int, steps: int, seed: int, timeout_s: float = 900.0,
                config: Path | None = None, final_settings: Sequence[str] = ()) -> dict[str, Any]:
    """``final_settings``: ``--set`` values the last resume adds (e.g. another ``training.pp``:
    the core's checkpoint loads at the new layout)."""
    rng = random.Random(seed)
    cmd = [sys.executable, "-m", "gyre_core.cli", "run", "--out", str(out), "--steps", str(steps)]
    if config is not None:  # a job other than the embedded default (the same file at every resume)
        cmd += ["--config", str(config)]
    points: list[dict[str, Any]] = []
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    finished_at_kills: set[int] = set()
    for k in range(kills):
        recs = journal(out)
        if steps_done(recs) >= steps - 1:
            break  # too close to the end to crash meaningfully again
        kind = rng.choice(KINDS)
        target = count(recs, kind) + rng.randint(1, 3 if kind == "ExecutionEnded" else 1)
        args = cmd + (["--resume"] if k else [])
        with open(out.parent / f"{out.name}-segment{k}.log", "w") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + timeout_s
            try:
                while proc.poll() is None and time.monotonic() < deadline:
                    if count(journal(out), kind) >= target:
                        break
                    time.sleep(0.2)
                if proc.poll() is not None:
                    raise RuntimeError(f"segment {k} ended by itself (rc {proc.returncode}) before {kind} #{target}:\n"
                                       + _said(Path(log.name), out))
                started = _descendants(proc.pid)  # engines, ranks, harnesses: none may outlive the kill
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
            finally:
                if proc.poll() is None:
                    proc.kill()
        outlived = _outliving(started)
        finished_at_kills |= {r["event"]["execution_id"] for r in journal(out) if r["kind"] == "event"
                              and r["event"]["type"] == "ExecutionEnded" and r["event"]["outcome"] != "cancelled"}
        torn = k % 2 == 1
        if torn:  # a crash mid-write leaves half a record without its newline
            with open(out / "journal.jsonl", "ab") as f:
                f.write(b'{"kind":"published","version":99,"loc')
        points.append({"after": kind, "count": target, "torn_tail": torn, "steps_done": steps_done(journal(out)),
                       "outlived": outlived})
    extra = [a for kv in final_settings for a in ("--set", kv)]
    final = subprocess.run(cmd + (["--resume"] if points else []) + extra + ["--json-summary"], capture_output=True,
                           text=True, timeout=timeout_s)
    if final.returncode != 0:
        err = out / "error.log"
        raise RuntimeError(f"final resume failed: {final.stderr[-3000:]}"
                           + (f"\n--- error.log (tail)\n{err.read_text(errors='replace')[-6000:]}" if err.exists() else ""))
    summary = json.loads(final.stdout.strip().splitlines()[-1])
    recs = journal(out)
    ends = [r["event"]["execution_id"] for r in recs if r["kind"] == "event" and r["event"]["type"] == "ExecutionEnded"]
    segment_logs = [p.read_text(errors="replace") for p in sorted(out.parent.glob(f"{out.name}-segment*.log"))]
    rebuilt = sum(1 for text in segment_logs + [final.stderr] if "rebuilding published policy version" in text)
    groups = [g for rec in summary["step_records"] for g in rec["groups"]]
    ex = summary["executions"]
    accounted = ex["trained"] + ex["dropped"] + ex["filtered"] + ex["surplus"] + ex["excluded"] + ex["waiting"] + ex["cancelled"]
    return {"benchmark": "crash_resume", "kills": len(points), "points": points, "steps": summary["steps"],
            "target_steps": steps, "ended": len(ends), "ended_twice": len(ends) - len(set(ends)),
            "groups_trained": len(groups), "groups_trained_twice": len(groups) - len(set(groups)),
            "finished": ex["finished"], "accounted": accounted, "executions": ex,
            "lost": len(finished_at_kills - set(ends)), "outlived": sum(p["outlived"] for p in points),
            "resumes_rebuilding_a_publication": rebuilt,
            # what checkpoint.keep_last left of the core's training checkpoints
            "checkpoints_on_disk": sorted(p.name for p in (out / "checkpoints").iterdir())
            if (out / "checkpoints").is_dir() else [],
            "wall_s": round(time.monotonic() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=f"runs/crash-{time.strftime('%Y%m%d-%H%M%S')}")
    a = ap.parse_args()
    res = crash_chain(Path(a.out), a.kills, a.steps, a.seed)
    res["ok"] = (res["steps"] == res["target_steps"] and res["ended_twice"] == 0 and res["groups_trained_twice"] == 0
                 and res["accounted"] == res["finished"] and res["lost"] == 0 and res["outlived"] == 0)
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
