"""Each execution in its own sandbox (bubblewrap), so no execution can reach another's records.

In agent RL the policy is optimised to get reward, so isolation is part of the reward's
integrity. A harness process runs under ``bwrap`` with:

* the host filesystem read-only, its own workspace and home the only writable places (its
  ``TMPDIR`` is in its home);
* the run folder hidden (a tmpfs over it): sibling workspaces, trajectories, the journal, the
  control key and the published weights are not there to read;
* its own PID namespace and ``/proc``: no sibling process, argv or ``environ`` is visible;
* its own network namespace, whose only way out is the proxy: a relay inside the sandbox
  (:mod:`gyre_core.orchestrator.sandbox_relay`) listens on the proxy's loopback address and
  forwards to the proxy's Unix socket, bound into the sandbox; engine ports and everything else on
  the host network are unreachable.

``harness.sandbox = "none"`` turns this off explicitly; a sandbox that cannot start is reported
before the run starts (:func:`sandbox_problem`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["SANDBOXES", "SandboxSpec", "sandbox_problem", "wrap"]

SANDBOXES = ("bwrap", "none")


@dataclass(frozen=True)
class SandboxSpec:
    """What the launcher needs (travels in ``ExecutionSpec.extra["sandbox"]`` as a dict)."""

    hide: tuple[str, ...]
    """Host paths to cover with an empty tmpfs (the run folder, a key file elsewhere)."""
    proxy_socket: str
    """The proxy's Unix socket on the host, bound into the sandbox at the same path."""
    proxy_host: str
    proxy_port: int

    def as_extra(self) -> dict[str, Any]:
        return {"hide": list(self.hide), "proxy_socket": self.proxy_socket, "proxy_host": self.proxy_host,
                "proxy_port": self.proxy_port}

    @classmethod
    def from_extra(cls, d: Mapping[str, Any]) -> "SandboxSpec":
        return cls(tuple(d["hide"]), str(d["proxy_socket"]), str(d["proxy_host"]), int(d["proxy_port"]))


BASE_ARGS = ("--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net",
             "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc")
"""The host read-only (``/tmp`` too: the harness's ``TMPDIR`` is a folder of its own home), and
its own PID, IPC, UTS and network namespaces."""


def wrap(argv: Sequence[str], sandbox: SandboxSpec, workdir: str, home: str) -> list[str]:
    """``argv`` run inside a bubblewrap sandbox (see the module docstring), through the relay."""
    args = ["bwrap", *BASE_ARGS]
    for path in sandbox.hide:  # a folder under an empty tmpfs, a file under /dev/null
        args += ["--tmpfs", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]
    # mount points inside the hidden folder are recreated on the tmpfs: only these come back
    args += ["--bind", workdir, workdir, "--bind", home, home, "--ro-bind", sandbox.proxy_socket,
             sandbox.proxy_socket, "--chdir", workdir, "--"]
    relay = [sys.executable, "-m", "gyre_core.orchestrator.sandbox_relay", sandbox.proxy_socket,
             sandbox.proxy_host, str(sandbox.proxy_port), "--"]
    return args + relay + list(argv)


def sandbox_problem(kind: str) -> str | None:
    """Why ``harness.sandbox = kind`` cannot start here (``None``: it can)."""
    if kind == "none":
        return None
    if shutil.which("bwrap") is None:
        return ("harness.sandbox: bubblewrap is not installed (apt-get install -y bubblewrap; "
                "or set harness.sandbox = \"none\" to run harnesses unsandboxed)")
    try:
        proc = subprocess.run(["bwrap", *BASE_ARGS, "--", "true"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"harness.sandbox: bubblewrap cannot start ({exc}); or set harness.sandbox = \"none\""
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return (f"harness.sandbox: bubblewrap cannot start a sandbox here ({why}; user and network "
                "namespaces must be allowed); or set harness.sandbox = \"none\"")
    return None
