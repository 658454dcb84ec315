"""Harness processes: one per execution, isolated, with its own credential.

Each harness runs in its execution's working directory with a private ``HOME``, in its own
process group (so a timeout kills the harness *and* whatever it spawned, and nothing else), and
learns about Gyre only through environment variables: the proxy's base URL and the execution's
own API key, under both the OpenAI and the Anthropic names. Built-in launchers:

- ``number-guess``: the built-in task's agent loop (:mod:`gyre_core.tasks.number_guess_harness`);
- ``reply``: one chat call with the task's prompt, the reply in ``reply.txt``
  (:mod:`gyre_core.tasks.reply_harness`; plays the built-in ``digits`` task);
- ``replay``: one recorded execution of a trace replayed through the proxy, at the recorded pace
  and with the recorded outcome (:mod:`gyre_core.tasks.replay_harness`; plays ``digits``);
- ``command``: any program, ``extra["command"]`` as an argument list (``{task}``, ``{workdir}``
  are substituted);
- ``claude-code``: the real Claude Code CLI in print mode, offline (no telemetry, updater or
  non-essential traffic; ``extra["claude_bin"]`` names the executable).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from gyre_core.hookspecs import hookimpl
from gyre_core.interfaces import ExecutionSpec
from gyre_core.procutil import die_with_parent
from gyre_core.tasks.workspace_command import run_in_workspace

__all__ = ["HARNESS_ENDS", "SubprocessHarness", "TaskSetupFailed", "classify_end", "harness_env", "launch_command"]

HARNESS_ENDS = ("completed", "failed", "crashed")
"""How a harness process ended, which decides what its exit may mean for the reward:

* ``completed``: exit 0;
* ``failed``: it ran to its end and reported a failure itself (a complete failure, which the
  task's evaluator may score 0 when nothing assessable was produced);
* ``crashed``: killed by a signal (a timeout kill, the OOM killer), or a crash of the harness
  itself (no final report): nothing it vouched for, so never a zero -- the evaluator may still
  assess what the workspace holds, else the execution is excluded.
"""


def classify_end(harness: str, code: int, log_path: str | None = None) -> str:
    """One of :data:`HARNESS_ENDS` for a harness of kind ``harness`` that exited with ``code``.

    ``number-guess`` (Gyre's own agent loop) exits 0 whenever it plays to its end, so any other
    code is a crash. ``claude-code`` ran to its end when its log holds the CLI's final ``result``
    object (``--output-format json``), whatever the exit code. ``command``: a signal (negative
    code, or above 128 as shells report it) is a crash; any other non-zero code is the program's
    own report of failure."""
    if code == 0:
        return "completed"
    if code < 0 or code > 128:
        return "crashed"
    if harness in ("number-guess", "reply"):  # Gyre's own loops exit 0 whenever they ran to their end
        return "crashed"
    if harness == "claude-code":
        return "failed" if _has_cli_result(log_path) else "crashed"
    return "failed"


CLI_RESULT_TAIL_BYTES = 1 << 20
"""How much of the end of a harness log :func:`_has_cli_result` reads: the CLI's final ``result``
object is its last JSON line, and the log (written by the harness) may be of any size."""


def _has_cli_result(log_path: str | None) -> bool:
    """Whether the log ends with the CLI's ``result`` object, reading only its last
    :data:`CLI_RESULT_TAIL_BYTES`. The harness writes (and may replace) its log, so a symlink (not
    followed), a FIFO (opened without blocking) or anything but a regular file is no report: the
    run counts as crashed, which is never a zero."""
    if not log_path:
        return False
    import json

    try:
        fd = os.open(log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        # one byte before the window tells whether its first line starts there or is cut
        start = max(0, st.st_size - CLI_RESULT_TAIL_BYTES - 1)
        tail = os.pread(fd, CLI_RESULT_TAIL_BYTES + 1, start)
    except OSError:
        return False
    finally:
        os.close(fd)
    if start > 0:
        nl = tail.find(b"\n")
        tail = tail[nl + 1:] if nl >= 0 else b""  # drop the line the window cuts
    lines = tail.decode(errors="replace").splitlines()
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: brackets nested past the parser's depth
                continue
            if isinstance(obj, dict) and obj.get("type") == "result":
                return True
    return False


class SubprocessHarness:
    """A :class:`~gyre_core.interfaces.HarnessHandle` over a process group."""

    def __init__(self, argv: Sequence[str], cwd: str, env: dict[str, str], log_path: str | None = None,
                 pass_fds: Sequence[int] = ()) -> None:
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent, pass_fds=tuple(pass_fds))
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        self.pid = self.proc.pid
        self.log_path = log_path
        self.harness = ""
        """The harness kind, for :meth:`end_kind` (set by the launcher)."""

    def end_kind(self, code: int) -> str:
        """How the process ended (:func:`classify_end`)."""
        return classify_end(self.harness, code, self.log_path)

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, grace: float = 3.0) -> None:
        if self.proc.poll() is not None:
            self._reap_group()
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self._reap_group()

    def _reap_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)  # children the harness left behind
        except (ProcessLookupError, PermissionError):
            pass


def harness_env(spec: ExecutionSpec, home: Path) -> dict[str, str]:
    """The environment of a harness: a minimal inherited base plus the execution's credentials."""
    keep = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "SSL_CERT_FILE")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    base = spec.proxy_base_url.rstrip("/")
    env.update({
        "HOME": str(home),
        "OPENAI_BASE_URL": base + "/v1",
        "OPENAI_API_KEY": spec.api_key,
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": spec.api_key,
        "GYRE_EXECUTION_ID": str(spec.execution_id),
        "GYRE_MODEL": str(spec.extra.get("model", "gyre-policy")),
    })
    env.update({str(k): str(v) for k, v in dict(spec.extra.get("env", {})).items()})
    return env


class TaskSetupFailed(RuntimeError):
    """The task's set-up command failed in the workspace: the harness never started. Not the
    policy's doing: the execution is excluded, never scored."""


def launch_command(spec: ExecutionSpec) -> list[str] | None:
    """The argument list that runs ``spec.harness``, or ``None`` if it is not a built-in one."""
    x = spec.extra
    if spec.harness == "number-guess":  # the secret travels in the environment, never on argv
        return [sys.executable, "-m", "gyre_core.tasks.number_guess_harness",
                "--low", str(x.get("low", 0)), "--high", str(x.get("high", 99)), "--turns", str(x.get("turns", 3))]
    if spec.harness == "reply":
        return [sys.executable, "-m", "gyre_core.tasks.reply_harness", spec.task]
    if spec.harness == "replay":
        r = x["replay"]
        return [sys.executable, "-m", "gyre_core.tasks.replay_harness", spec.task, "--duration-s",
                repr(float(r["duration_s"])), "--outcome", str(r["outcome"]), "--calls", str(int(r.get("calls", 3))),
                "--context-tokens", str(int(r.get("context_tokens", 0))),
                "--tokens-per-word", repr(float(r.get("tokens_per_word", 1.0)))]
    if spec.harness == "command":
        cmd = x.get("command")
        if not isinstance(cmd, (list, tuple)) or not cmd or not all(isinstance(c, str) for c in cmd):
            raise ValueError("harness 'command' needs extra['command'] as a non-empty list of strings")
        return [c.format(task=spec.task, workdir=spec.workdir) for c in cmd]
    if spec.harness == "claude-code":
        return [str(x.get("claude_bin", "claude")), "-p", spec.task, "--dangerously-skip-permissions",
                "--output-format", "json", *[str(a) for a in x.get("claude_args", ())]]
    return None


@hookimpl
def gyre_launch_harness(spec: ExecutionSpec) -> Any:
    argv = launch_command(spec)
    if argv is None:
        return None
    workdir = Path(spec.workdir)
    home = workdir.parent / f"{workdir.name}.home"
    home.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    src = spec.extra.get("workspace_src")
    if src:  # what the task brings (a repository, its tests), copied in before the harness starts
        if Path(src).is_dir():
            shutil.copytree(src, workdir, dirs_exist_ok=True, symlinks=True)
        else:
            shutil.copy2(src, workdir / Path(src).name)
    for rel, content in dict(spec.extra.get("workspace_files") or {}).items():
        dest = (workdir / rel).resolve()
        if not dest.is_relative_to(workdir.resolve()):
            raise ValueError(f"workspace file {rel!r} would lie outside the workspace")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(content)
    env = harness_env(spec, home)
    if spec.harness == "number-guess":
        env["GYRE_NUMBER_GUESS_SECRET"] = str(spec.extra["secret"])
    if spec.harness == "claude-code":
        (home / ".claude").mkdir(exist_ok=True)
        # Offline settings; side requests (titles) use the same model, since the proxy serves
        # only the policy.
        env.update({"CLAUDE_CONFIG_DIR": str(home / ".claude"), "ANTHROPIC_MODEL": env["GYRE_MODEL"],
                    "ANTHROPIC_SMALL_FAST_MODEL": env["GYRE_MODEL"], "DISABLE_TELEMETRY": "1",
                    "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "IS_SANDBOX": "1"})
    pass_fds: tuple[int, ...] = ()
    if spec.extra.get("sandbox"):
        from gyre_core.orchestrator.sandbox import prepare_dirs

        (home / "tmp").mkdir(exist_ok=True)
        prepare_dirs(workdir, home, home / "tmp")  # the sandbox's own user writes them
    setup = spec.extra.get("setup")
    if setup:  # the task's set-up, where and as the harness will run; never with the execution's key
        code, _, detail = run_in_workspace(setup, str(workdir.resolve()), float(spec.extra.get("setup_timeout_s", 300.0)),
                                           spec.extra.get("sandbox"), what="task set-up")
        if code != 0:
            raise TaskSetupFailed(detail)
    if spec.extra.get("sandbox"):
        from gyre_core.orchestrator.sandbox import SandboxSpec, wrap

        launch = wrap(argv, SandboxSpec.from_extra(spec.extra["sandbox"]), str(workdir.resolve()), str(home.resolve()))
        argv, pass_fds = launch.argv, launch.pass_fds
        env["TMPDIR"] = str((home / "tmp").resolve())  # the sandbox's /tmp is empty and its own
    handle = SubprocessHarness(argv, str(workdir), env, log_path=str(workdir.parent / f"{workdir.name}.log"),
                               pass_fds=pass_fds)
    handle.harness = spec.harness
    return handle
