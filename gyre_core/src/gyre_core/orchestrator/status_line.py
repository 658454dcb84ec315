"""The live status line: where a run stands, between the log lines of steps and publications.

Rollout phases last minutes to hours with nothing to log; the status line shows the step, the
cells by role, executions running / in ready groups / trained, the last step's mean reward, and
the elapsed and estimated remaining time. On a terminal it is redrawn in place every second (log
lines are printed above it); when the stream is not a terminal (CI, ``nohup``, a pipe) it is a
plain log line every ``plain_every_s`` seconds instead, so logs stay readable.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence, TextIO

__all__ = ["StatusLine", "duration", "status_text"]

_ROLE_LETTER = {"rollout": "R", "training": "T", "to_training": "t", "to_rollout": "r"}


def duration(seconds: float) -> str:
    """``95`` → ``1m35s``; ``7300`` → ``2h01m``."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def status_text(*, steps_done: int, steps_total: int, cell_roles: Sequence[str], running: int, ready_groups: int,
                trained: int, last_reward: float | None, elapsed_s: float) -> str:
    """One line. The remaining time is the run's time per finished step so far times the steps
    left (unknown before the first step ends)."""
    roles = "".join(_ROLE_LETTER.get(r, "?") for r in cell_roles)
    parts = [f"step {steps_done}/{steps_total}", f"cells {roles} (R rollout, T training, t/r switching)",
             f"executions {running} running, {ready_groups} groups ready, {trained} trained"]
    if last_reward is not None:
        parts.append(f"reward {last_reward:.3f}")
    left = ""
    if 0 < steps_done < steps_total:
        left = f", ~{duration(elapsed_s / steps_done * (steps_total - steps_done))} left"
    parts.append(f"{duration(elapsed_s)} elapsed{left}")
    return " · ".join(parts)


class StatusLine:
    """Draws the status on ``stream``; ``log`` prints a message without tearing the status."""

    def __init__(self, stream: TextIO, *, plain_every_s: float = 30.0, is_tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.is_tty = stream.isatty() if is_tty is None else is_tty
        self.plain_every_s = plain_every_s
        self.clock = clock
        self._text = ""
        self._last_plain: float | None = None

    def update(self, text: str) -> None:
        self._text = text
        if self.is_tty:
            self.stream.write("\r\x1b[K" + text)
            self.stream.flush()
            return
        now = self.clock()
        if self._last_plain is None or now - self._last_plain >= self.plain_every_s:
            self._last_plain = now
            self.stream.write(f"[gyre {time.strftime('%H:%M:%S')}] status: {text}\n")
            self.stream.flush()

    def log(self, message: str) -> None:
        if self.is_tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(f"[gyre {time.strftime('%H:%M:%S')}] {message}\n")
        if self.is_tty and self._text:
            self.stream.write(self._text)
        self.stream.flush()

    def close(self) -> None:
        if self.is_tty and self._text:
            self.stream.write("\n")
            self.stream.flush()
        self._text = ""
