"""The sandbox's system-call filter (seccomp, compiled by libseccomp), as one table, and its self-report.

Every rule is one row of :data:`RULES`: the system call, the condition on its arguments (none:
always), what the caller gets back, whom it binds (``"all"``: the relay and the harness;
``"harness"``: only what runs the policy's code), why, and a *probe*: arguments with which the
call, were it allowed, would give something other than the refusal, so that a test run inside a
real sandbox can tell the rule is there (``python -m gyre_core.orchestrator.sandbox_filter
--rules`` prints what each probe got, as one JSON line).

Refused with ``EPERM`` (the program sees an ordinary refusal and can carry on): everything that
changes mounts, namespaces, the kernel or another process's memory, the kernel keyring, BPF and
``io_uring`` (its ``IORING_OP_SOCKET``, ``IORING_OP_OPENAT`` ... would reach the kernel past the
rules on ``socket``). The harness may make only ``AF_INET`` and ``AF_INET6`` sockets (its one way
out is the relay on the loopback): no Unix socket (a read-only bind does not stop ``connect()``,
and the only Unix socket a harness has any business with is the proxy's, which the relay
connects to), no ``AF_NETLINK`` (routes, uevents, audit), ``AF_VSOCK`` (the hypervisor),
``AF_PACKET`` or any other family. ``socketpair(AF_UNIX)`` stays allowed (pipes between a
program's own processes, as Node.js and asyncio make them). System calls of another ABI (i386 on
x86_64) kill the thread (libseccomp's default for a foreign architecture).

``python -m gyre_core.orchestrator.sandbox_filter --report`` prints one JSON line describing the
process it runs in (uid, capabilities, seccomp mode, ``no_new_privs``, what a ``mount`` and a Unix
socket give): :func:`gyre_core.orchestrator.sandbox.sandbox_problem` reads it from inside a sandbox.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ALLOWED_FAMILIES", "RULES", "Rule", "apply", "load_library", "probe_rules", "report"]

_CLONE_NEWUSER = 0x10000000
_CLONE_THREAD = 0x00010000
PROBED_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17,
                   "AF_BLUETOOTH": 31, "AF_ALG": 38, "AF_VSOCK": 40}
"""Socket families the in-sandbox test tries (by number: Python lacks some names on some builds)."""

ALLOWED_FAMILIES = {"all": (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX),
                    "harness": (socket.AF_INET, socket.AF_INET6)}
"""Socket families each filter lets ``socket()`` make; every other family is refused."""


@dataclass(frozen=True)
class Rule:
    """One row of the filter: ``syscall`` answered ``-errno`` when ``when`` holds."""

    syscall: str
    why: str
    binds: Literal["all", "harness"] = "all"
    when: tuple[tuple[int, str, int], ...] = ()
    """Conditions on the arguments, all of which must hold, at most one per argument:
    ``(index, "eq" | "ge" | "masked", value)`` (``masked``: ``arg & value == value``); empty: always."""
    answer: int = errno.EPERM
    probe: tuple[int, ...] | None = None
    """Arguments the in-sandbox test calls it with (``None``: not probed by a raw call; see ``why``).
    Chosen so that without the rule the answer differs from ``answer`` (or the call is harmless)."""


def _always(names: str, why: str, probe: tuple[int, ...] | None = (0, 0, 0, 0, 0, 0)) -> list[Rule]:
    return [Rule(n, why, probe=probe) for n in names.split()]


_AF_MAX = 46
"""Linux's ``AF_MAX``: every family at or past it is refused by one rule (seccomp compares one
argument once per rule, so "not in the allowed set" is a rule per family below it)."""


def _socket_rules(syscall: str, binds: Literal["all", "harness"], why: str) -> list[Rule]:
    allowed = ALLOWED_FAMILIES[binds] if syscall == "socket" else (socket.AF_UNIX,)
    rules = [Rule(syscall, why, binds=binds, when=((0, "eq", f),), probe=None) for f in range(_AF_MAX)
             if f not in allowed]
    return rules + [Rule(syscall, why, binds=binds, when=((0, "ge", _AF_MAX),), probe=None)]


RULES: tuple[Rule, ...] = (
    *_always("mount umount2 pivot_root move_mount open_tree fsopen fsmount fsconfig fspick mount_setattr "
             "open_by_handle_at quotactl quotactl_fd", "mounts and the filesystem tree: the hidden folders stay hidden"),
    Rule("name_to_handle_at", "file handles: with open_by_handle_at, a way round the mount tree", probe=None),
    *_always("unshare setns", "namespaces: a new one would give back the capabilities the sandbox dropped",
             probe=(0, 0, 0, 0, 0, 0)),
    Rule("clone", "a user namespace made by clone (unshare's twin)", when=((0, "masked", _CLONE_NEWUSER),),
         probe=(_CLONE_NEWUSER | _CLONE_THREAD, 0, 0, 0, 0, 0)),
    Rule("clone3", "its flags are behind a pointer the filter cannot read: libc falls back to clone",
         answer=errno.ENOSYS, probe=(0, 0, 0, 0, 0, 0)),
    *_always("ptrace process_vm_readv process_vm_writev kcmp pidfd_getfd",
             "another process's memory and descriptors (the relay's, an evaluator's)"),
    *_always("perf_event_open bpf userfaultfd", "kernel attack surface no harness needs"),
    *_always("keyctl add_key request_key", "the kernel keyring: credentials outlive the process"),
    *_always("init_module finit_module delete_module kexec_load kexec_file_load reboot swapon swapoff acct syslog "
             "iopl ioperm settimeofday clock_settime clock_adjtime adjtimex lookup_dcookie vhangup personality",
             "the machine itself: modules, reboot, clocks, the kernel log, I/O ports, execution domains"),
    *_always("io_uring_setup io_uring_enter io_uring_register",
             "io_uring's own socket, open and connect operations would bypass the rules on socket()"),
    *_socket_rules("socket", "harness", "the harness's one way out is the relay on the loopback: AF_INET and "
                   "AF_INET6 only (no AF_UNIX, AF_NETLINK, AF_VSOCK, AF_PACKET, ...)"),
    *_socket_rules("socket", "all", "the relay needs AF_UNIX for the proxy's socket, nothing beyond it and the "
                   "loopback"),
    *_socket_rules("socketpair", "all", "pairs between a program's own processes are AF_UNIX; no other family"),
)
"""The whole filter. A rule whose system call this architecture lacks is skipped."""


def load_library() -> Any:
    """The libseccomp binding; ``OSError`` when libseccomp is not installed."""
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as exc:
        raise OSError(f"libseccomp is not available: {exc}") from None
    return pyseccomp


def _arg(sc: Any, index: int, op: str, value: int) -> Any:
    if op == "eq":
        return sc.Arg(index, sc.EQ, value)
    if op == "ge":
        return sc.Arg(index, sc.GE, value)
    return sc.Arg(index, sc.MASKED_EQ, value, value)


def build(*, harness: bool) -> Any:
    """The filter (a ``pyseccomp.SyscallFilter``), not loaded: the rules that bind everyone, and
    with ``harness`` those that bind the harness too."""
    sc = load_library()
    f = sc.SyscallFilter(sc.ALLOW)
    for rule in RULES:
        if rule.binds == "harness" and not harness:
            continue
        if _number(sc, rule.syscall) < 0:  # not a system call on this architecture
            continue
        f.add_rule(sc.ERRNO(rule.answer), rule.syscall, *(_arg(sc, *w) for w in rule.when))  # never skipped
    return f


def _number(sc: Any, name: str) -> int:
    try:
        return int(sc.resolve_syscall(sc.Arch.NATIVE, name))
    except (ValueError, OSError, RuntimeError):
        return -1


def apply(*, harness: bool) -> None:
    """Load the filter into this process (and every process it starts). Sets ``no_new_privs``
    first: no set-uid program can give back what was dropped. Filters stack: the harness's is
    loaded over the relay's."""
    pr_set_no_new_privs = 38
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    build(harness=harness).load()


def _status() -> dict[str, str]:
    out: dict[str, str] = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def _errno_name(code: int) -> str:
    return errno.errorcode.get(code, str(code))


def _syscall(name: str, *args: Any) -> str | None:
    """``"ok"`` or the errno's name of a raw call (None: no such system call here); a ring or
    descriptor it returns is closed."""
    nr = _number(load_library(), name)
    if nr < 0:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(nr), *(a if isinstance(a, ctypes.Array) else ctypes.c_long(a) for a in args))
    if rc >= 0 and name == "io_uring_setup":
        os.close(rc)
    return "ok" if rc >= 0 else _errno_name(ctypes.get_errno())


def _socket(family: int, kinds: tuple[int, ...] = (socket.SOCK_STREAM,)) -> str:
    """``"ok"`` when a socket of ``family`` (of the first kind it supports) can be made, else the errno's name."""
    got = "?"
    for kind in kinds:
        try:
            socket.socket(family, kind).close()
            return "ok"
        except OSError as exc:
            got = _errno_name(exc.errno or 0)
    return got


def probe_rules() -> dict[str, str]:
    """What each probed rule's call gives in this process (``"ok"`` or the errno's name), by
    ``syscall`` (socket families as ``socket:FAMILY``): the in-sandbox test compares each with
    its rule's answer."""
    out: dict[str, str] = {}
    for rule in RULES:
        if rule.probe is None or rule.syscall in out:
            continue
        got = _syscall(rule.syscall, *rule.probe)
        if got is not None:
            out[rule.syscall] = got
    for name, family in PROBED_FAMILIES.items():
        kinds = (socket.SOCK_RAW, socket.SOCK_DGRAM) if name in ("AF_NETLINK", "AF_PACKET") else (socket.SOCK_STREAM,)
        out[f"socket:{name}"] = _socket(family, kinds)
    try:
        socket.socketpair(socket.AF_INET, socket.SOCK_STREAM)
        out["socketpair:AF_INET"] = "ok"
    except OSError as exc:
        out["socketpair:AF_INET"] = _errno_name(exc.errno or 0)
    return out


def report() -> dict[str, Any]:
    """What this process is and may do, as the sandbox check wants to see it."""
    st = _status()
    libc = ctypes.CDLL(None, use_errno=True)
    # a target that does not exist: the filter answers EPERM before any lookup, and the report run
    # outside a sandbox by root (by mistake) mounts nothing
    rc = libc.mount(b"none", b"/nonexistent-gyre-mount-probe", b"tmpfs", 0, None)
    mount = "allowed" if rc == 0 else ("refused" if ctypes.get_errno() in (errno.EPERM, errno.EACCES) else
                                       f"errno {ctypes.get_errno()}")
    try:
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
        unix = "allowed"
    except PermissionError:
        unix = "refused"
    netlink = _socket(PROBED_FAMILIES["AF_NETLINK"], (socket.SOCK_RAW,))
    ring = _syscall("io_uring_setup", 1, ctypes.create_string_buffer(120))  # entries, struct io_uring_params
    io_uring = "refused" if ring in (None, "EPERM", "ENOSYS") else ("allowed" if ring == "ok" else ring)
    return {"netlink_socket": {"ok": "allowed", "EPERM": "refused"}.get(netlink, netlink), "io_uring": io_uring,
            "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
            "cap_eff": int(st.get("CapEff", "0"), 16), "cap_prm": int(st.get("CapPrm", "0"), 16),
            "cap_bnd": int(st.get("CapBnd", "0"), 16), "seccomp": int(st.get("Seccomp", "0")),
            "no_new_privs": int(st.get("NoNewPrivs", "0")), "mount": mount, "unix_socket": unix}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--report"]:
        print(json.dumps(report()))
    elif sys.argv[1:2] == ["--rules"]:
        print(json.dumps(probe_rules()))
    else:
        print("usage: python -m gyre_core.orchestrator.sandbox_filter --report | --rules", file=sys.stderr)
        sys.exit(2)
