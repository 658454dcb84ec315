"""The live status line says where a run stands, in place on a terminal and sparsely elsewhere."""

from __future__ import annotations

import io

from gyre_core.orchestrator.status_line import StatusLine, duration, status_text


def test_the_line_names_step_cells_executions_reward_and_time_left() -> None:
    text = status_text(steps_done=2, steps_total=5, cell_roles=["training", "to_rollout", "rollout"], running=7,
                       ready_groups=1, trained=16, last_reward=0.5123, elapsed_s=130.0)
    assert "step 2/5" in text and "cells TrR" in text
    assert "7 running, 1 groups ready, 16 trained" in text and "reward 0.512" in text
    assert "2m10s elapsed, ~3m15s left" in text  # 65 s per step so far, 3 steps left
    first = status_text(steps_done=0, steps_total=3, cell_roles=["rollout"], running=4, ready_groups=0, trained=0,
                        last_reward=None, elapsed_s=5.0)
    assert "reward" not in first and "left" not in first  # nothing measured yet: nothing guessed


def test_durations_read_at_a_glance() -> None:
    assert [duration(s) for s in (0, 59, 95, 3599, 7300)] == ["0s", "59s", "1m35s", "59m59s", "2h01m"]


def test_on_a_terminal_the_status_is_redrawn_and_log_lines_go_above_it() -> None:
    out = io.StringIO()
    line = StatusLine(out, is_tty=True)
    line.update("step 0/3")
    line.update("step 1/3")
    line.log("published policy version 1")
    line.close()
    text = out.getvalue()
    assert text.count("\r\x1b[K") == 3 and text.endswith("published policy version 1\nstep 1/3\n")


def test_off_a_terminal_it_is_a_plain_line_at_most_every_interval() -> None:
    out = io.StringIO()
    now = [0.0]
    line = StatusLine(out, is_tty=False, plain_every_s=30.0, clock=lambda: now[0])
    for t in (0.0, 1.0, 29.0, 30.0, 31.0, 61.0):
        now[0] = t
        line.update(f"at {t}")
    lines = out.getvalue().splitlines()
    assert [ln.split("status: ")[1] for ln in lines] == ["at 0.0", "at 30.0", "at 61.0"]
    assert "\r" not in out.getvalue()
