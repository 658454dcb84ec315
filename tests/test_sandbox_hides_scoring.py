"""Nothing that scores an execution is visible to what is scored, tried from inside real sandboxes.

A run's config names task files (train and held-out), a reward or evaluator source and a task
generator that holds the solutions (``harness.sandbox_hide``). The harness (launched as a run
launches it) and the task's set-up must read none of them, nor the run folder; the evaluator must
read its own source but still neither task file, nor the run folder: it gets its record from Gyre.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from gyre_core.interfaces import ExecutionSpec
from gyre_core.orchestrator.embedded import hidden_paths
from gyre_core.orchestrator.harness import gyre_launch_harness
from gyre_core.orchestrator.run_config import load_run_config
from gyre_core.orchestrator.sandbox import SandboxSpec, prepare_dirs
from gyre_core.tasks.file_tasks import run_evaluator_command
from gyre_core.tasks.workspace_command import run_in_workspace

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
              pytest.mark.timeout(120)]

LOOK = r'''
import json, sys
from pathlib import Path
seen = {}
for name, p in json.loads(Path(sys.argv[1]).read_text()).items():
    try:
        seen[name] = Path(p).read_text()[:40]
    except OSError as e:
        seen[name] = type(e).__name__
print(json.dumps(seen))
Path(sys.argv[2]).write_text(json.dumps(seen)) if len(sys.argv) > 2 else None
'''


@pytest.fixture
def tmp_path() -> Any:
    """A folder outside ``/tmp`` (which every sandbox empties): where a user's job and run
    folders are, so the hiding itself is what keeps them from the sandbox."""
    d = Path(tempfile.mkdtemp(prefix=".gyre-hide-test-", dir=Path(__file__).resolve().parents[1]))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _world(tmp_path: Path) -> tuple[dict, dict[str, Path], Path]:
    tasks = tmp_path / "job"
    tasks.mkdir()
    files = {"train": tasks / "train.jsonl", "eval": tasks / "held_out.jsonl", "evaluator": tasks / "check.py",
             "generator": tasks / "make_tasks.py"}
    files["train"].write_text(json.dumps({"prompt": "p", "answer": "SECRET-train"}) + "\n")
    files["eval"].write_text(json.dumps({"prompt": "p", "answer": "SECRET-eval"}) + "\n")
    files["evaluator"].write_text("# SECRET-evaluator\n" + LOOK)
    files["generator"].write_text("# SECRET-generator\n")
    for f in files.values():
        f.chmod(0o644)  # readable by the sandbox's user, were it not hidden
    out = tmp_path / "runs" / "run-1"
    (out / "executions").mkdir(parents=True)
    files["journal"] = out / "journal.jsonl"
    files["journal"].write_text("SECRET-journal\n")
    cfg_file = tasks / "job.toml"
    cfg_file.write_text(f'''[task]
train = "{files["train"]}"
eval = "{files["eval"]}"
evaluator = ["{sys.executable}", "check.py"]
[harness]
kind = "command"
command = ["{sys.executable}", "-c", "pass"]
sandbox_hide = ["make_tasks.py"]
''')
    cfg = load_run_config(cfg_file)  # check.py and make_tasks.py resolve against the config's folder
    assert cfg.task.evaluator[1] == str(files["evaluator"]) and cfg.harness.sandbox_hide == [str(files["generator"])]
    sock = tmp_path / "sock"
    sock.mkdir(mode=0o711)
    (sock / "proxy.sock").touch()
    hide, judge_only = hidden_paths(cfg, out)
    spec = SandboxSpec(tuple(hide), str(sock / "proxy.sock"), "127.0.0.1", 8399, (), tuple(judge_only)).as_extra()
    for p in (tmp_path, tasks, out.parent, out, out / "executions"):
        p.chmod(0o755)
    return spec, files, out


def _secret(v: str) -> bool:
    return v.startswith("# SECRET") or v.startswith("SECRET") or "SECRET" in v


def test_the_harness_and_the_set_up_see_no_task_file_no_scorer_and_no_run_folder(tmp_path: Path) -> None:
    sandbox, files, out = _world(tmp_path)
    look = tmp_path / "look.py"
    look.write_text(LOOK)
    look.chmod(0o644)
    paths = str(tmp_path / "paths.json")
    Path(paths).write_text(json.dumps({k: str(v) for k, v in files.items()}))
    Path(paths).chmod(0o644)
    work = out / "executions" / "e00001"
    spec = ExecutionSpec(execution_id=1, workdir=str(work), proxy_base_url="http://127.0.0.1:8399", api_key="k-1",
                         harness_timeout_s=60, overall_budget_s=120, harness="command", task="t",
                         extra={"command": [sys.executable, str(look), paths, "seen.json"], "sandbox": sandbox,
                                "setup": [sys.executable, str(look), paths, "setup_seen.json"]})
    code = gyre_launch_harness(spec=spec).wait(60)
    assert code == 0, (work.parent / "e00001.log").read_text(errors="replace")
    for what in ("seen.json", "setup_seen.json"):
        seen = json.loads((work / what).read_text())
        leaked = {k: v for k, v in seen.items() if _secret(v)}
        assert not leaked, (what, leaked)


def test_the_evaluator_reads_its_own_source_but_no_task_file_and_no_run_folder(tmp_path: Path) -> None:
    sandbox, files, out = _world(tmp_path)
    work, home = out / "executions" / "e00002", out / "executions" / "e00002.home"
    work.mkdir()
    home.mkdir()
    prepare_dirs(work, home)
    paths = str(tmp_path / "paths.json")
    Path(paths).write_text(json.dumps({k: str(v) for k, v in files.items()}))
    Path(paths).chmod(0o644)
    code, stdout, detail = run_in_workspace([sys.executable, str(files["evaluator"]), paths], str(work), 60.0,
                                            sandbox, what="evaluator command", judge=True)
    assert code == 0, detail
    seen = json.loads(stdout.strip().splitlines()[-1])
    assert seen["evaluator"].startswith("# SECRET-evaluator")  # its own source: the judge may read it
    assert seen["generator"].startswith("# SECRET-generator")  # what only the harness must not see
    leaked = {k: v for k, v in seen.items() if k in ("train", "eval", "journal") and _secret(v)}
    assert not leaked, leaked
    # as a run calls it: the record comes from Gyre, with the verdict token
    value, detail = run_evaluator_command([sys.executable, "-c", "print('{\"reward\": 0.5}')"], str(work), 60.0,
                                          sandbox, {"answer": "from the record"})
    assert value == 0.5, detail
