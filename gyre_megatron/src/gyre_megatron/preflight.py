"""What a run's training side needs loaded, checked in the orchestrator before any rank starts.

Light on purpose: it locates megatron-core instead of importing it (seconds, and warnings), but
does load Mooncake's transfer engine, because what fails there is the dynamic loader
(``libibverbs.so.1``), which only a real import shows.
"""

from __future__ import annotations

import importlib
import importlib.util

__all__ = ["training_side_problems", "mooncake_problem"]

MOONCAKE_FIX = ("install the system package libibverbs1 (as root: apt-get install -y libibverbs1; "
                "without root see the README, 'System packages')")


def mooncake_problem() -> str | None:
    """Why Mooncake's transfer engine cannot be loaded here, or ``None`` when it can."""
    try:
        importlib.import_module("mooncake.engine")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("mooncake"):
            return ("Mooncake transfer engine: not installed (pip install mooncake-transfer-engine-non-cuda "
                    "on CPU, mooncake-transfer-engine with CUDA)")
        return f"Mooncake transfer engine: cannot be loaded ({exc})"
    except ImportError as exc:
        msg = str(exc)
        if "libibverbs" in msg:
            return f"Mooncake transfer engine: cannot be loaded ({msg.splitlines()[0]}); {MOONCAKE_FIX}"
        return f"Mooncake transfer engine: cannot be loaded ({msg.splitlines()[0] if msg else exc!r})"
    return None


def training_side_problems(cells: int) -> list[str]:
    problems: list[str] = []
    for mod, fix in (("torch", "pip install torch"), ("megatron.core", "pip install 'megatron-core>=0.13,<0.17'")):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            problems.append(f"{mod}: not installed ({fix})")
    if cells > 1:  # satellites join a running step by pulling the core's weights over Mooncake
        p = mooncake_problem()
        if p:
            problems.append(p)
    return problems
