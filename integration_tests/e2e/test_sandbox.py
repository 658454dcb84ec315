"""Each execution in its own sandbox: from inside a real harness, nothing of another execution, of
the run's records or of the engines can be reached; the proxy can.

One live step (real Megatron cells, SGLang engines, proxy) whose harness (``command``) first probes
its sandbox, then makes its model call through the proxy and answers the number-guess task. Each
probe tries to list and read sibling workspaces, to find another execution's API key in any
``/proc/<pid>/environ``, to read the journal and the published weights, and to connect to every
engine port; it records what it got.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(600)]

SMALL_JOB = Path(__file__).with_name("small-job.toml")  # the embedded job at test sizes
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")

PROBE = r'''
import json, os, socket, sys, time
from pathlib import Path
from openai import OpenAI

engines_file, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
own = Path.cwd()
report = {"execution": os.environ["GYRE_EXECUTION_ID"]}
report["parent_listing"] = sorted(p.name for p in own.parent.iterdir())
report["siblings_read"] = [p.name for p in own.parent.glob("e*") if p.is_dir() and p != own
                           and not p.name.endswith(".home") and any(p.iterdir())]
mine = os.environ["OPENAI_API_KEY"]
found, pids = [], 0
for d in Path("/proc").iterdir():
    if d.name.isdigit():
        pids += 1
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        found += [e for e in env if e.startswith(b"OPENAI_API_KEY=") and e != b"OPENAI_API_KEY=" + mine.encode()]
report["visible_pids"], report["foreign_keys"] = pids, len(found)
for name in ("journal.jsonl", "weights/v0/model.safetensors", "events.jsonl"):
    try:
        (out_dir / name).read_bytes()
        report[name] = "read"
    except OSError as e:
        report[name] = type(e).__name__
deadline = time.monotonic() + 60
while not engines_file.exists() and time.monotonic() < deadline:
    time.sleep(0.2)
report["engines"] = {}
for url in json.loads(engines_file.read_text()):
    host, port = url.split("//")[1].rstrip("/").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        report["engines"][url] = "connected"
    except OSError as e:
        report["engines"][url] = type(e).__name__
client = OpenAI(max_retries=0, timeout=300.0)
reply = client.chat.completions.create(model=os.environ["GYRE_MODEL"], messages=[{"role": "user", "content": "Guess."}])
report["proxy"] = "answered" if reply.choices else "no choices"
Path("probe.json").write_text(json.dumps(report))
Path("answer.json").write_text(json.dumps({"final_guess": 50}))
'''


def test_a_harness_sees_nothing_of_other_executions_the_records_or_the_engines(tmp_path: Path) -> None:
    from gyre_core.orchestrator.embedded import run_live
    from gyre_core.orchestrator.run_config import load_run_config

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    engines_file = tmp_path / "engines.json"
    out = tmp_path / "run"
    cfg = load_run_config(SMALL_JOB, {"run.out_dir": str(out), "run.steps": 1, "harness.kind": '"command"',
                                 "harness.command": [sys.executable, str(script), str(engines_file), str(out.resolve())],
                                 "harness.sandbox": '"bwrap"'})

    def on_started(parts: dict[str, Any]) -> None:
        tmp = engines_file.with_suffix(".tmp")
        tmp.write_text(json.dumps([e.url for e in parts["engines"]]))
        os.replace(tmp, engines_file)

    summary = run_live(cfg, lambda m: None, on_started=on_started)
    assert summary["status"] == "ok" and summary["steps"] == 1
    reports = [json.loads(p.read_text()) for p in sorted((out / "executions").glob("e*/probe.json"))]
    assert len(reports) >= summary["executions"]["trained"] == 8
    for r in reports:
        eid = int(r["execution"])
        assert r["parent_listing"] == sorted([f"e{eid:05d}", f"e{eid:05d}.home"]), r
        assert r["siblings_read"] == [] and r["foreign_keys"] == 0, r
        assert r["visible_pids"] <= 4, r  # bwrap's init, the relay, the harness: its own PID namespace
        assert all(r[name] == "FileNotFoundError" for name in ("journal.jsonl", "weights/v0/model.safetensors",
                                                                "events.jsonl")), r
        assert r["engines"] and all(v != "connected" for v in r["engines"].values()), r
        assert r["proxy"] == "answered"
