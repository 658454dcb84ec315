"""Child processes that cannot outlive the process that started them.

Gyre starts engines, training ranks and harnesses in their own process groups (so teardown
reaches their children and nothing else). If the orchestrator itself is killed (SIGKILL, OOM),
nobody runs that teardown; on Linux the kernel can: ``PR_SET_PDEATHSIG`` sends the child SIGKILL
when its parent thread dies, so a crashed orchestrator never leaves a GPU-holding engine behind
and ``--resume`` finds its ports and devices free. Elsewhere it is a no-op.

``die_with_parent`` runs as ``subprocess.Popen(preexec_fn=...)``, between fork and exec in a
process that may have other threads: it must not import, lock or allocate Python objects there
(an import lock held by another thread at fork time would hang the child forever), so libc's
``prctl`` is resolved once, here, at import time.
"""

from __future__ import annotations

import signal
import sys
from typing import Any, Callable

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1
_SIGKILL = int(signal.SIGKILL)


def _resolve_prctl() -> Callable[..., Any] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return None


_prctl = _resolve_prctl()


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (thread) dies (Linux only)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
