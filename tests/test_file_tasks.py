"""A user's own tasks and rewards from files (``[task] train``, ``reward`` or ``evaluator``).

What a user relies on: every record is drawn once per epoch in a seeded order that a resume
reproduces; the prompt is the record's or the template's; a reward function's number is the
reward and its ``None`` or exception is unresolved (never a zero); an evaluator command's exit
code or last-line verdict is the reward, and its crash, signal or timeout is unresolved; every
mistake in the user's files is named before the run starts; a record's files reach the workspace.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_core.config import ConfigError
from gyre_core.interfaces import ExecutionSpec, StateRef, TaskOptions, Validity
from gyre_core.orchestrator.run_config import load_run_config
from gyre_core.tasks import file_tasks as ft


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), seed=st.integers(0, 10**6), epochs=st.integers(1, 3))
def test_each_epoch_draws_every_record_once_in_a_seeded_order(n: int, seed: int, epochs: int) -> None:
    draws = [ft.record_for_group(n, seed, g) for g in range(n * epochs)]
    for e in range(epochs):
        epoch = draws[e * n:(e + 1) * n]
        assert sorted(i for i, _ in epoch) == list(range(n)) and {ep for _, ep in epoch} == {e}
    assert draws == [ft.record_for_group(n, seed, g) for g in range(n * epochs)]  # a resume draws the same


def _files(tmp_path: Path) -> Path:
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Fix add", "expected": 5, "workspace": "repo"},
        {"name": "mul", "expected": 6},
    ]) + "\n")
    (tmp_path / "reward.py").write_text(
        "from pathlib import Path\n"
        "def score(record, workspace, outcome):\n"
        "    p = Path(workspace) / 'answer.txt'\n"
        "    if not p.exists():\n"
        "        return None if outcome['harness_end'] == 'crashed' else 0.0\n"
        "    return 1.0 if p.read_text().strip() == str(record['expected']) else 0.0\n"
        "def wrong(record, workspace, outcome):\n"
        "    return 'yes'\n")
    return tasks


def _spec(tmp_path: Path, extra: dict) -> tuple[ExecutionSpec, StateRef]:
    work = tmp_path / "w"
    work.mkdir(exist_ok=True)
    spec = ExecutionSpec(execution_id=1, workdir=str(work), proxy_base_url="http://127.0.0.1:1", api_key="k",
                         harness_timeout_s=10, overall_budget_s=60, harness="command", task="t",
                         extra={"evaluator_timeout_s": 5.0, **extra})
    return spec, StateRef(artifact_version="final", branch=str(work))


def test_records_become_instances_with_their_prompts_and_files(tmp_path: Path) -> None:
    tasks = _files(tmp_path)
    opts = TaskOptions(name="file", train=str(tasks), prompt_template="Make it {expected}",
                       reward=f"{tmp_path}/reward.py:score")
    seen = {}
    for g in range(2):
        inst = ft.gyre_task_instance(task="file", group_id=g, seed=3, options=opts)
        seen[inst.index] = inst
    assert set(seen) == {0, 1}
    with pytest.raises(ValueError, match="no string 'prompt'"):  # record 1 has none, and no template
        ft.render_prompt(seen[1].record, "")
    assert ft.render_prompt({"name": "mul"}, "Implement {name}") == "Implement mul"
    extra = seen[0].as_extra()
    assert seen[0].prompt == "Make it 5" and ft.render_prompt(seen[0].record, "") == "Fix add"
    assert extra["workspace_src"] == str((tmp_path / "repo").resolve())
    assert ft.gyre_task_instance(task="number-guess", group_id=0, seed=0, options=opts) is None


def test_a_reward_function_scores_and_its_none_or_exception_is_unresolved(tmp_path: Path) -> None:
    _files(tmp_path)
    rec = {"expected": 5}
    spec, state = _spec(tmp_path, {"task": "file", "record": rec, "reward": f"{tmp_path}/reward.py:score"})
    a = ft.gyre_evaluate(spec=spec, state=state)
    assert a.validity is Validity.VALID and a.score == 0.0  # ran to its end, no answer: the task's zero
    (Path(spec.workdir) / "answer.txt").write_text("5\n")
    assert ft.gyre_evaluate(spec=spec, state=state).score == 1.0
    os.unlink(Path(spec.workdir) / "answer.txt")
    crashed = ExecutionSpec(**{**spec.__dict__, "extra": {**spec.extra, "harness_end": "crashed", "harness_exit": -9}})
    assert ft.gyre_evaluate(spec=crashed, state=state).validity is Validity.UNRESOLVED  # None: never a zero
    wrong, _ = _spec(tmp_path, {"task": "file", "record": rec, "reward": f"{tmp_path}/reward.py:wrong"})
    with pytest.raises(TypeError, match="finite number or None"):  # the orchestrator counts it unresolved
        ft.gyre_evaluate(spec=wrong, state=state)


@pytest.mark.parametrize("script, expected", [
    ("raise SystemExit(0)", 1.0),
    ("raise SystemExit(1)", 0.0),
    ("print('log line'); print('{\"reward\": 0.25}')", 0.25),
    ("raise SystemExit(3)", None),                                   # neither pass nor fail
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", None),  # killed
    ("import time; time.sleep(60)", None),                           # past its timeout
    ("print('{\"reward\": \"high\"}')", None),                       # a malformed verdict
])
def test_an_evaluator_command_gives_a_reward_or_unresolved_never_a_made_up_zero(
        tmp_path: Path, script: str, expected: float | None) -> None:
    spec, state = _spec(tmp_path, {"task": "file", "record": {}, "evaluator": [sys.executable, "-c", script],
                                   "evaluator_timeout_s": 10.0})
    a = ft.gyre_evaluate(spec=spec, state=state)
    if expected is None:
        assert a.validity is Validity.UNRESOLVED, a
    else:
        assert a.validity is Validity.VALID and a.score == expected, a


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_the_evaluator_command_runs_inside_the_sandbox(tmp_path: Path, offline_sandbox: dict) -> None:
    from gyre_core.orchestrator.sandbox import SANDBOX_UID, prepare_dirs

    sandbox = offline_sandbox
    spec, state = _spec(tmp_path, {"task": "file", "record": {}, "sandbox": sandbox, "evaluator": [
        sys.executable, "-c", "import os, json; print(json.dumps({'reward': float(os.getuid())}))"]})
    home = Path(spec.workdir).parent / "w.home"
    home.mkdir()
    prepare_dirs(spec.workdir, home)
    a = ft.gyre_evaluate(spec=spec, state=state)
    assert a.validity is Validity.VALID and a.score == float(SANDBOX_UID), a


def test_mistakes_in_the_users_files_are_named_before_the_run(tmp_path: Path) -> None:
    tasks = _files(tmp_path)
    ok = {"train": str(tasks), "prompt_template": "Task: {expected}", "reward": f"{tmp_path}/reward.py:score"}
    assert ft.file_task_problems(ok) == []
    cases = {
        "No such file": {**ok, "train": str(tmp_path / "missing.jsonl")},
        "no function 'nope'": {**ok, "reward": f"{tmp_path}/reward.py:nope"},
        "finite number or None": {**ok, "reward": f"{tmp_path}/reward.py:wrong"},
        "no prompt": {**ok, "prompt_template": ""},  # record 1 has no prompt
        "not 'path/to/file.py:function'": {**ok, "reward": "reward.py"},
    }
    for needle, task in cases.items():
        problems = ft.file_task_problems(task)
        assert len(problems) == 1 and needle in problems[0], (needle, problems)


def test_the_config_names_what_a_task_file_needs(tmp_path: Path) -> None:
    tasks = _files(tmp_path)
    base = {"harness.kind": '"command"', "harness.command": '["true"]'}
    cfg = load_run_config(None, {**base, "task.train": json.dumps(str(tasks)), "task.reward": '"r.py:f"'})
    assert cfg.task.name == "file"
    with pytest.raises(ConfigError, match="task.reward"):
        load_run_config(None, {**base, "task.train": json.dumps(str(tasks))})
    with pytest.raises(ConfigError, match="task.reward"):
        load_run_config(None, {**base, "task.train": json.dumps(str(tasks)), "task.reward": '"r.py:f"',
                               "task.evaluator": '["true"]'})
    with pytest.raises(ConfigError, match="task.train"):
        load_run_config(None, {**base, "task.train": json.dumps(str(tasks)), "task.name": '"sum-file"'})


def test_a_records_files_are_copied_into_the_workspace_before_the_harness(tmp_path: Path) -> None:
    from gyre_core.orchestrator.harness import gyre_launch_harness

    _files(tmp_path)
    work = tmp_path / "run" / "executions" / "e00001"
    spec = ExecutionSpec(execution_id=1, workdir=str(work), proxy_base_url="http://127.0.0.1:1", api_key="k",
                         harness_timeout_s=30, overall_budget_s=60, harness="command", task="t",
                         extra={"command": [sys.executable, "-c", "import pathlib; pathlib.Path('seen.txt')"
                                            ".write_text(pathlib.Path('calc.py').read_text())"],
                                "workspace_src": str(tmp_path / "repo")})
    assert gyre_launch_harness(spec=spec).wait(30) == 0
    assert (work / "seen.txt").read_text() == (tmp_path / "repo" / "calc.py").read_text()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_the_example_tasks_evaluator_scores_a_fix_and_ignores_edited_tests(tmp_path: Path,
                                                                        offline_sandbox: dict) -> None:
    """``examples/tasks``: the shipped task set's evaluator (``gyre-score unittest``), as a run calls
    it (in the sandbox): the planted bug scores 0, the fix scores 1, and an agent that guts the test
    gains nothing."""
    from gyre_core.orchestrator.sandbox import prepare_dirs

    repo = Path(__file__).resolve().parents[1]
    examples = repo / "examples" / "tasks"
    record = json.loads((examples / "train.jsonl").read_text().splitlines()[0])
    sandbox = offline_sandbox
    work, home = tmp_path / "w", tmp_path / "w.home"
    work.mkdir()
    home.mkdir()
    for name, content in record["workspace"].items():
        (work / name).write_text(content)
    prepare_dirs(work, home)
    cmd = [shutil.which("gyre-score") or str(Path(sys.executable).with_name("gyre-score")), "unittest"]

    def score() -> float | None:
        return ft.run_evaluator_command(cmd, str(work), 60.0, sandbox, record)[0]

    module = next(n for n in record["workspace"] if not n.startswith("test_"))
    test = next(n for n in record["workspace"] if n.startswith("test_"))
    assert score() == 0.0  # the planted bug
    (work / test).write_text("")  # an agent deleting the test: the evaluator restores it
    assert score() == 0.0
    fixed = {"add": "a + b", "mul": "a * b", "clamp": "max(lo, min(x, hi))", "last": "xs[-1]", "total": "sum(xs)",
             "count_even": "sum(1 for x in xs if x % 2 == 0)", "first_n": "xs[:n]", "is_adult": "age >= 18",
             "square": "x * x", "reverse": "s[::-1]"}[record["function"]]
    src = record["workspace"][module]
    (work / module).write_text(src[:src.index("return ") + len("return ")] + fixed + "\n")
    assert score() == 1.0


def test_a_parquet_task_file_is_read_like_json_lines(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from gyre_core.tasks.file_tasks import gyre_task_instance, load_records

    records = [{"prompt": f"task {i}", "workspace": [("a.py", f"x = {i}\n")]} for i in range(3)]
    table = pa.table({"prompt": [r["prompt"] for r in records],
                      "workspace": pa.array([r["workspace"] for r in records], type=pa.map_(pa.string(), pa.string()))})
    path = tmp_path / "tasks.parquet"
    pq.write_table(table, path)
    assert [r["prompt"] for r in load_records(path)] == ["task 0", "task 1", "task 2"]
    inst = gyre_task_instance("file", 0, 7, TaskOptions(name="file", train=str(path), evaluator=("true",)))
    assert inst.prompt.startswith("task ") and inst.options["workspace_files"] == {"a.py": f"x = {inst.index}\n"}
