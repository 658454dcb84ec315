"""A failed run in one look: one line of cause per link of the exception chain on the console,
every traceback (ours and those the ranks sent back) in ``<out_dir>/error.log``.

A failure deep in a run passes through several layers (a rank's traceback inside a ``RankError``
inside the orchestrator's ``RunFailed``), and printing each layer's traceback buries the cause.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

__all__ = ["ERROR_LOG", "RunError", "RunFailed", "cause_lines", "write_error_log"]

ERROR_LOG = "error.log"

_TRACEBACK = "Traceback (most recent call last):"


class RunFailed(RuntimeError):
    """The run could not continue (a backend failed in a way the scheduler cannot absorb)."""


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line; a traceback embedded in the message (a remote rank's) is
    reduced to its last line, which names the remote exception."""
    text = str(exc).strip()
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    name = type(exc).__name__
    if not lines:
        return name
    head = lines[0]
    if any(_TRACEBACK in ln for ln in lines):
        prefix = head.split(_TRACEBACK)[0].strip()
        remote = [ln.strip() for ln in lines if not ln.startswith((" ", "\t")) and _TRACEBACK not in ln]
        last = remote[-1] if remote else lines[-1].strip()
        head = f"{prefix} ... {last}" if prefix else last
    elif len(lines) > 1:
        head = f"{head} (+{len(lines) - 1} more lines in the log)"
    return f"{name}: {head}"


def cause_lines(exc: BaseException, limit: int = 8) -> list[str]:
    """The chain from the outermost exception to its root cause, one line each, repeats dropped."""
    out: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(out) < limit:
        seen.add(id(cur))
        line = _one_line(cur)
        if not out or line != out[-1]:
            out.append(line)
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return out


def write_error_log(out_dir: Path, exc: BaseException) -> Path:
    """Append the full tracebacks of ``exc`` (with its chain) to ``out_dir/error.log``."""
    path = out_dir / ERROR_LOG
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"==== run failed at {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n")
        f.write("".join(traceback.format_exception(exc)))
        f.write("\n")
    return path


class RunError(RuntimeError):
    """A live run stopped on a failure; ``causes`` is its one-line-per-link chain, ``error_log``
    the file with every traceback. The original exception is the ``__cause__``."""

    def __init__(self, causes: list[str], error_log: Path) -> None:
        self.causes = causes
        self.error_log = error_log
        super().__init__(causes[0] if causes else "run failed")
