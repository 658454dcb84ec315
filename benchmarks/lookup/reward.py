"""The ``lookup`` task's reward (``[task] reward = "benchmarks/lookup/reward.py:score"``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping


def answer_of(text: str) -> int | None:
    m = re.search(r"\d+", text)
    return int(m.group()) if m else None


def score(record: Mapping[str, Any], workspace: str, outcome: Mapping[str, Any]) -> float | None:
    """1.0 when the final answer's first number is the asked entry's code, else 0.0. No answer
    file is *unresolved* (``None``, never a zero): the harness writes one whenever both of its
    calls came back, so its absence means the harness or the proxy failed, not the policy."""
    path = Path(workspace) / "answer.txt"
    if not path.is_file():
        return None
    return 1.0 if answer_of(path.read_text()[:4096]) == int(record["answer"]) else 0.0
