"""On the shared real SGLang server: the engine key is on no process's command line and in no line
of the engine's log or ``/server_info``, and every Unix socket the server's processes hold lies in
its private ``TMPDIR`` (mode 0700).

A command line is world-readable (``/proc/<pid>/cmdline``); SGLang logs its arguments at start
and names its ZMQ IPC sockets with :mod:`tempfile`, which a shared ``/tmp`` would expose. The
pieces are checked without a server in ``tests/test_engine_key_transport.py``; that the routes
still need the key is ``test_engine_auth.py``.
"""

from __future__ import annotations

import json
import os
import stat
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(300)]


def _group(server) -> list[int]:  # type: ignore[no-untyped-def]
    """The pids of the server's process group (leader, scheduler, detokenizer)."""
    pgid = os.getpgid(server.proc.pid)
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and os.getpgid(int(d.name)) == pgid:
                pids.append(int(d.name))
        except ProcessLookupError:
            continue
    return pids


def _unix_socket_paths(pids: list[int]) -> set[str]:
    """The filesystem paths of the Unix sockets that ``pids`` hold open (abstract ones left out)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/"):
            paths.add(fields[7])
    return paths


def test_the_key_is_on_no_command_line_and_in_no_log(sglang_server) -> None:
    key = str(sglang_server.api_key)
    pids = _group(sglang_server)
    assert len(pids) >= 2, "the scheduler subprocess should be in the server's group"
    for pid in pids:
        assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    log = Path(sglang_server.log_path).read_text(errors="replace")
    assert "server_args=" in log and "'api_key': '<redacted>'" in log
    assert key not in log
    req = urllib.request.Request(sglang_server.url + "/server_info", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read().decode()
    assert key not in body and json.loads(body)["api_key"] == "<redacted>"


def test_the_servers_sockets_are_in_its_private_tmpdir(sglang_server) -> None:
    tmpdir = str(sglang_server.tmpdir)
    assert stat.S_IMODE(os.stat(tmpdir).st_mode) == 0o700
    pids = _group(sglang_server)
    for pid in pids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"TMPDIR={tmpdir}".encode() in env, pid
    paths = _unix_socket_paths(pids)
    assert paths, "SGLang's IPC sockets should be Unix sockets with a path"
    outside = sorted(p for p in paths if not p.startswith(tmpdir + os.sep))
    assert not outside, f"sockets outside the private TMPDIR {tmpdir}: {outside}"
