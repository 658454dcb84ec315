"""Installing and running the real Claude Code CLI for the integration tests.

The CLI is installed on first use with npm, pinned, into ``~/.cache/gyre/claude-code/<version>``
(``GYRE_CLAUDE_CODE_CACHE`` overrides the parent folder), so a CI runner with Node and network
access to the npm registry needs nothing else; later runs reuse it (``npx``-free, about 0.1 s to
start). ``GYRE_CLAUDE_CODE_BIN`` points at an already installed ``claude`` instead.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

CLAUDE_CODE_VERSION = "2.1.197"
"""Pinned: the request shapes in ``notes/claude-code-harness.md`` and the fixture were seen with it."""


class CLIUnavailable(RuntimeError):
    """The CLI can neither be found nor installed here (no Node/npm, or no registry)."""


def cache_dir() -> Path:
    root = Path(os.environ.get("GYRE_CLAUDE_CODE_CACHE", Path.home() / ".cache" / "gyre" / "claude-code"))
    return root / CLAUDE_CODE_VERSION


def ensure_cli(timeout: float = 600) -> Path:
    """Path of the pinned ``claude`` executable, installing it with npm if missing (locked)."""
    override = os.environ.get("GYRE_CLAUDE_CODE_BIN")
    if override:
        return Path(override)
    prefix = cache_dir()
    binary = prefix / "node_modules" / ".bin" / "claude"
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise CLIUnavailable("node and npm are needed to install the Claude Code CLI")
    prefix.mkdir(parents=True, exist_ok=True)
    with open(prefix / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            proc = subprocess.run(
                [npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                 f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}"],
                capture_output=True, text=True, timeout=timeout,
            )
            if proc.returncode != 0 or not binary.exists():
                raise CLIUnavailable(f"npm install failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return binary


def claude_env(scratch: Path, base_url: str, api_key: str, model: str) -> dict[str, str]:
    """Environment for one non-interactive run: own HOME, no vendor traffic, the execution's key."""
    home = scratch / "home"
    (home / ".claude").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(
        HOME=str(home),
        CLAUDE_CONFIG_DIR=str(home / ".claude"),
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY=api_key,
        ANTHROPIC_MODEL=model,
        ANTHROPIC_SMALL_FAST_MODEL=model,
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        IS_SANDBOX="1",
    )
    return env
