"""Each execution in its own sandbox (bubblewrap), so no execution can reach another's records.

In agent RL the policy is optimised to get reward, so a harness is untrusted code and isolation is
part of the reward's integrity. Whoever starts the run (root included, as in most containers), a
harness process runs:

* **as an unprivileged user with no capabilities**: host uid/gid ``SANDBOX_UID`` (``nobody``), all
  capability sets empty, ``no_new_privs`` set. When the orchestrator is root, bubblewrap builds the
  sandbox in a user namespace that maps only root and that uid (:func:`_root_userns`), and the
  relay drops to the uid before anything of the harness runs; otherwise bubblewrap's own user
  namespace maps the caller's uid, which is unprivileged by definition;
* **under a system-call filter** (seccomp, :mod:`gyre_core.orchestrator.sandbox_filter`): no
  ``mount``, ``ptrace``, ``keyctl``, ``bpf``, namespace creation, module loading, ..., and no
  ``socket(AF_UNIX)``: no host Unix socket (SGLang's, Ray's, D-Bus, Docker) can be connected to;
* in **its own PID, IPC, UTS, network and mount namespaces**, in a new session (no ``TIOCSTI`` into
  the orchestrator's terminal), with a **fresh minimal environment**;
* on the **host filesystem read-only**, with private empty ``/tmp``, ``/var/tmp`` and ``/run``
  (``/var/run``), an **empty home over the orchestrator's ``$HOME``** (and ``/root``): no
  ``~/.ssh``, ``~/.netrc``, tokens; the **run folder hidden** (sibling workspaces, trajectories,
  the journal, the control key, published weights) and any **sibling run folder** beside it, and
  **what scores it hidden**: the task files (train and held-out) from everything, the reward or
  evaluator source (and ``harness.sandbox_hide``) from the harness and the set-up; its own
  workspace and home the only writable places;
* with **the proxy as the only way out**: a relay inside the sandbox
  (:mod:`gyre_core.orchestrator.sandbox_relay`) listens on the proxy's loopback address and
  forwards to the proxy's Unix socket, bound in from a folder that holds nothing else.

What the harness needs to run is bound back read-only after the empty layers: the Python
environment (prefixes and ``sys.path``), the harness program's folder and the files its command
names. ``harness.sandbox = "none"`` turns all of this off explicitly; a host on which these
properties cannot hold is refused before the run starts (:func:`sandbox_problem`).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["SANDBOXES", "SANDBOX_UID", "SandboxLaunch", "SandboxSpec", "prepare_dirs", "sandbox_problem", "wrap"]

SANDBOXES = ("bwrap", "none")

SANDBOX_UID = 65534
"""The host uid and gid every harness runs as (``nobody``): owns nothing, belongs to no group."""

_CLONE_NEWUSER = 0x10000000


@dataclass(frozen=True)
class SandboxSpec:
    """What the launcher needs (travels in ``ExecutionSpec.extra["sandbox"]`` as a dict)."""

    hide: tuple[str, ...]
    """Host paths to cover with an empty tmpfs (the run folder, a key file elsewhere)."""
    proxy_socket: str
    """The proxy's Unix socket on the host, bound into the sandbox at the same path."""
    proxy_host: str
    proxy_port: int
    expose: tuple[str, ...] = ()
    """Host paths bound back read-only after everything is hidden (``harness.sandbox_expose``)."""
    hide_from_harness: tuple[str, ...] = ()
    """Host paths hidden from the harness and the task's set-up but not from its evaluator: what
    scores an execution (the reward or evaluator source, ``harness.sandbox_hide``)."""

    def as_extra(self) -> dict[str, Any]:
        return {"hide": list(self.hide), "proxy_socket": self.proxy_socket, "proxy_host": self.proxy_host,
                "proxy_port": self.proxy_port, "expose": list(self.expose),
                "hide_from_harness": list(self.hide_from_harness)}

    @classmethod
    def from_extra(cls, d: Mapping[str, Any]) -> "SandboxSpec":
        return cls(tuple(d["hide"]), str(d["proxy_socket"]), str(d["proxy_host"]), int(d["proxy_port"]),
                   tuple(d.get("expose", ())), tuple(d.get("hide_from_harness", ())))


@dataclass
class SandboxLaunch:
    """How to start one sandboxed harness: the argument list and the descriptors it inherits."""

    argv: list[str]
    pass_fds: tuple[int, ...] = field(default_factory=tuple)


BASE_ARGS = ("--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
             "--unshare-net", "--unshare-cgroup-try", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc")
"""The host read-only, and its own PID, IPC, UTS, network and cgroup namespaces, in a new session."""

PRIVATE = ("/tmp", "/var/tmp", "/run", "/var/run")
"""Shared folders where host services keep their Unix sockets and scratch: empty in a sandbox."""


# ----------------------------------------------------------------------------- identity


_userns_lock = threading.Lock()
_userns_fd: int | None = None


def _root_userns() -> int:
    """A user namespace (its descriptor; made once per process) that maps root to root and
    :data:`SANDBOX_UID` to itself, nothing else. Why: bubblewrap run by root builds the sandbox
    with root's access to the host (it binds back folders under a 0700 ``/root``), and the relay
    then switches to ``SANDBOX_UID`` inside it, which is the host's ``nobody``; bubblewrap's own
    ``--unshare-user --uid`` would map the sandbox's user to host root."""
    global _userns_fd
    with _userns_lock:
        if _userns_fd is not None:
            return _userns_fd
        libc = ctypes.CDLL(None, use_errno=True)
        ready_r, ready_w = os.pipe()
        done_r, done_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the namespace's first member: it lives until the parent has its descriptor
            try:
                os.close(ready_r)
                os.close(done_w)
                ok = libc.unshare(_CLONE_NEWUSER) == 0
                os.write(ready_w, b"1" if ok else b"0")
                os.read(done_r, 1)
            finally:
                os._exit(0)
        os.close(ready_w)
        os.close(done_r)
        try:
            if os.read(ready_r, 1) != b"1":
                raise OSError("unshare(CLONE_NEWUSER) failed: user namespaces are not allowed here")
            mapping = f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n"
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(mapping)
            _userns_fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.write(done_w, b"1")
            os.close(done_w)
            os.close(ready_r)
            os.waitpid(pid, 0)
        return _userns_fd


def _identity_args() -> tuple[list[str], tuple[int, ...], list[str]]:
    """bwrap's user-namespace arguments, the descriptors they name, and the relay's options."""
    if os.geteuid() == 0:
        fd = _root_userns()
        return ["--userns", str(fd)], (fd,), ["--drop-to", str(SANDBOX_UID)]
    return ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--disable-userns",
            "--cap-drop", "ALL"], (), []


def prepare_dirs(*paths: str | Path) -> None:
    """Make the execution's workspace and home writable by the sandbox's user (root runs only:
    otherwise they already belong to the caller, whom the sandbox's uid maps to)."""
    if os.geteuid() != 0:
        return
    for p in paths:
        os.chown(p, SANDBOX_UID, SANDBOX_UID)
        os.chmod(p, 0o700)
        for top, dirs, files in os.walk(p):  # what a task copied in is the harness's to change
            for name in dirs + files:
                os.chown(os.path.join(top, name), SANDBOX_UID, SANDBOX_UID, follow_symlinks=False)


# ----------------------------------------------------------------------------- the filesystem


def _under(path: str, tops: Iterable[str]) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in tops)


def _ancestors(path: str) -> list[str]:
    parts = Path(path).parts
    return [str(Path(*parts[:i])) for i in range(2, len(parts))]


def _dirs_for(dest: str, emptied: Sequence[str], made: set[str]) -> list[str]:
    """``--dir`` (mode 0755) for each missing folder on the way to ``dest`` inside an emptied
    tree: bubblewrap would create them 0700 as root, and the sandbox's user could not pass."""
    out: list[str] = []
    for a in _ancestors(dest):
        if a not in made and _under(a, emptied) and not any(a == e for e in emptied):
            made.add(a)
            out += ["--perms", "0755", "--dir", a]
    return out


def _python_paths() -> list[str]:
    """What a Python harness (and the relay) needs: the interpreter's prefixes and ``sys.path``."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths.update(p for p in sys.path if p and os.path.isabs(p))
    return sorted(os.path.realpath(p) for p in paths if os.path.isdir(p))


def _program_paths(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Folders (the program's own, and its real location's) and regular files the command names."""
    folders: list[str] = []
    prog = shutil.which(argv[0]) if argv else None
    if prog:
        folders += [os.path.dirname(os.path.abspath(prog)), os.path.dirname(os.path.realpath(prog))]
    files = [os.path.abspath(a) for a in argv[1:] if os.path.isabs(a) and os.path.isfile(a)]
    return folders, files


def _sibling_runs(hidden: Sequence[str]) -> list[str]:
    """Other run folders beside a hidden run folder (they hold a journal): hidden as well."""
    out: list[str] = []
    for h in hidden:
        p = Path(h)
        if not p.is_dir() or not (p / "journal.jsonl").exists() and not (p / "executions").is_dir():
            continue
        try:
            out += [str(s) for s in p.parent.iterdir()
                    if s != p and s.is_dir() and not s.is_symlink() and (s / "journal.jsonl").exists()]
        except OSError:
            continue
    return out


def wrap(argv: Sequence[str], sandbox: SandboxSpec, workdir: str, home: str, *, judge: bool = False) -> SandboxLaunch:
    """``argv`` run inside a bubblewrap sandbox (see the module docstring), through the relay.
    ``judge``: the task's evaluator, which may see what scores (``hide_from_harness``); everything
    else (the harness, the set-up) may not."""
    identity, fds, relay_opts = _identity_args()
    args = ["bwrap", *identity, *BASE_ARGS]
    private = [p for p in PRIVATE if os.path.isdir(p) and not os.path.islink(p)]
    homes = sorted({os.path.realpath(h) for h in (os.path.expanduser("~"), "/root") if os.path.isdir(h)} - {"/"})
    emptied = private + homes
    for p in emptied:
        args += ["--perms", "0755", "--tmpfs", p]
    made: set[str] = set()
    # what the harness and the relay need, back from under the emptied folders, read-only: never
    # an emptied folder itself or one holding it (a Python path of "/root" would give the home
    # back), and nothing inside a folder already bound back
    folders, files = _program_paths(argv)
    bound: list[str] = []
    for p in sorted(set(_python_paths() + folders)):
        if not _under(p, emptied) or not os.path.isdir(p) or _under(p, bound):
            continue
        if any(_under(e, [p]) for e in emptied):
            continue
        args += _dirs_for(p, emptied, made) + ["--ro-bind", p, p]
        bound.append(p)
    hidden = [os.path.realpath(h) for h in (*sandbox.hide, *(() if judge else sandbox.hide_from_harness))
              if os.path.exists(h)] + _sibling_runs(sandbox.hide)
    # a file under an emptied folder, and under no folder bound back into it, is not there anyway
    # (and binding /dev/null over it would make its folders, mode 0700, before the harness's own
    # files are bound back into them)
    hidden = [h for h in hidden if os.path.isdir(h) or not _under(h, emptied) or _under(h, bound)]
    for path in hidden:  # a folder under an empty tmpfs, a file under /dev/null
        args += ["--perms", "0755", "--tmpfs", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]
    emptied += [h for h in hidden if os.path.isdir(h)]
    for p in files + [os.path.realpath(e) for e in sandbox.expose if os.path.exists(e)]:
        args += _dirs_for(p, emptied, made) + ["--ro-bind", p, p]
    for dest, how in ((workdir, "--bind"), (home, "--bind"), (sandbox.proxy_socket, "--ro-bind")):
        args += _dirs_for(dest, emptied, made) + [how, dest, dest]
    args += ["--chdir", workdir, "--"]
    relay = [sys.executable, "-m", "gyre_core.orchestrator.sandbox_relay", *relay_opts, sandbox.proxy_socket,
             sandbox.proxy_host, str(sandbox.proxy_port), "--"]
    return SandboxLaunch(args + relay + list(argv), fds)


# ----------------------------------------------------------------------------- the check


def probe(argv_tail: Sequence[str] = ()) -> dict[str, Any]:
    """Start a real sandbox whose harness reports what it is (uid, capabilities, seccomp, what a
    ``mount`` and a Unix socket give) and return that report; raises ``RuntimeError`` with
    bubblewrap's last message when no sandbox can start."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gyre-sandbox-check-") as d:
        work, home = os.path.join(d, "w"), os.path.join(d, "h")
        os.mkdir(work)
        os.mkdir(home)
        prepare_dirs(work, home)
        os.chmod(d, 0o711)
        sock = os.path.join(d, "proxy.sock")  # stands for the proxy's socket: bound in, never used
        with open(sock, "w"):
            pass
        spec = SandboxSpec((), sock, "127.0.0.1", 0)
        launch = wrap([sys.executable, "-m", "gyre_core.orchestrator.sandbox_filter", "--report", *argv_tail],
                      spec, work, home)
        proc = subprocess.run(launch.argv, pass_fds=launch.pass_fds, capture_output=True, text=True, timeout=60,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise RuntimeError(why)
    return dict(json.loads(lines[-1]))


def sandbox_problem(kind: str) -> str | None:
    """Why ``harness.sandbox = kind`` cannot hold here (``None``: it can), in one line.

    Starts a real sandbox and checks from inside what the module docstring promises: an
    unprivileged uid, no capabilities, the filter in place (``mount``, ``socket(AF_UNIX)``,
    ``socket(AF_NETLINK)`` and ``io_uring_setup`` refused), ``no_new_privs``."""
    if kind == "none":
        return None
    if shutil.which("bwrap") is None:
        return ("harness.sandbox: bubblewrap is not installed (apt-get install -y bubblewrap; "
                "or set harness.sandbox = \"none\" to run harnesses unsandboxed)")
    try:
        from gyre_core.orchestrator.sandbox_filter import load_library

        load_library()
    except OSError as exc:
        return (f"harness.sandbox: libseccomp cannot be loaded ({exc}; apt-get install -y libseccomp2); "
                "or set harness.sandbox = \"none\"")
    try:
        got = probe()
    except (OSError, subprocess.TimeoutExpired, RuntimeError) as exc:
        return (f"harness.sandbox: bubblewrap cannot start a sandbox here ({exc}; user and network "
                "namespaces must be allowed); or set harness.sandbox = \"none\"")
    wrong = [k for k, ok in (("uid", got.get("uid") == SANDBOX_UID and got.get("euid") == SANDBOX_UID),
                             ("capabilities", got.get("cap_eff") == 0 and got.get("cap_bnd") == 0),
                             ("seccomp", got.get("seccomp") == 2), ("no_new_privs", got.get("no_new_privs") == 1),
                             ("mount refused", got.get("mount") == "refused"),
                             ("unix sockets refused", got.get("unix_socket") == "refused"),
                             ("netlink sockets refused", got.get("netlink_socket") == "refused"),
                             ("io_uring refused", got.get("io_uring") == "refused")) if not ok]
    if wrong:
        return (f"harness.sandbox: a sandbox here does not hold ({', '.join(wrong)} wrong: {got}); "
                "or set harness.sandbox = \"none\"")
    return None
