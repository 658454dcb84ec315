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

``raise_fd_limit`` lifts the process's descriptor limit for the proxy it serves: every harness
connection is a descriptor, and the common default soft limit (1024) is a few hundred idle
sockets away from "Too many open files" for the whole run.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["FDS_BASE", "FdLimit", "die_with_parent", "fd_soft_limit", "fds_needed", "raise_fd_limit"]

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


FD_CEILING = 1 << 20
"""Highest soft descriptor limit :func:`raise_fd_limit` asks for, whatever the hard limit."""
FDS_PER_ENGINE = 64
"""Descriptors one engine costs the orchestrator: its client's connection pool, pipes, logs."""
FDS_BASE = 512
"""Everything else the orchestrator opens: the proxy fits its connection cap this far below the limit."""


def fd_soft_limit() -> int | None:
    """The process's ``RLIMIT_NOFILE`` soft limit (None: unlimited)."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def fds_needed(executions: int, connections_per_execution: int, engines: int) -> int:
    """Descriptors a run may need: every execution at its proxy connection cap, plus the engines."""
    return executions * connections_per_execution + engines * FDS_PER_ENGINE + FDS_BASE


@dataclass(frozen=True)
class FdLimit:
    """The descriptor limit after :func:`raise_fd_limit`, and whether ``needed`` fits under it."""

    soft: int | None
    """None: unlimited."""
    hard: int | None
    before: int | None
    needed: int

    @property
    def ok(self) -> bool:
        return self.soft is None or self.soft >= self.needed

    def line(self) -> str:
        """One line for the run's log: the limit, and what to do when it is short."""
        shown = "unlimited" if self.soft is None else str(self.soft)
        raised = "" if self.before == self.soft else f" (raised from {self.before})"
        if self.ok:
            return f"open files: limit {shown}{raised}, {self.needed} needed at most"
        return (f"warning: open files: limit {shown}{raised} (hard limit {self.hard}), but the executions' "
                f"connections and the engines may need {self.needed}; raise it (ulimit -n, or LimitNOFILE= "
                "in a systemd unit) or lower proxy connection caps: the proxy closes silent connections "
                "first when it runs short")


def raise_fd_limit(needed: int) -> FdLimit:
    """Raise ``RLIMIT_NOFILE``'s soft limit to its hard limit (an unprivileged process may; at most
    :data:`FD_CEILING`) and check it against ``needed`` descriptors (see :func:`fds_needed`).
    Never raises: where the limit cannot be changed (another platform, a container that forbids
    it) the current one is reported."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return FdLimit(None, None, None, needed)
    inf = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = None if soft == inf else int(soft)
    # an unlimited or huge hard limit: a large finite soft one (macOS refuses "unlimited", and some
    # programs the run starts size tables by the soft limit they inherit)
    target = hard if hard != inf and hard <= FD_CEILING else FD_CEILING
    if soft != inf and target > soft:
        for want in (target, 10240):  # 10240: OPEN_MAX, macOS's ceiling when the hard limit is unlimited
            if want <= soft:
                continue
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
                break
            except (ValueError, OSError):
                continue
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return FdLimit(None if soft == inf else int(soft), None if hard == inf else int(hard), before, needed)
