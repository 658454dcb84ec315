"""Reading what an untrusted harness left in its workspace, without letting it stall or steer the reader.

A harness is untrusted code (the policy is optimised against the reward) and the evaluator runs in
the orchestrator's process, with its privileges. A plain ``Path.read_text`` on a name the harness
controls follows symlinks (a link to ``/etc/shadow`` would leak a host file into a reward detail,
one to ``/dev/zero`` ends in ``MemoryError``), blocks forever on a FIFO and reads a file of any size
whole. :func:`read_workspace_file` opens only a regular file that sits directly in the workspace
and reads at most a bound; anything else is :class:`WorkspaceFileRefused`.

The rule for the built-in tasks: a refused file (missing, not a regular file, a symlink, larger than
any legitimate answer) is treated exactly as a *missing* answer, whatever that task already makes
of one (``sum-file``: the agent's valid 0, or unresolved after a crash; ``digits`` and
``number-guess``: unresolved). A harness that can plant a FIFO or a symlink can just as well
delete the file, so this gives it no outcome it could not already choose, and the task's
definition of a correct answer (a short number, a JSON object) is what makes a huge file no answer.

Hard links are not refused: outside a sandbox a harness can read (and copy) whatever it could
hard-link, and inside one it sees only its own directories, so a hard link names nothing new; a
symlink, by contrast, is resolved in the evaluator's own view of the filesystem.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

__all__ = ["WorkspaceFileRefused", "read_workspace_file"]

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
"""``O_NOFOLLOW``: a symlink fails to open (ELOOP) instead of being followed; ``O_NONBLOCK``: a FIFO
opens at once instead of waiting for a writer that never comes; ``O_NOCTTY``: a terminal never
becomes ours."""


class WorkspaceFileRefused(OSError):
    """No usable file: missing, not a regular file, a symlink, or larger than the limit.

    An :class:`OSError`, so an evaluator that already treats a missing file (``FileNotFoundError``)
    one way treats every refused file the same way unless it says otherwise."""


def read_workspace_file(workdir: str | Path, name: str, limit_bytes: int, *, errors: str = "strict") -> str:
    """The text of the regular file ``name`` directly inside ``workdir``, at most ``limit_bytes`` long.

    ``workdir`` itself is trusted (the orchestrator created it) and opened as given; ``name`` is
    resolved relative to that open directory, so nothing inside the workspace but the file itself
    is traversed: a name with a path separator or ``..`` is a programming error (``ValueError``).
    Decoded like ``Path.read_text`` (locale encoding, universal newlines, ``errors``), so a normal
    file reads exactly as before.

    Raises :class:`WorkspaceFileRefused` when there is no usable file, and a plain ``OSError`` when
    the workspace itself cannot be opened (nothing was looked at: the caller's *unresolved*)."""
    if not name or name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name) or "\0" in name:
        raise ValueError(f"{name!r} is not a plain file name")
    if limit_bytes < 0:
        raise ValueError("limit_bytes must be >= 0")
    dir_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        raw = _read_regular(dir_fd, name, limit_bytes)
    finally:
        os.close(dir_fd)
    return io.TextIOWrapper(io.BytesIO(raw), encoding=None, errors=errors).read()


def _read_regular(dir_fd: int, name: str, limit_bytes: int) -> bytes:
    try:
        # refuse a device or FIFO before opening it at all (opening some devices has side effects);
        # the fstat below is the check that counts, since the entry may change in between
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
            raise WorkspaceFileRefused(f"{name} is {kind}")
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise WorkspaceFileRefused(f"no {name}") from None
    except WorkspaceFileRefused:
        raise
    except OSError as e:  # ELOOP from O_NOFOLLOW, or the entry swapped for something unreadable
        raise WorkspaceFileRefused(f"{name} cannot be opened as a regular file ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WorkspaceFileRefused(f"{name} is not a regular file")
        if st.st_size > limit_bytes:
            raise WorkspaceFileRefused(f"{name} is {st.st_size} bytes, over the {limit_bytes}-byte limit")
        chunks: list[bytes] = []
        left = limit_bytes + 1  # one more byte tells a file that grew past the limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    if left <= 0:
        raise WorkspaceFileRefused(f"{name} is over the {limit_bytes}-byte limit")
    return b"".join(chunks)
