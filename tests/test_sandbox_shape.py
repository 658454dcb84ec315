"""The sandbox's shape (what is hidden, what is bound back) and a sandbox that cannot start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from gyre_core.orchestrator.sandbox import SandboxSpec, sandbox_problem, wrap


@pytest.fixture
def outside_tmp() -> Any:
    """A folder outside ``/tmp``, which every sandbox empties: hiding there is the hide's own work."""
    d = Path(tempfile.mkdtemp(prefix=".gyre-shape-test-", dir=Path(__file__).resolve().parents[1]))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_wrap_hides_the_run_and_binds_back_only_the_execution(outside_tmp: Path) -> None:
    tmp_path = outside_tmp
    out, key = tmp_path / "run", tmp_path / "control.key"
    out.mkdir()
    key.write_text("k" * 64)
    spec = SandboxSpec((str(out), str(key)), "/tmp/gyre-proxy-x/proxy.sock", "127.0.0.1", 8100)
    launch = wrap(["harness", "--flag"], spec, str(out / "executions" / "e00001"), str(out / "executions" / "e00001.home"))
    argv = launch.argv
    joined = " ".join(argv)
    assert argv[0] == "bwrap" and "--unshare-pid" in argv and "--unshare-net" in argv and "--die-with-parent" in argv
    assert "--new-session" in argv and all(f"--tmpfs {p}" in joined for p in ("/tmp", "/run", os.path.expanduser("~")))
    # an unprivileged identity: root builds it in its own user namespace and the relay drops to it;
    # anyone else gets bubblewrap's, with no capability and no further user namespace
    if os.geteuid() == 0:
        assert argv[argv.index("--userns") + 1] == str(launch.pass_fds[0]) and "--drop-to" in argv
    else:
        assert "--disable-userns" in argv and "--cap-drop ALL" in joined and launch.pass_fds == ()
    bound_back = [argv[i + 1] for i, a in enumerate(argv[:-2]) if a == "--ro-bind" and argv[i + 1] == argv[i + 2]]
    key_hidden = f"--ro-bind /dev/null {key}" in joined or (  # or not there at all: under the private /tmp
        str(key).startswith("/tmp/") and not any(str(key).startswith(b.rstrip("/") + "/") for b in bound_back))
    assert f"--tmpfs {out}" in joined and key_hidden, joined
    assert joined.index(f"--tmpfs {out}") < joined.index(f"--bind {out}/executions/e00001 ")  # hide, then bind back
    assert argv[-2:] == ["harness", "--flag"] and "gyre_core.orchestrator.sandbox_relay" in argv
    assert SandboxSpec.from_extra(spec.as_extra()) == spec


def test_a_missing_bubblewrap_is_named_with_its_fix_and_the_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    why = sandbox_problem("bwrap")
    assert why is not None and "apt-get install -y bubblewrap" in why and 'harness.sandbox = "none"' in why
    assert sandbox_problem("none") is None


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_the_relay_ends_as_its_harness_ends(tmp_path: Path) -> None:
    """A harness killed by a signal must look killed to the orchestrator (bwrap: 128 + signal)."""
    base = ["bwrap", "--die-with-parent", "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/", "--dev", "/dev",
            "--proc", "/proc", "--", sys.executable, "-m", "gyre_core.orchestrator.sandbox_relay", str(tmp_path / "none.sock"),
            "127.0.0.1", "0", "--", sys.executable, "-c"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run(base + ["import os; os.kill(os.getpid(), 9)"], env=env, timeout=60)
    failed = subprocess.run(base + ["raise SystemExit(3)"], env=env, timeout=60)
    assert (killed.returncode, failed.returncode) == (128 + 9, 3)


def test_what_is_bound_back_never_gives_back_an_emptied_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python path of the home itself (``python -m`` from ``~``) must not bind the home back,
    and nothing is bound twice (a folder inside one already bound back)."""
    home = os.path.realpath(os.path.expanduser("~"))
    monkeypatch.setattr(sys, "path", [home, "/tmp", *sys.path])
    spec = SandboxSpec((), "/tmp/gyre-proxy-x/proxy.sock", "127.0.0.1", 8100)
    argv = wrap([sys.executable, "-c", "pass"], spec, str(tmp_path / "w"), str(tmp_path / "h")).argv
    binds = [argv[i + 2] for i, a in enumerate(argv) if a == "--ro-bind" and argv[i + 1] == argv[i + 2]]
    assert home not in binds and "/tmp" not in binds and "/" not in binds[1:], binds
    assert not any(b != c and b.startswith(c.rstrip("/") + "/") for b in binds for c in binds
                   if c not in ("/", "/tmp/gyre-proxy-x/proxy.sock")), binds
