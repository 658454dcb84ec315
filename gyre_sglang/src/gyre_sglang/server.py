"""Start and stop a real SGLang server process, with Gyre's plugin and (on CPU) Gyre's patches.

Used by tests, benchmarks and the embedded default of ``gyre-orchestrate run``; on a cluster the
servers are usually started by the user's own launcher with the same arguments. The server runs in
its own process group so that teardown reaches its scheduler and detokenizer children, and only
them: SIGTERM to the group, SIGKILL after a bounded wait (an SGLang CPU server can linger for 20 s
after SIGTERM).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
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


_LAUNCHER_VARIABLES = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
})


@dataclass
class SGLangServer:
    """One ``python -m sglang.launch_server`` process serving ``model_dir``.

    ``extra_args`` pass through to SGLang unchanged (any server argument a user would give it).
    On a machine without CUDA the CPU engine is selected and Gyre's CPU patch is applied in every
    server process; ``max_total_tokens`` bounds the KV pool (SGLang otherwise reserves ~15 GB).

    ``api_key`` (default: a fresh random key per server) guards every route but the health
    probes: SGLang's own ``--api-key`` covers generate and weight updates, and Gyre's plugin checks
    the same key (``GYRE_ENGINE_KEY``) on its ``/gyre/`` routes. :meth:`client` hands it on.
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
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = secrets.token_urlsafe(24)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(self.model_dir),
            "--host", self.host, "--port", str(self.port),
            "--max-total-tokens", str(self.max_total_tokens),
            f"--api-key={self.api_key}",  # one token: a key may start with "-" (token_urlsafe does, 1 in 64)
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

    def gpu_args(self) -> list[str]:
        """``--base-gpu-id`` and ``--tp-size`` for this engine's GPUs, unless the user's
        ``extra_args`` already place it."""
        given = {a.split("=", 1)[0] for a in self.extra_args}
        out: list[str] = []
        if self.base_gpu_id is not None and "--base-gpu-id" not in given:
            out += ["--base-gpu-id", str(self.base_gpu_id)]
        if not given & {"--tp", "--tp-size", "--tensor-parallel-size"}:
            out += ["--tp-size", str(self.tp_size)]
        return out

    def _environment(self) -> dict[str, str]:
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
        env.update(self.env)
        return env

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
            self.proc = subprocess.Popen(
                self.command(), env=self._environment(), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent,
            )
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
            time.sleep(1.0)
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
        """SIGTERM the server's process group, SIGKILL it after ``grace`` seconds; idempotent."""
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
        """SIGKILL the whole server at once (fault injection)."""
        if self.proc is not None:
            try:
                os.killpg(os.getpgid(self.proc.pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> "SGLangServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
