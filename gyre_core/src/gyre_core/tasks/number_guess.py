"""``number-guess``: find a secret integer with a ``guess`` tool that answers higher/lower.

Multi-turn and tool-using by construction: the harness offers one tool, ``guess(number)``, and
answers each call with a tool result (``higher``/``lower``/``correct``); a reply without a tool
call is read as a guess too (its first integer), answered as a user message, so even an untrained
model gets its turns. After the last turn the harness writes ``answer.json`` (the final guess and
the transcript of what was asked) into its working directory; the evaluator scores that file:
``1 - |guess - secret| / span``, and ``0`` for a run that made no guess at all. The secret is
given to the harness (it plays the environment) and kept in the execution's record; it is never
put in the model's context. An ``answer.json`` that is not a regular file (a FIFO, a symlink) or is
over :data:`ANSWER_LIMIT_BYTES` counts as no answer, *unresolved* like a missing one
(:mod:`.workspace_files`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_core.hookspecs import hookimpl
from gyre_core.interfaces import Assessment, ExecutionSpec, StateRef, TaskOptions
from gyre_core.tasks.workspace_files import read_workspace_file

__all__ = ["ANSWER_LIMIT_BYTES", "TASK_NAME", "NumberGuessInstance", "make_instance", "score_workspace"]

TASK_NAME = "number-guess"
ANSWER_FILE = "answer.json"
ANSWER_LIMIT_BYTES = 1 << 20
"""Far above the harness's answer (a guess, a few integers): a larger file is no answer, and is never
read whole."""


@dataclass(frozen=True)
class NumberGuessInstance:
    secret: int
    low: int = 0
    high: int = 99
    turns: int = 3

    @property
    def prompt(self) -> str:
        return (f"I am thinking of an integer between {self.low} and {self.high}. Find it with the "
                f"guess tool; after each guess I say higher, lower or correct. You have {self.turns} guesses.")

    def as_extra(self) -> dict[str, Any]:
        return {"task": TASK_NAME, "secret": self.secret, "low": self.low, "high": self.high, "turns": self.turns}


def make_instance(group_id: int, seed: int = 0, turns: int = 3) -> NumberGuessInstance:
    """The query of rollout group ``group_id``: every execution of a group gets the same one."""
    rng = random.Random(seed * 1_000_003 + group_id)
    return NumberGuessInstance(secret=rng.randint(0, 99), turns=turns)


def score_workspace(workdir: str | Path, secret: int, low: int = 0, high: int = 99) -> tuple[float, str]:
    """Score of the answer file in ``workdir``; raises ``OSError``/``ValueError`` when the file is
    missing, not a regular file, over the limit or malformed (the evaluator then reports
    *unresolved*, never a zero)."""
    try:
        data = json.loads(read_workspace_file(workdir, ANSWER_FILE, ANSWER_LIMIT_BYTES))
    except RecursionError:  # deeply nested brackets: malformed, and must not escape the evaluator
        raise ValueError(f"{ANSWER_FILE} nests too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"{ANSWER_FILE} must hold a JSON object, got {type(data).__name__}")
    guess = data.get("final_guess")
    if guess is None:
        return 0.0, "no guess made"
    if isinstance(guess, bool) or not isinstance(guess, int):
        raise ValueError(f"final_guess must be an integer, got {guess!r}")
    g = min(max(guess, low), high)
    return 1.0 - abs(g - secret) / (high - low), f"guess {guess}, secret {secret}"


@hookimpl
def gyre_task_instance(task: str, group_id: int, seed: int, options: TaskOptions) -> NumberGuessInstance | None:
    if task != TASK_NAME:
        return None
    return make_instance(group_id, seed, options.turns)


@hookimpl
def gyre_evaluate(spec: ExecutionSpec, state: StateRef) -> Assessment | None:
    if spec.extra.get("task") != TASK_NAME:
        return None
    try:
        score, detail = score_workspace(spec.workdir, int(spec.extra["secret"]),
                                        int(spec.extra.get("low", 0)), int(spec.extra.get("high", 99)))
    except (OSError, ValueError, KeyError) as e:
        return Assessment.unresolved(state, f"{type(e).__name__}: {e}")
    return Assessment.valid(score, state, detail)
