"""Start and stop a real SGLang server process, with Gyre's plugin and (on CPU) Gyre's patches.

Used by tests, benchmarks and the embedded default of ``gyre-orchestrate run``; on a cluster the
servers are usually started by the user's own launcher with the same arguments and environment
(:meth:`SGLangServer.launch_spec`). The server runs in its own process group so that teardown
reaches its scheduler and detokenizer children, and only them: SIGTERM to the group, SIGKILL after
a bounded wait (an SGLang CPU server can linger for 20 s after SIGTERM).

The engine key travels in the environment (``GYRE_ENGINE_KEY``), never on the command line, which
every local user can read: :mod:`gyre_sglang.launch_server` hands it to SGLang. Each server gets a
private temporary folder (``TMPDIR``, mode 0700, removed when it stops): SGLang creates its ZMQ IPC
sockets there with :mod:`tempfile`, and unpickles what arrives on some of them, so they must not
sit in a shared ``/tmp``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from typing import TYPE_CHECKING

from gyre_core.procutil import die_with_parent

if TYPE_CHECKING:
    from gyre_sglang.client import SGLangClient

__all__ = ["SGLangServer", "ServerStartError", "cpu_patch_site", "free_port"]


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy within the start timeout."""


class _PortTaken(Exception):
    """The server exited because its HTTP port was taken between picking and binding."""


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_patch_site() -> Path:
    """The folder whose ``sitecustomize`` applies :mod:`gyre_sglang.cpu_patches` in a server's processes."""
    return Path(__file__).resolve().parent / "cpu_patches" / "site"


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:  # pragma: no cover - torch is a dependency
        return False


def crash_diagnostics_off() -> dict[str, str]:
    """SGLang's crash diagnostics that cannot work on this machine, turned off.

    Why: :meth:`SGLangServer.stop` signals the server's whole group, so its scheduler ends first,
    which SGLang's main process handles as a crash: it sleeps 5 s "to let GPU activity settle",
    then takes a CUDA core dump and a py-spy dump of schedulers that are already gone. Without
    CUDA there is nothing to settle or dump, and without ``py-spy`` nothing to run: each stop then
    costs 0.7 s, not 5.5 s (once per engine at every run's end). Where either can work it stays on.
    """
    off: dict[str, str] = {}
    if not _cuda_available():
        off["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] = "0"
    if shutil.which("py-spy") is None:
        off["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] = "0"
    return off


_LAUNCHER_VARIABLES = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
})


@dataclass
class SGLangServer:
    """One SGLang server process (``python -m gyre_sglang.launch_server``) serving ``model_dir``.

    ``extra_args`` pass through to SGLang unchanged (any server argument a user would give it).
    On a machine without CUDA the CPU engine is selected and Gyre's CPU patch is applied in every
    server process; ``max_total_tokens`` bounds the KV pool (SGLang otherwise reserves ~15 GB).

    ``api_key`` (default: a fresh random key per server) guards every route but the health
    probes: SGLang's own API key covers generate and weight updates, and Gyre's plugin checks the
    same key on its ``/gyre/`` routes. Both read it from ``GYRE_ENGINE_KEY`` in the server's
    environment; ``--api-key`` in ``extra_args`` is refused. :meth:`client` hands it on.
    """

    model_dir: str | Path
    port: int = 0
    host: str = "127.0.0.1"
    max_total_tokens: int = 8192
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: str | Path | None = None
    api_key: str | None = None
    base_gpu_id: int | None = None
    """The first of the cell's GPUs (``--base-gpu-id``); with ``tp_size`` the engine spans the
    GPUs its cell trains on. Ignored without CUDA, and where ``extra_args`` name their own."""
    tp_size: int = 1
    memory_saver: bool = False
    """On a GPU, start with ``--enable-memory-saver``: a cell's engine, which releases its weights
    and KV cache while its cell trains (SGLang can release GPU memory only when started so), and
    ``--enable-weights-cpu-backup`` (the released weights wait in host memory)."""
    proc: subprocess.Popen[bytes] | None = None
    tmpdir: str | None = field(default=None, init=False)
    """The running server's private ``TMPDIR`` (its IPC sockets); removed when it stops."""

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = secrets.token_urlsafe(24)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's command line: no secret on it (the key is in :meth:`environment`)."""
        from gyre_sglang.launch_server import secret_flags

        if secret_flags(self.extra_args):
            raise ValueError("extra_args must not carry --api-key/--admin-api-key (a command line is readable by "
                             "every local user): the server's key is SGLangServer.api_key")
        cmd = [
            sys.executable, "-m", "gyre_sglang.launch_server",
            "--model-path", str(self.model_dir),
            "--host", self.host, "--port", str(self.port),
            "--max-total-tokens", str(self.max_total_tokens),
        ]
        if not _cuda_available():
            cmd += ["--device", "cpu"]
            if "--sleep-on-idle" not in self.extra_args:
                # An idle scheduler otherwise polls in a loop and keeps a whole core busy; on a CPU
                # machine that core is the training ranks' and the harnesses'. Gyre's side channel
                # is in the sleeper's poller, so its requests still wake the scheduler at once.
                cmd += ["--sleep-on-idle"]
        else:
            cmd += self.gpu_args()
        if "--custom-weight-loader" not in self.extra_args:
            # Gyre's Mooncake weight publication (gyre_sglang.weight_publication) loads through it.
            from gyre_sglang.weight_publication import LOADER

            cmd += ["--custom-weight-loader", LOADER]
        return cmd + list(self.extra_args)

    def alive(self) -> bool:
        """False once the server process has exited (or was never started, or was stopped)."""
        return self.proc is not None and self.proc.poll() is None

    def placement(self) -> str:
        """Its GPU flags (empty on a machine without CUDA), for the run's start-up plan."""
        return " ".join(self.gpu_args()) if _cuda_available() else ""

    def gpu_args(self) -> list[str]:
        """``--base-gpu-id`` and ``--tp-size`` for this engine's GPUs, unless the user's
        ``extra_args`` already place it, and the memory saver a cell's engine needs."""
        given = {a.split("=", 1)[0] for a in self.extra_args}
        out: list[str] = []
        if self.base_gpu_id is not None and "--base-gpu-id" not in given:
            out += ["--base-gpu-id", str(self.base_gpu_id)]
        if not given & {"--tp", "--tp-size", "--tensor-parallel-size"}:
            out += ["--tp-size", str(self.tp_size)]
        if self.memory_saver and "--enable-memory-saver" not in given:
            out += ["--enable-memory-saver"]
        if self.memory_saver and "--enable-weights-cpu-backup" not in given:
            # the weights wait in host memory while the cell trains, so a satellite coming back
            # resumes the version it left with and pulls only the next publication
            out += ["--enable-weights-cpu-backup"]
        return out

    def environment(self, tmpdir: str) -> dict[str, str]:
        """The server's environment, with its key and ``tmpdir`` as its private ``TMPDIR``."""
        # An engine is a distributed job of its own: the rank variables of a launcher that started
        # its parent (torchrun starting a Gyre rank, which starts its cell's engine) must not leak
        # into SGLang's own torch.distributed initialisation, which would wait for that world.
        env = {k: v for k, v in os.environ.items()
               if k not in _LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
        env["GYRE_SGLANG_PLUGIN"] = "1"
        env["GYRE_ENGINE_KEY"] = str(self.api_key)
        if not _cuda_available():
            site = cpu_patch_site()
            env["GYRE_SGLANG_CPU_PATCH"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
            env.setdefault("MC_LOG_LEVEL", "ERROR")
            env.update({k: v for k, v in crash_diagnostics_off().items() if k not in env})
        env.update(self.env)
        env["TMPDIR"] = tmpdir  # after self.env: the private folder is not optional (it may lie in theirs)
        return env

    def launch_spec(self, tmpdir: str) -> tuple[list[str], dict[str, str]]:
        """The command line and environment the server process is started with (``tmpdir`` its
        private ``TMPDIR``): what :meth:`start` hands to ``Popen``, for checking without a server."""
        return self.command(), self.environment(tmpdir)

    def new_tmpdir(self) -> str:
        """A fresh private folder (0700) for one start, inside ``env["TMPDIR"]`` when one is given."""
        return tempfile.mkdtemp(prefix="gyre-sglang-", dir=self.env.get("TMPDIR"))

    def _remove_tmpdir(self) -> None:
        tmpdir, self.tmpdir = self.tmpdir, None
        if not tmpdir:
            return
        for _ in range(2):  # a child still dying of its SIGKILL may add a file while the tree goes
            shutil.rmtree(tmpdir, ignore_errors=True)
            if not os.path.exists(tmpdir):
                return
            time.sleep(0.2)

    def start(self, timeout: float = 240.0, *, port_attempts: int = 4) -> "SGLangServer":
        """Launch and wait until ``/health_generate`` answers; ``ServerStartError`` otherwise.

        A port Gyre picked itself (``port = 0``) is only known free at the moment it was picked;
        SGLang binds it some 20 s later, after loading the tokenizer, and on a busy machine another
        process may take it first. Such a start is retried on a fresh port (``port_attempts`` in
        all); a port the caller chose is never changed.
        """
        auto_port = self.port == 0
        for attempt in range(1, port_attempts + 1):
            if auto_port:
                self.port = free_port()
            try:
                return self._start_once(timeout)
            except _PortTaken:
                if not auto_port or attempt == port_attempts:
                    raise ServerStartError(
                        f"SGLang server could not bind port {self.port} (address already in use); "
                        f"log: {self.log_path}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_once(self, timeout: float) -> "SGLangServer":
        log_start = Path(self.log_path).stat().st_size if self.log_path and Path(self.log_path).exists() else 0
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.tmpdir = self.new_tmpdir()
            cmd, env = self.launch_spec(self.tmpdir)
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent,
            )
        except BaseException:
            self._remove_tmpdir()
            raise
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()  # children of the group (scheduler, detokenizer) may outlive the leader
                if self._log_says_port_taken(log_start):
                    raise _PortTaken()
                raise ServerStartError(f"SGLang server exited with code {code}; log: {self.log_path}")
            if self.healthy():
                return self
            if self._log_says_port_taken(log_start):
                # uvicorn failed to bind but SGLang's process may linger (seen: "Waiting for
                # application shutdown" for minutes): do not wait for it to exit
                self.stop()
                raise _PortTaken()
            time.sleep(0.25)  # a refused connection or a 503 costs nothing; a start is ~20 s
        self.stop()
        raise ServerStartError(f"SGLang server not healthy after {timeout:.0f} s; log: {self.log_path}")

    def _log_says_port_taken(self, offset: int) -> bool:
        if not self.log_path:
            return False
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return False
        return f"{self.port}" in text and ("address already in use" in text.lower() or "Errno 98" in text)

    def client(self, **kwargs: object) -> "SGLangClient":
        """An :class:`~gyre_sglang.client.SGLangClient` for this server, holding its key."""
        from gyre_sglang.client import SGLangClient

        return SGLangClient(self.url, api_key=self.api_key, **kwargs)  # type: ignore[arg-type]

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health_generate", timeout=timeout) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace`` seconds, then remove its
        private ``TMPDIR``; idempotent."""
        try:
            self._stop_group(grace)
        finally:
            self._remove_tmpdir()

    def _stop_group(self, grace: float) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            proc.wait()
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                # The leader is gone; children of the group may linger: give them the same signal.
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            except subprocess.TimeoutExpired:
                continue

    def kill(self) -> None:
        """SIGKILL the whole server at once (fault injection), then remove its private ``TMPDIR``."""
        if self.proc is not None:
            try:
                os.killpg(os.getpgid(self.proc.pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None
        self._remove_tmpdir()

    def __enter__(self) -> "SGLangServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
