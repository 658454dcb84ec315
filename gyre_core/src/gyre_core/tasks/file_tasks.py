"""A user's own tasks and rewards from files: no plugin, no package.

``[task] train = "tasks.jsonl"`` (JSON lines, Parquet, or a JSON list) holds one record per task. The
prompt is the record's ``prompt``, or ``prompt_template`` formatted with the record's fields
(``"Fix {repo}: {issue}"``). A record's ``workspace`` is a file or folder (relative to the task
file) copied into the execution's workspace before the harness starts, or an object of
``{"relative/path": "content"}`` written there (a task file that carries its repositories).

The reward is either

* ``reward = "path/to/reward.py:function"``, called as ``function(record, workspace, outcome)``
  (``outcome``: ``{"harness_exit": code or None, "harness_end": "completed" | "failed" |
  "crashed"}``), returning a number (the reward), or ``None`` / raising for *unresolved* (retried
  within the budget, never a zero); or
* ``evaluator = ["gyre-score", "unittest"]`` (:mod:`gyre_core.scoring`) or a command of the user's
  own, run in the workspace -- inside the execution's sandbox, as the harness ran -- with a
  timeout: exit 0 is 1.0 and exit 1 is 0.0, unless its last stdout line is ``{"reward": x}``; any
  other exit, a signal or the timeout is unresolved. Its standard input holds a fresh verdict
  token (:mod:`gyre_core.scoring.verdict`): a verdict signed with it is the evaluator's own, and
  output after it, or a verdict signed with another token, is unresolved.

Either may declare a *complete failure* (the harness left nothing to judge): a reward function
returns ``{"complete_failure": True}``, an evaluator prints ``{"complete_failure": true}`` last. The
execution then gets the zero-reward placeholder: its zero counts in the group's advantages, and
none of its tokens is trained.

Groups draw records in a seeded order without replacement, epoch after epoch: group ``g`` takes
position ``g mod n`` of epoch ``g div n``'s permutation, a pure function of the seed and the group
id, so a resumed run (which replays the journalled group ids) draws exactly the same records.
Everything the user's files could get wrong is reported before the run starts
(:func:`file_task_problems`), one line each.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gyre_core.hookspecs import hookimpl
from gyre_core.interfaces import Assessment, ExecutionSpec, StateRef, TaskOptions
from gyre_core.scoring.verdict import signed_verdict
from gyre_core.tasks.workspace_command import run_in_workspace
from gyre_core.user_code import load_user_function

__all__ = ["TASK_NAME", "FileTaskInstance", "file_task_problems", "load_records", "record_for_group",
           "run_evaluator_command"]

TASK_NAME = "file"


@dataclass(frozen=True)
class FileTaskInstance:
    """One record as a task instance: the prompt, and what the evaluator needs in ``extra``."""

    index: int
    epoch: int
    record: Mapping[str, Any]
    prompt: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def as_extra(self) -> dict[str, Any]:
        return {"task": TASK_NAME, "record_index": self.index, "epoch": self.epoch, "record": dict(self.record),
                **self.options}


# ----------------------------------------------------------------------------- records


@lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int) -> tuple[dict[str, Any], ...]:
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: Parquet task files need pyarrow (pip install 'gyre-core[parquet]')") from None
        rows = pq.read_table(path).to_pylist()  # one dict per row, nested columns as lists and dicts
    elif path.endswith(".jsonl"):
        rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        text = Path(path).read_text(encoding="utf-8")
        rows = json.loads(text)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a JSON task file holds a list of records")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"{path}: record {i} is not an object")
    return tuple(rows)


def load_records(path: str | Path) -> tuple[dict[str, Any], ...]:
    """The task file's records (JSON lines ``.jsonl``, Parquet ``.parquet``, or a JSON list of
    objects); cached while unchanged."""
    p = str(Path(path).resolve())
    return _load(p, os.stat(p).st_mtime_ns)


def record_for_group(n: int, seed: int, group_id: int) -> tuple[int, int]:
    """``(record index, epoch)`` of group ``group_id``: a seeded permutation per epoch."""
    if n <= 0:
        raise ValueError("the task file holds no record")
    epoch, pos = divmod(group_id, n)
    order = list(range(n))
    random.Random(f"gyre-file-tasks/{seed}/{epoch}").shuffle(order)
    return order[pos], epoch


def render_prompt(record: Mapping[str, Any], template: str) -> str:
    if template:
        return template.format(**record)
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("the record has no string 'prompt' (or set task.prompt_template)")
    return prompt


# ----------------------------------------------------------------------------- rewards


def load_reward(target: str) -> Callable[..., Any]:
    """``"path/to/file.py:function"`` -> the function; ``ValueError`` naming what is wrong."""
    return load_user_function(target)


COMPLETE_FAILURE = "complete_failure"
"""What :func:`reward_value` makes of ``{"complete_failure": true}``: nothing to assess."""


def reward_value(value: Any) -> float | str | None:
    """A reward function's answer: a finite number, ``None`` (unresolved) or
    ``{"complete_failure": True}`` (:data:`COMPLETE_FAILURE`); else ``TypeError``."""
    if value is None:
        return None
    if isinstance(value, dict) and value.get("complete_failure") is True:
        return COMPLETE_FAILURE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise TypeError(f"a reward function must return a finite number or None, got {value!r}")
    return float(value)


def run_evaluator_command(cmd: Sequence[str], workdir: str, timeout_s: float,
                          sandbox: Mapping[str, Any] | None,
                          record: Mapping[str, Any] | None = None) -> tuple[float | str | None, str]:
    """Run the task's evaluator command in the workspace (inside the sandbox when the run has
    one; the task's record in ``GYRE_TASK_RECORD`` as JSON): ``(reward or None for unresolved,
    detail)``. Never raises for what the command does."""
    token = secrets.token_hex(16)
    code, out, detail = run_in_workspace(cmd, workdir, timeout_s, sandbox,
                                         {"GYRE_TASK_RECORD": json.dumps(dict(record or {}))}, "evaluator command",
                                         stdin_text=token + "\n", judge=True)
    if code is None:  # could not start, or gave no verdict in time
        return None, detail
    if code < 0 or code >= 128:  # a signal (the relay re-raises it; bwrap reports 128 + N): never a verdict
        return None, detail
    signed = signed_verdict(out, token)
    if signed.problem:
        return None, f"evaluator command: {signed.problem}"
    if signed.verdict is not None:
        verdict = signed.verdict
        if verdict.get("unresolved") is not None:
            return None, f"evaluator command: unresolved ({str(verdict['unresolved'])[:300]})"
        try:
            value = reward_value(verdict if verdict.get("complete_failure") is True else verdict.get("reward"))
        except TypeError as exc:
            return None, f"evaluator command printed a malformed verdict: {exc}"
        if value == COMPLETE_FAILURE:
            return value, "evaluator command: complete failure (nothing to assess)"
        if value is None:
            return None, "evaluator command: a signed verdict without a reward"
        why = f" ({str(verdict['why'])[:300]})" if verdict.get("why") else ""
        return value, f"evaluator command: reward {value}{why}"
    lines = out.strip().splitlines()
    if lines and lines[-1].lstrip().startswith("{"):
        try:
            verdict = json.loads(lines[-1])
            value = None
            if isinstance(verdict, dict):
                value = reward_value(verdict if verdict.get("complete_failure") is True else verdict.get("reward"))
        except (ValueError, TypeError) as exc:
            return None, f"evaluator command printed a malformed verdict: {exc}"
        if value == COMPLETE_FAILURE:
            return value, "evaluator command: complete failure (nothing to assess)"
        if value is not None:
            return value, f"evaluator command: reward {value}"
    if code in (0, 1):
        return 1.0 - code, detail
    return None, detail


# ----------------------------------------------------------------------------- hooks


@hookimpl
def gyre_task_instance(task: str, group_id: int, seed: int, options: TaskOptions) -> FileTaskInstance | None:
    if task != TASK_NAME or not options.train:
        return None
    records = load_records(options.train)
    index, epoch = record_for_group(len(records), seed, group_id)
    record = records[index]
    workspace = record.get("workspace")
    if isinstance(workspace, list):  # a Parquet map column reads back as (path, content) pairs
        workspace = dict(workspace)
    files = workspace if isinstance(workspace, dict) else {}
    src = str((Path(options.train).resolve().parent / workspace).resolve()) if isinstance(workspace, str) else ""
    return FileTaskInstance(index, epoch, record, render_prompt(record, options.prompt_template),
                            {"reward": options.reward, "evaluator": list(options.evaluator), "workspace_src": src,
                             "setup": list(options.setup), "setup_timeout_s": options.setup_timeout_s,
                             "workspace_files": {str(k): str(v) for k, v in files.items()}})


@hookimpl
def gyre_evaluate(spec: ExecutionSpec, state: StateRef) -> Assessment | None:
    x = spec.extra
    if x.get("task") != TASK_NAME:
        return None
    timeout = float(x.get("evaluator_timeout_s") or 60.0)
    if x.get("evaluator"):
        value, detail = run_evaluator_command(x["evaluator"], state.branch, max(1.0, 0.9 * timeout), x.get("sandbox"),
                                              x.get("record"))
    else:
        fn = load_reward(str(x["reward"]))
        outcome = {"harness_exit": x.get("harness_exit", 0), "harness_end": x.get("harness_end", "completed")}
        value = reward_value(fn(dict(x["record"]), state.branch, outcome))  # raising: unresolved, retried
        detail = f"{x['reward']} returned {value}"
    if value is None:
        return Assessment.unresolved(state, detail)
    if value == COMPLETE_FAILURE:
        return Assessment.complete_failure(state, detail)
    return Assessment.valid(float(value), state, detail)


def file_task_problems(task: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``[task]``'s files, one line each, before any process starts: an
    unreadable task file, a record without a prompt, a reward file that does not load or a
    function that is missing or answers with something other than a number or None."""
    if not task.get("train"):
        return []
    problems: list[str] = []
    records: tuple[dict[str, Any], ...] = ()
    for key in ("train", "eval"):
        if not task.get(key):
            continue
        try:
            these = load_records(task[key])
            if not these:
                problems.append(f"task.{key}: {task[key]} holds no record")
            for i, r in enumerate(these[:1000]):
                try:
                    render_prompt(r, str(task.get("prompt_template") or ""))
                except (KeyError, IndexError, ValueError) as exc:
                    problems.append(f"task.{key}: record {i}: no prompt ({type(exc).__name__}: {exc})")
                    break
            records = records or these
        except (OSError, ValueError) as exc:
            problems.append(f"task.{key}: {type(exc).__name__}: {exc}")
    if task.get("reward"):
        try:
            fn = load_reward(str(task["reward"]))
        except ValueError as exc:
            problems.append(f"task.reward: {exc}")
        else:
            if records:  # one call on an empty workspace: the answer's type, before the run
                import tempfile

                with tempfile.TemporaryDirectory(prefix="gyre-reward-check-") as d:
                    try:
                        reward_value(fn(dict(records[0]), d, {"harness_exit": 0, "harness_end": "completed"}))
                    except TypeError as exc:
                        problems.append(f"task.reward: {exc}")
                    except Exception:  # noqa: BLE001 - raising on an empty workspace is allowed (unresolved)
                        pass
    return problems
