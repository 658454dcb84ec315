"""The sandbox's system-call filter (seccomp, compiled by libseccomp) and its self-report.

Denied with ``EPERM`` (the program sees an ordinary refusal and can carry on): everything that
changes mounts, namespaces, the kernel or another process's memory, the kernel keyring and BPF.
The harness's filter also refuses ``socket(AF_UNIX, ...)``: a read-only bind does not stop
``connect()``, and the only Unix socket a harness has any business with is the proxy's, which
the relay (not the harness) connects to. ``socketpair`` stays allowed (pipes between a program's
own processes, as Node.js and asyncio make them). System calls of another ABI (i386 on x86_64)
kill the thread (libseccomp's default for a foreign architecture).

``python -m gyre_core.orchestrator.sandbox_filter --report`` prints one JSON line describing the
process it runs in (uid, capabilities, seccomp mode, ``no_new_privs``, what a ``mount`` and a Unix
socket give): :func:`gyre_core.orchestrator.sandbox.sandbox_problem` reads it from inside a sandbox.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
from typing import Any

__all__ = ["DENIED", "apply", "load_library", "report"]

DENIED = (
    # mounts and the filesystem tree
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick",
    "mount_setattr", "open_by_handle_at", "name_to_handle_at", "quotactl", "quotactl_fd",
    # namespaces (CLONE_NEWUSER in clone is refused by argument below; clone3 is answered ENOSYS)
    "unshare", "setns",
    # other processes and the kernel
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "perf_event_open", "bpf",
    "userfaultfd", "keyctl", "add_key", "request_key", "init_module", "finit_module", "delete_module",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "syslog", "iopl", "ioperm",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "lookup_dcookie", "vhangup", "personality",
)
"""System calls no harness needs and an escape would (refused with ``EPERM``)."""

_CLONE_NEWUSER = 0x10000000


def load_library() -> Any:
    """The libseccomp binding; ``OSError`` when libseccomp is not installed."""
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as exc:
        raise OSError(f"libseccomp is not available: {exc}") from None
    return pyseccomp


def build(*, deny_unix_sockets: bool) -> Any:
    """The filter (a ``pyseccomp.SyscallFilter``), not loaded."""
    sc = load_library()
    f = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (ValueError, OSError, RuntimeError):  # not a system call on this architecture
            continue
    f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_NEWUSER, _CLONE_NEWUSER))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags are behind a pointer: libc falls back to clone
    if deny_unix_sockets:
        f.add_rule(sc.ERRNO(errno.EPERM), "socket", sc.Arg(0, sc.EQ, socket.AF_UNIX))
    return f


def apply(*, deny_unix_sockets: bool) -> None:
    """Load the filter into this process (and every process it starts). Sets ``no_new_privs``
    first: no set-uid program can give back what was dropped."""
    import ctypes

    pr_set_no_new_privs = 38
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    build(deny_unix_sockets=deny_unix_sockets).load()


def _status() -> dict[str, str]:
    out: dict[str, str] = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def report() -> dict[str, Any]:
    """What this process is and may do, as the sandbox check wants to see it."""
    import ctypes

    st = _status()
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)
    mount = "allowed" if rc == 0 else ("refused" if ctypes.get_errno() in (errno.EPERM, errno.EACCES) else
                                       f"errno {ctypes.get_errno()}")
    try:
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
        unix = "allowed"
    except PermissionError:
        unix = "refused"
    return {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
            "cap_eff": int(st.get("CapEff", "0"), 16), "cap_prm": int(st.get("CapPrm", "0"), 16),
            "cap_bnd": int(st.get("CapBnd", "0"), 16), "seccomp": int(st.get("Seccomp", "0")),
            "no_new_privs": int(st.get("NoNewPrivs", "0")), "mount": mount, "unix_socket": unix}


if __name__ == "__main__":
    if sys.argv[1:2] != ["--report"]:
        print("usage: python -m gyre_core.orchestrator.sandbox_filter --report", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(report()))
