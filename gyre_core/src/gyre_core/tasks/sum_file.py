"""``sum-file``: a coding-agent task -- add two numbers and write the result to ``answer.txt``.

Made for black-box coding harnesses (``harness.kind = "claude-code"``): the prompt asks for a file
in the working directory, which the agent writes with its own tools (Write, Bash, ...). The
evaluator reads the workspace the harness left: ``1`` when ``answer.txt`` holds exactly the sum
(surrounding whitespace ignored), ``0`` when it holds anything else or is absent -- the agent ran to
its end and did not solve the task, which is a real result. A workspace that cannot be read, or a
harness that crashed (a signal, the OOM killer, no final report) before writing the file, is
*unresolved* (retried or excluded), never scored. An ``answer.txt`` that is not a regular file (a
FIFO, a symlink) or is over :data:`ANSWER_LIMIT_BYTES` counts as no answer
(:mod:`.workspace_files`): it is never opened through, nor read past the limit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_core.hookspecs import hookimpl
from gyre_core.interfaces import Assessment, ExecutionSpec, StateRef, TaskOptions
from gyre_core.tasks.workspace_files import WorkspaceFileRefused, read_workspace_file

__all__ = ["ANSWER_LIMIT_BYTES", "TASK_NAME", "SumFileInstance", "make_instance", "score_answer", "score_workspace"]

TASK_NAME = "sum-file"
ANSWER_FILE = "answer.txt"
ANSWER_LIMIT_BYTES = 1 << 20
"""Far above any legitimate answer (a number): a larger file is no answer, and is never read whole."""


@dataclass(frozen=True)
class SumFileInstance:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"Compute {self.a} + {self.b} and write only the result to a file named {ANSWER_FILE} in the current directory."

    def as_extra(self) -> dict[str, Any]:
        return {"task": TASK_NAME, "a": self.a, "b": self.b}


def make_instance(group_id: int, seed: int = 0) -> SumFileInstance:
    rng = random.Random(seed * 1_000_033 + group_id)
    return SumFileInstance(rng.randint(10, 999), rng.randint(10, 999))


def score_answer(text: str, expected: int) -> tuple[float, str]:
    """``(reward, detail)`` of the text of ``answer.txt``."""
    text = text.strip()
    return (1.0, "correct") if text == str(expected) else (0.0, f"wrote {text[:40]!r}, expected {expected}")


def score_workspace(workdir: str | Path, expected: int) -> tuple[float, str]:
    """``(reward, detail)``, ``0`` when there is no usable answer file; raises ``OSError`` if the
    workspace itself cannot be read."""
    try:
        text = read_workspace_file(workdir, ANSWER_FILE, ANSWER_LIMIT_BYTES, errors="replace")
    except WorkspaceFileRefused as e:
        return 0.0, str(e)
    return score_answer(text, expected)


@hookimpl
def gyre_task_instance(task: str, group_id: int, seed: int, options: TaskOptions) -> SumFileInstance | None:
    return make_instance(group_id, seed) if task == TASK_NAME else None


@hookimpl
def gyre_evaluate(spec: ExecutionSpec, state: StateRef) -> Assessment | None:
    if spec.extra.get("task") != TASK_NAME:
        return None
    try:
        expected = int(spec.extra["a"]) + int(spec.extra["b"])
        try:
            text = read_workspace_file(spec.workdir, ANSWER_FILE, ANSWER_LIMIT_BYTES, errors="replace")
        except WorkspaceFileRefused as e:
            if spec.extra.get("harness_end") == "crashed":
                # the agent was stopped from outside (a signal, the OOM killer, a harness crash)
                # before it answered: nothing to assess, and not the agent's failure -- never a zero
                return Assessment.unresolved(state, f"harness crashed (exit {spec.extra.get('harness_exit')}) "
                                                    f"before writing {ANSWER_FILE}: {e}")
            return Assessment.valid(0.0, state, str(e))  # it ran to its end and left no answer
        score, detail = score_answer(text, expected)
    except (OSError, ValueError, KeyError) as e:
        return Assessment.unresolved(state, f"{type(e).__name__}: {e}")
    return Assessment.valid(score, state, detail)
