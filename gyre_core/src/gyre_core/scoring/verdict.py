"""The verdict an evaluator gives Gyre, signed with a token only the evaluator has seen.

Gyre starts each evaluator with one line on its standard input: a fresh random token. The
evaluator reads it before it runs any of the agent's code, and its verdict is its last stdout
line, a JSON object carrying the token as ``gyre_verdict``: ``{"reward": 1.0, "gyre_verdict":
"..."}``, ``{"complete_failure": true, ...}`` or ``{"unresolved": "why", ...}``. The agent's code
never sees the token (it is read before that code runs, and :func:`protect_self` keeps the
evaluator's memory and descriptors out of its children's reach), so a line it manages to write to
Gyre's pipe cannot be signed: a signed verdict followed by anything, or a verdict signed with
another token, makes the execution unresolved. Evaluators that ignore the token keep the plain
rules (exit 0 is 1.0, exit 1 is 0.0, or an unsigned last line ``{"reward": x}``).
"""

from __future__ import annotations

import ctypes
import json
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["TOKEN_KEY", "SignedVerdict", "emit", "protect_self", "read_token", "signed_verdict"]

TOKEN_KEY = "gyre_verdict"
"""The verdict's field that carries the token."""

_PR_SET_DUMPABLE = 4


def protect_self() -> None:
    """Make this process non-dumpable: its ``/proc/<pid>/fd``, ``environ`` and memory are then
    closed to processes of the same user without ``CAP_SYS_PTRACE`` (every child it starts)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def read_token() -> str:
    """The token on the first line of standard input ('' when run by hand, outside Gyre); standard
    input is then closed, so nothing started later can read what follows."""
    try:
        line = sys.stdin.readline()
    except (OSError, ValueError):
        line = ""
    try:
        sys.stdin.close()
    except OSError:
        pass
    return line.strip()


def emit(token: str, **verdict: Any) -> None:
    """Print the signed verdict as the last line of standard output."""
    print(json.dumps({**verdict, TOKEN_KEY: token}), flush=True)


@dataclass(frozen=True)
class SignedVerdict:
    """What Gyre read: ``verdict`` (the object; ``None`` when nothing was signed) or ``problem``
    (why the output cannot be trusted)."""

    verdict: dict[str, Any] | None = None
    problem: str = ""


def signed_verdict(output: str, token: str) -> SignedVerdict:
    """Gyre's side: the evaluator's signed verdict in ``output``, if it gave one.

    ``SignedVerdict()`` (neither field set): no line claims a signature, the plain rules apply.
    A ``problem``: a line claims a signature it cannot have (another token), or output follows
    the signed verdict; either way someone other than the evaluator wrote to its output."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    claimed = [i for i, ln in enumerate(lines) if TOKEN_KEY in ln]
    if not claimed:
        return SignedVerdict()
    signed: list[int] = []
    for i in claimed:
        try:
            obj = json.loads(lines[i])
        except ValueError:
            obj = None
        if isinstance(obj, dict) and token and obj.get(TOKEN_KEY) == token:
            signed.append(i)
        elif isinstance(obj, dict) and TOKEN_KEY in obj:
            return SignedVerdict(problem="a verdict signed with another token (written by the scored code?)")
    if not signed:
        return SignedVerdict()
    if signed[-1] != len(lines) - 1:
        return SignedVerdict(problem="output after the evaluator's signed verdict (written by the scored code?)")
    return SignedVerdict(verdict=json.loads(lines[signed[-1]]))
