"""``digits``: a task a tiny policy can learn on a CPU in minutes, to show that a run learns.

The prompt states the target: reply with digits only. The reward depends on nothing but what
the policy samples: the fraction of the reply's non-blank characters that are digits (``0`` for
an empty reply -- the harness ran to its end and the policy said nothing, a real result). A random
tiny model starts well above zero (its vocabulary has digit tokens) with a spread across
executions, so group-relative advantages carry signal from the first step. Played by the
``reply`` harness (:mod:`.reply_harness`), which writes the policy's reply to ``reply.txt``.
A ``reply.txt`` that is not a regular file (a FIFO, a symlink) or is over :data:`REPLY_LIMIT_BYTES`
counts as no reply, *unresolved* like a missing one (:mod:`.workspace_files`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_core.hookspecs import hookimpl
from gyre_core.interfaces import Assessment, ExecutionSpec, StateRef, TaskOptions
from gyre_core.tasks.workspace_files import read_workspace_file

__all__ = ["REPLY_FILE", "REPLY_LIMIT_BYTES", "TASK_NAME", "DigitsInstance", "score_reply", "score_workspace"]

TASK_NAME = "digits"
REPLY_FILE = "reply.txt"
REPLY_LIMIT_BYTES = 16 << 20
"""Above any reply a policy can sample in one completion (millions of tokens' worth of text): a
larger file did not come from the policy, and is never read whole."""


@dataclass(frozen=True)
class DigitsInstance:
    variant: int

    @property
    def prompt(self) -> str:
        return f"Reply with digits only (0-9), as many as you can. Request {self.variant}."

    def as_extra(self) -> dict[str, Any]:
        return {"task": TASK_NAME}


def score_reply(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c in "0123456789" for c in chars) / len(chars) if chars else 0.0


def score_workspace(workdir: str | Path) -> tuple[float, str]:
    """``(reward, detail)``; raises ``OSError`` when there is no reply to assess (missing, not a
    regular file, over the limit) or the workspace cannot be read."""
    text = read_workspace_file(workdir, REPLY_FILE, REPLY_LIMIT_BYTES, errors="replace")
    return score_reply(text), f"{len(text)} characters"


@hookimpl
def gyre_task_instance(task: str, group_id: int, seed: int, options: TaskOptions) -> DigitsInstance | None:
    if task != TASK_NAME:
        return None
    return DigitsInstance(random.Random(seed * 1_000_037 + group_id).randint(0, 999))


@hookimpl
def gyre_evaluate(spec: ExecutionSpec, state: StateRef) -> Assessment | None:
    if spec.extra.get("task") != TASK_NAME:
        return None
    try:
        score, detail = score_workspace(spec.workdir)
    except OSError as e:  # no reply written (a crash, a lost engine): nothing to assess, never a zero
        return Assessment.unresolved(state, f"{type(e).__name__}: {e}")
    return Assessment.valid(score, state, detail)
