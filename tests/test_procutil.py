"""A child started with ``die_with_parent`` dies with its parent, even a parent killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_grandchild_dies_when_its_parent_is_sigkilled() -> None:
    parent_code = textwrap.dedent("""
        import subprocess, sys, threading, time
        from gyre_core.procutil import die_with_parent
        # other threads importing at fork time must not hang the child (preexec_fn imports nothing)
        threading.Thread(target=lambda: [__import__("json") for _ in range(10**5)], daemon=True).start()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 preexec_fn=die_with_parent, start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    try:
        assert _alive(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child_pid)
    finally:
        if _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)
