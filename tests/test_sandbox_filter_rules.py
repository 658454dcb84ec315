"""Each row of the sandbox's system-call filter, tried from inside a real sandbox.

One sandbox per identity (a root orchestrator, whose sandbox drops to ``nobody``, and an
unprivileged orchestrator) runs ``sandbox_filter --rules``, which makes every probed call of
:data:`~gyre_core.orchestrator.sandbox_filter.RULES` with arguments that an unfiltered process
would answer differently (``io_uring_setup`` would give a ring, ``socket(AF_VSOCK)`` a socket,
``unshare(0)`` success); each rule is then its own test case.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest

from gyre_core.orchestrator.sandbox_filter import ALLOWED_FAMILIES, PROBED_FAMILIES, RULES

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
              pytest.mark.timeout(120)]

NONROOT_UID = 4242

_PROBE = r"""
import json, os, subprocess, sys, tempfile
from gyre_core.orchestrator.sandbox import SandboxSpec, prepare_dirs, wrap
d = tempfile.mkdtemp(dir=sys.argv[1])
os.chmod(d, 0o711)
work, home = os.path.join(d, "w"), os.path.join(d, "h")
os.mkdir(work); os.mkdir(home); prepare_dirs(work, home)
sock = os.path.join(d, "proxy.sock")
open(sock, "w").close()
launch = wrap([sys.executable, "-m", "gyre_core.orchestrator.sandbox_filter", "--rules"],
              SandboxSpec((), sock, "127.0.0.1", 0), work, home)
p = subprocess.run(launch.argv, pass_fds=launch.pass_fds, capture_output=True, text=True, timeout=60,
                   env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home})
print(p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else "ERR " + p.stderr[-2000:])
"""


@lru_cache(maxsize=2)
def _results(identity: str) -> dict[str, str]:
    """What every probe got inside a sandbox started by ``identity`` ("root" or "user")."""
    top = tempfile.mkdtemp(prefix="gyre-filter-rules-")
    os.chmod(top, 0o755)
    try:
        kw: dict = {}
        if identity == "user" and os.geteuid() == 0:
            for p in Path(top).parents:
                if not os.access(p, os.X_OK):
                    pytest.skip(f"{p} is not searchable by an unprivileged user")
            os.chown(top, NONROOT_UID, NONROOT_UID)
            kw = {"user": NONROOT_UID, "group": NONROOT_UID, "extra_groups": []}
        elif identity == "root" and os.geteuid() != 0:
            pytest.skip("the root case needs a root orchestrator")
        try:
            out = subprocess.run([sys.executable, "-c", _PROBE, top], capture_output=True, text=True, timeout=90,
                                 env={**os.environ, "HOME": top, "TMPDIR": top}, **kw)
        except PermissionError as exc:  # Python under a 0700 /root
            pytest.skip(f"this Python cannot be run by an unprivileged user here ({exc})")
        line = (out.stdout.strip().splitlines() or [""])[-1]
        if identity == "user" and out.returncode != 0 and "Permission denied" in out.stderr:
            pytest.skip(f"this Python cannot be run by an unprivileged user here ({out.stderr.strip()[-200:]})")
        assert out.returncode == 0 and line.startswith("{"), (line, out.stderr[-3000:])
        return dict(json.loads(line))
    finally:
        shutil.rmtree(top, ignore_errors=True)


PROBED = sorted({r.syscall for r in RULES if r.probe is not None})
ANSWER = {r.syscall: r.answer for r in RULES if r.probe is not None}


@pytest.mark.parametrize("identity", ["root", "user"])
@pytest.mark.parametrize("syscall", PROBED)
def test_each_probed_rule_is_refused_inside_the_sandbox(identity: str, syscall: str) -> None:
    got = _results(identity)
    if syscall not in got:
        pytest.skip(f"{syscall} is not a system call on this architecture")
    assert got[syscall] == errno.errorcode[ANSWER[syscall]], (syscall, got[syscall])


@pytest.mark.parametrize("identity", ["root", "user"])
@pytest.mark.parametrize("family", sorted(PROBED_FAMILIES))
def test_the_harness_makes_only_inet_sockets(identity: str, family: str) -> None:
    got = _results(identity)[f"socket:{family}"]
    if PROBED_FAMILIES[family] in ALLOWED_FAMILIES["harness"]:
        assert got == "ok", (family, got)  # the relay on the loopback stays reachable
    else:
        assert got == "EPERM", (family, got)


@pytest.mark.parametrize("identity", ["root", "user"])
def test_socketpair_is_unix_only(identity: str) -> None:
    assert _results(identity)["socketpair:AF_INET"] == "EPERM"


def test_every_rule_compiles_none_is_skipped() -> None:
    """A rule libseccomp cannot express (two comparisons of one argument) must fail the build,
    not vanish: the filter is built from the table and loaded in a child process."""
    code = ("from gyre_core.orchestrator import sandbox_filter as f; f.build(harness=True); f.build(harness=False); "
            "print(sum(1 for _ in f.RULES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == len(RULES)
    for rule in RULES:
        assert len({w[0] for w in rule.when}) == len(rule.when), rule
