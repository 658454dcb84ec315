"""Escapes tried from inside a sandbox, under the real launcher, by a harness that wants out.

A harness is untrusted code that a policy is optimised to exploit. This one, launched through
``gyre_launch_harness`` exactly as a run launches any ``command`` harness, tries what a harness
started by a root orchestrator could do before the sandbox dropped privileges: use capabilities,
bind-mount ``/`` to uncover the hidden run folder, remount ``/`` writable, make a user namespace,
connect to every Unix socket it can find under ``/`` (one planted outside the private folders),
write to the host, read secrets planted in the orchestrator's home, the run folder and a sibling
run's folder, signal and trace a host process, connect to a host TCP port. Every attempt must
fail, and the proxy (here a stand-in HTTP server on the proxy's Unix socket) must still answer.
The same escapes are tried with the orchestrator running as an unprivileged user, where the
machine lets such a user run this Python (it does not when Python lives under a 0700 ``/root``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from socketserver import UnixStreamServer
from typing import Any

import pytest

from gyre_core.interfaces import ExecutionSpec
from gyre_core.orchestrator.harness import gyre_launch_harness
from gyre_core.orchestrator.sandbox import SANDBOX_UID, SandboxSpec, sandbox_problem

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
              pytest.mark.timeout(180)]

ESCAPES = r'''
import ctypes, errno, json, os, signal, socket, stat, sys
from pathlib import Path

args = json.loads(Path(sys.argv[1]).read_text())
libc = ctypes.CDLL(None, use_errno=True)
r = {}

def attempt(name, fn):
    try:
        got = fn()
        r[name] = "ok" if got is None else got
    except OSError as e:
        r[name] = type(e).__name__ + ":" + (errno.errorcode.get(e.errno, str(e.errno)))

def c_call(fn, *a):
    if fn(*a) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))

status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
r["uid"], r["euid"] = os.getuid(), os.geteuid()
r["cap_eff"] = int(status["CapEff"].strip(), 16)
r["cap_prm"] = int(status["CapPrm"].strip(), 16)
r["cap_bnd"] = int(status["CapBnd"].strip(), 16)
r["seccomp"] = int(status["Seccomp"].strip())
home = os.environ["HOME"]
os.makedirs(home + "/x", exist_ok=True)
attempt("bind_root", lambda: c_call(libc.mount, b"/", (home + "/x").encode(), None, 4096, None))  # MS_BIND
attempt("remount_rw", lambda: c_call(libc.mount, b"none", b"/", None, 32 | 4096, None))  # MS_REMOUNT|MS_BIND
attempt("unshare_user", lambda: c_call(libc.unshare, 0x10000000))
attempt("unshare_mount", lambda: c_call(libc.unshare, 0x00020000))
attempt("setuid_root", lambda: os.setuid(0))
attempt("chroot", lambda: os.chroot("/"))
attempt("ptrace_host_pid", lambda: c_call(libc.ptrace, 16, args["host_pid"], None, None))  # PTRACE_ATTACH
attempt("signal_host_pid", lambda: os.kill(args["host_pid"], signal.SIGTERM))
attempt("signal_init", lambda: os.kill(1, signal.SIGKILL) if os.getpid() != 1 else None)

# every Unix socket under / (not /proc, /sys): none may be connected to
found, sockets = [], {}
for top, dirs, files in os.walk("/", onerror=lambda e: None):
    if top in ("/proc", "/sys"):
        dirs[:] = []
        continue
    for f in files:
        p = os.path.join(top, f)
        try:
            if stat.S_ISSOCK(os.lstat(p).st_mode):
                found.append(p)
        except OSError:
            pass
for p in found:
    def conn(p=p):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect(p)
        s.close()
    attempt("unix:" + p, conn)
r["unix_sockets_found"] = found

def write(p):
    with open(p, "w") as f:
        f.write("pwned")
for name, p in (("write_root", "/gyre-pwned"), ("write_prefix", os.path.join(sys.prefix, "gyre-pwned")),
                ("write_etc", "/etc/cron.d/gyre-pwned"), ("write_planted_home", args["planted_home"] + "/pwned")):
    attempt(name, lambda p=p: write(p))
for name, p in args["secrets"].items():
    attempt("read:" + name, lambda p=p: Path(p).read_text()[:8])
attempt("read_shadow", lambda: Path("/etc/shadow").read_text()[:8])
def tcp():
    socket.create_connection(("127.0.0.1", args["host_tcp_port"]), timeout=3).close()
attempt("host_tcp", tcp)
def proxy():
    s = socket.create_connection((args["proxy_host"], args["proxy_port"]), timeout=10)
    s.sendall(b"GET /ping HTTP/1.0\r\nHost: x\r\n\r\n")
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data.decode(errors="replace").split("\r\n\r\n", 1)[-1]
attempt("proxy", proxy)
Path("escapes.json").write_text(json.dumps(r))
'''


class _Pong(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = b"pong"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a: Any) -> None:
        pass


class _UnixHTTP(UnixStreamServer):
    def get_request(self) -> Any:
        conn, _ = super().get_request()
        return conn, ("proxy", 0)


def _serve(server: Any) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    return t


def _launch_and_probe(tmp_path: Path) -> dict[str, Any]:
    """Plant the secrets and the doors, launch the escaping harness, return what it got."""
    base = tmp_path / "world"
    base.mkdir(mode=0o755)
    home = base / "orchestrator-home"
    (home / ".ssh").mkdir(parents=True)
    secrets = {"ssh_key": home / ".ssh" / "id_ed25519", "netrc": home / ".netrc",
               "hf_token": home / ".cache" / "huggingface" / "token"}
    runs = base / "runs"
    this_run, sibling = runs / "run-b", runs / "run-a"
    for d in (this_run / "executions", sibling / "executions"):
        d.mkdir(parents=True)
    secrets.update({"journal": this_run / "journal.jsonl", "control_key": this_run / "control.key",
                    "sibling_journal": sibling / "journal.jsonl", "sibling_key": sibling / "control.key"})
    for name, p in secrets.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"secret-{name}")
        p.chmod(0o600)
    sock_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"gyre-escape-{os.getpid()}"
    sock_dir.mkdir(mode=0o711, exist_ok=True)
    proxy_sock = sock_dir / "proxy.sock"
    proxy = _UnixHTTP(str(proxy_sock), _Pong)
    os.chmod(proxy_sock, 0o666)
    # a host Unix socket outside the sandbox's private folders, open to everyone (mode 0777)
    door_dir = Path(sys.prefix) / f".gyre-escape-door-{os.getpid()}"
    door_dir.mkdir(exist_ok=True)
    door = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    door.bind(str(door_dir / "door.sock"))
    door.listen(4)
    os.chmod(door_dir / "door.sock", 0o777)
    tcp = HTTPServer(("127.0.0.1", 0), _Pong)
    host_proc = subprocess.Popen(["sleep", "300"])
    script = base / "escape.py"
    script.write_text(ESCAPES)
    _serve(proxy)
    _serve(tcp)
    try:
        workdir = this_run / "executions" / "e00001"
        args = {"host_pid": host_proc.pid, "secrets": {k: str(v) for k, v in secrets.items()},
                "planted_home": str(home), "host_tcp_port": tcp.server_address[1], "proxy_host": "127.0.0.1",
                "proxy_port": 8399}
        args_file = base / "escape-args.json"
        args_file.write_text(json.dumps(args))
        spec = ExecutionSpec(
            execution_id=1, workdir=str(workdir), proxy_base_url="http://127.0.0.1:8399", api_key="k-1",
            harness_timeout_s=60, overall_budget_s=120, harness="command", task="escape",
            extra={"command": [sys.executable, str(script), str(args_file)],
                   "sandbox": SandboxSpec((str(this_run),), str(proxy_sock), "127.0.0.1", 8399).as_extra()})
        old_home = os.environ.get("HOME")
        os.environ["HOME"] = str(home)  # the orchestrator's home: planted secrets
        try:
            handle = gyre_launch_harness(spec=spec)
        finally:
            if old_home is not None:
                os.environ["HOME"] = old_home
        code = handle.wait(120)
        log = (workdir.parent / "e00001.log").read_text(errors="replace")
        assert code == 0, log
        report = json.loads((workdir / "escapes.json").read_text())
        report["_door"] = str(door_dir / "door.sock")
        report["_host_alive"] = host_proc.poll() is None
        return report
    finally:
        host_proc.kill()
        host_proc.wait()
        proxy.shutdown()
        tcp.shutdown()
        door.close()
        shutil.rmtree(door_dir, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)


def _assert_nothing_escaped(r: dict[str, Any]) -> None:
    assert r["uid"] == r["euid"] == SANDBOX_UID and r["uid"] != 0, r
    assert r["cap_eff"] == r["cap_prm"] == r["cap_bnd"] == 0, r
    assert r["seccomp"] == 2, r
    for name in ("bind_root", "remount_rw", "unshare_user", "unshare_mount", "setuid_root", "chroot",
                 "ptrace_host_pid"):
        assert r[name].startswith("PermissionError") or r[name].startswith("OSError"), (name, r[name])
    # the host process is in another PID namespace: not even there to be signalled
    assert r["signal_host_pid"].startswith(("ProcessLookupError", "PermissionError")), r["signal_host_pid"]
    assert r["_host_alive"]
    # the planted door is visible (the host is read-only, not hidden) but cannot be connected to
    assert r["_door"] in r["unix_sockets_found"], r["unix_sockets_found"]
    for k, v in r.items():
        if k.startswith("unix:"):
            assert v != "ok", (k, v)
    for k in ("write_root", "write_prefix", "write_etc", "write_planted_home"):
        assert r[k] != "ok", (k, r[k])
    for k, v in r.items():
        if k.startswith("read:") or k == "read_shadow":
            assert not str(v).startswith("secret") and v != "ok", (k, v)
    assert r["host_tcp"] != "ok", r["host_tcp"]
    assert r["proxy"] == "pong", r["proxy"]  # the one way out


@pytest.mark.skipif(os.geteuid() != 0, reason="the root case needs a root orchestrator")
def test_nothing_escapes_a_sandbox_started_by_root(tmp_path: Path) -> None:
    assert sandbox_problem("bwrap") is None
    _assert_nothing_escaped(_launch_and_probe(tmp_path))


NONROOT_UID = 4242


def test_nothing_escapes_a_sandbox_started_by_an_unprivileged_user(tmp_path: Path) -> None:
    """The same launch, from an orchestrator process running as an ordinary user."""
    if os.geteuid() == 0:
        try:
            probe = subprocess.run([sys.executable, "-c", "import gyre_core, pyseccomp"], user=NONROOT_UID,
                                   group=NONROOT_UID, extra_groups=[], capture_output=True, text=True)
            why = (probe.stderr.strip().splitlines() or ["?"])[-1] if probe.returncode else ""
        except OSError as exc:
            why = str(exc)
        if why:
            pytest.skip(f"this Python cannot be run by an unprivileged user here ({why})")
        tmp_path.chmod(0o755)
        for p in (tmp_path, *tmp_path.parents):
            if not os.access(p, os.X_OK):
                pytest.skip(f"{p} is not searchable by an unprivileged user")
        os.chown(tmp_path, NONROOT_UID, NONROOT_UID)
        code = (f"import sys, json; sys.path[:0] = {sys.path!r}; "
                "from pathlib import Path; import test_sandbox_escape as t; "
                f"print(json.dumps(t._launch_and_probe(Path({str(tmp_path)!r}))))")
        out = subprocess.run([sys.executable, "-c", code], user=NONROOT_UID, group=NONROOT_UID, extra_groups=[],
                             capture_output=True, text=True, timeout=150,
                             env={**os.environ, "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
                                  "PYTHONPATH": str(Path(__file__).parent)})
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout.strip().splitlines()[-1])
    else:
        report = _launch_and_probe(tmp_path)
    _assert_nothing_escaped(report)
