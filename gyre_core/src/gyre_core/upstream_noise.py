"""Keep what upstream libraries print in every healthy run off the console, and nothing else.

Mooncake's C++ log writes ``Local segment descriptor not found`` (and glog's "Logging before
InitGoogleLogging()" banner) to stderr each time a transfer engine starts, and its INFO lines
unless ``MC_LOG_LEVEL`` is set *before* ``mooncake.engine`` is first imported (the level is read
once, at load); megatron-core warns "Transformer Engine and Apex are not installed" from four
modules on import. None of it tells a user anything. What matches :data:`NOISE` or
:data:`PYTHON_NOISE` goes to the ``gyre.upstream`` logger at DEBUG, which a run writes to
``<run>/upstream.log``; any other line a native call prints, and any other Python warning, is
shown as before, so a real error still reaches the console.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Iterator, MutableMapping

__all__ = ["NOISE", "PYTHON_NOISE", "is_noise", "mooncake_quiet_env", "native_stderr_filtered", "upstream_log",
           "upstream_log_file"]

upstream_log = logging.getLogger("gyre.upstream")

NOISE: tuple[re.Pattern[str], ...] = (
    re.compile(r"Logging before InitGoogleLogging\(\) is written to STDERR"),
    re.compile(r"transfer_metadata\.cpp:\d+\] Local segment descriptor not found"),
)
"""Lines that upstream's native code prints in every healthy run."""

PYTHON_NOISE: tuple[re.Pattern[str], ...] = (
    re.compile(r"^Transformer Engine and Apex are not installed\."),
)
"""Python warnings upstream emits in every healthy run on a machine without those optional kernels."""

_fd_lock = threading.Lock()


def is_noise(line: str) -> bool:
    return any(p.search(line) for p in NOISE)


def mooncake_quiet_env(env: MutableMapping[str, str] | None = None) -> None:
    """Mooncake logs from ERROR up unless the user chose a level; call before importing it."""
    (os.environ if env is None else env).setdefault("MC_LOG_LEVEL", "ERROR")


@contextlib.contextmanager
def native_stderr_filtered() -> Iterator[list[str]]:
    """Capture file descriptor 2 around a native call; yields the list its lines land in.

    Noise goes to :data:`upstream_log`; every other line is written back to stderr on exit. What
    other threads write to stderr in that (millisecond) window is captured too and passed back
    with the rest: delayed, never lost."""
    lines: list[str] = []
    with _fd_lock, tempfile.TemporaryFile(mode="w+b") as tmp:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode("utf-8", "replace").splitlines())
            kept = []
            for line in lines:
                if is_noise(line):
                    upstream_log.debug("%s", line)
                else:
                    kept.append(line)
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")
                with contextlib.suppress(Exception):
                    sys.stderr.flush()


@contextlib.contextmanager
def upstream_log_file(path: Path) -> Iterator[None]:
    """While inside, :data:`upstream_log` writes to ``path`` (and never to the console), and Python
    warnings that match :data:`PYTHON_NOISE` go there instead of stderr."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    level, propagate = upstream_log.level, upstream_log.propagate
    upstream_log.addHandler(handler)
    upstream_log.setLevel(logging.DEBUG)
    upstream_log.propagate = False
    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: object = None, line: str | None = None) -> None:
        if any(p.search(str(message)) for p in PYTHON_NOISE):
            upstream_log.debug("%s:%s: %s: %s", filename, lineno, category.__name__, message)
            return
        shown(message, category, filename, lineno, file, line)  # type: ignore[arg-type]

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = shown
        upstream_log.removeHandler(handler)
        upstream_log.setLevel(level)
        upstream_log.propagate = propagate
        handler.close()
