"""The built-in evaluators read what an untrusted harness left: nothing it plants there stalls, crashes or steers them.

A FIFO, a symlink (to ``/dev/zero``, or to a host file holding a correct-looking answer), a
directory or a 1 GiB file in place of the answer is assessed within seconds, exactly as a missing
answer (``sum-file``: a valid 0 after a finished run, unresolved after a crash; ``digits`` and
``number-guess``: unresolved), and no byte is read through a symlink. Each case runs in a daemon
thread with a deadline, so a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest

from gyre_core.interfaces import Assessment, ExecutionSpec, StateRef
from gyre_core.orchestrator import harness
from gyre_core.tasks import digits, number_guess, sum_file
from gyre_core.tasks.workspace_files import WorkspaceFileRefused, read_workspace_file

STATE = StateRef("final", "main")
DEADLINE_S = 10.0
SECRET = 42


def _spec(workdir: Path, harness_kind: str, extra: dict[str, Any]) -> ExecutionSpec:
    return ExecutionSpec(execution_id=1, workdir=str(workdir), proxy_base_url="http://127.0.0.1:1", api_key="k",
                         harness_timeout_s=10, overall_budget_s=20, harness=harness_kind, task="t", extra=extra)


# task -> (evaluator module, answer file, a correct answer, spec factory, what a missing answer is)
TASKS: dict[str, tuple[ModuleType, str, str, Callable[[Path], ExecutionSpec], str]] = {
    "sum-file": (sum_file, "answer.txt", "42\n",
                 lambda w: _spec(w, "claude-code", {"task": "sum-file", "a": 40, "b": 2,
                                                    "harness_exit": 1, "harness_end": "failed"}), "zero"),
    "digits": (digits, "reply.txt", "123456", lambda w: _spec(w, "reply", {"task": "digits"}), "unresolved"),
    "number-guess": (number_guess, "answer.json", json.dumps({"final_guess": SECRET, "guesses": [SECRET]}),
                     lambda w: _spec(w, "number-guess", number_guess.NumberGuessInstance(secret=SECRET).as_extra()),
                     "unresolved"),
}


def _within_deadline(fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, failing (not hanging) if it takes over :data:`DEADLINE_S` or raises."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- reported below, in the test's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive(), f"still running after {DEADLINE_S}s"
    assert "error" not in box, f"raised {box.get('error')!r}"
    return box["value"]


def _plant_fifo(path: Path, outside: Path) -> None:
    os.mkfifo(path)


def _plant_dev_zero(path: Path, outside: Path) -> None:
    path.symlink_to("/dev/zero")


def _plant_link_outside(path: Path, outside: Path) -> None:
    path.symlink_to(outside)


def _plant_huge(path: Path, outside: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: no disk, but 1 GiB to a reader


def _plant_directory(path: Path, outside: Path) -> None:
    path.mkdir()


PLANTS = {"fifo": _plant_fifo, "symlink-dev-zero": _plant_dev_zero, "symlink-outside": _plant_link_outside,
          "sparse-1gib": _plant_huge, "directory": _plant_directory}


def _check_like_missing(a: Assessment, missing: str) -> None:
    if missing == "zero":
        assert a.validity.value == "valid" and a.score == 0.0, a
    else:
        assert a.validity.value == "unresolved" and a.score is None, a


@pytest.mark.parametrize("plant", sorted(PLANTS))
@pytest.mark.parametrize("task", sorted(TASKS))
def test_a_planted_answer_is_assessed_like_a_missing_one(tmp_path: Path, task: str, plant: str) -> None:
    module, name, correct, make_spec, missing = TASKS[task]
    work, host = tmp_path / "work", tmp_path / "host"
    work.mkdir()
    host.mkdir()
    outside = host / name
    outside.write_text(correct)  # a correct answer the harness must not be able to point at
    spec = make_spec(work)
    _check_like_missing(_within_deadline(lambda: module.gyre_evaluate(spec=spec, state=STATE)), missing)
    PLANTS[plant](work / name, outside)
    a = _within_deadline(lambda: module.gyre_evaluate(spec=spec, state=STATE))
    _check_like_missing(a, missing)
    assert correct.strip() not in (a.detail or "")  # nothing read through the link leaks into the record


@pytest.mark.parametrize("task", sorted(TASKS))
def test_a_regular_answer_is_still_scored(tmp_path: Path, task: str) -> None:
    module, name, correct, make_spec, _ = TASKS[task]
    (tmp_path / name).write_text(correct)
    assert _within_deadline(lambda: module.gyre_evaluate(spec=make_spec(tmp_path), state=STATE)).score == 1.0


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_sum_file_after_a_crash_a_planted_answer_is_unresolved_like_a_missing_one(tmp_path: Path, plant: str) -> None:
    _, name, correct, make_spec, _ = TASKS["sum-file"]
    outside = tmp_path / "host.txt"
    outside.write_text(correct)
    work = tmp_path / "work"
    work.mkdir()
    PLANTS[plant](work / name, outside)
    spec = make_spec(work)
    crashed = ExecutionSpec(**{**spec.__dict__, "extra": {**spec.extra, "harness_exit": -9, "harness_end": "crashed"}})
    a = _within_deadline(lambda: sum_file.gyre_evaluate(spec=crashed, state=STATE))
    assert a.validity.value == "unresolved" and "crashed" in a.detail


def test_the_size_limit_is_exact_and_a_file_over_it_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"1234")
    assert read_workspace_file(tmp_path, "f", 4) == "1234"
    with pytest.raises(WorkspaceFileRefused, match="limit"):
        read_workspace_file(tmp_path, "f", 3)


def test_text_reads_as_path_read_text_does(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"a\r\nb\rc\xff\n")
    assert read_workspace_file(tmp_path, "f", 100, errors="replace") == (tmp_path / "f").read_text(errors="replace")


def test_names_are_single_components_and_the_workspace_itself_is_trusted(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("x")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "sub").symlink_to(tmp_path / "real")
    for bad in ("sub/f", "../real/f", "..", ".", ""):
        with pytest.raises(ValueError):
            read_workspace_file(tmp_path / "work", bad, 10)
    (tmp_path / "link").symlink_to(tmp_path / "real")  # the orchestrator's own path may be a link
    assert read_workspace_file(tmp_path / "link", "f", 10) == "x"
    with pytest.raises(FileNotFoundError) as e:  # no workspace: an OSError, but not a refused answer
        read_workspace_file(tmp_path / "gone", "f", 10)
    assert not isinstance(e.value, WorkspaceFileRefused)


@pytest.mark.parametrize("content", ["[1, 2]", "[" * 100_000, '"x"', "{", '{"final_guess": "7"}'])
def test_number_guess_malformed_answers_are_unresolved_not_a_crash(tmp_path: Path, content: str) -> None:
    _, name, _, make_spec, _ = TASKS["number-guess"]
    (tmp_path / name).write_text(content)
    a = _within_deadline(lambda: number_guess.gyre_evaluate(spec=make_spec(tmp_path), state=STATE))
    assert a.validity.value == "unresolved"


RESULT_LINE = json.dumps({"type": "result", "is_error": True, "result": "capped"})


def test_cli_result_is_found_at_the_end_of_a_huge_log(tmp_path: Path) -> None:
    log = tmp_path / "e.log"
    with open(log, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB of (sparse) noise first
        f.seek(0, os.SEEK_END)
        f.write(b"\nsome stderr\n" + RESULT_LINE.encode() + b"\n")
    assert _within_deadline(lambda: harness._has_cli_result(str(log))) is True
    assert _within_deadline(lambda: harness.classify_end("claude-code", 1, str(log))) == "failed"
    with open(log, "ab") as f:
        f.write(b"x" * (2 * harness.CLI_RESULT_TAIL_BYTES) + b"\n")  # the result is no longer at the end
    assert _within_deadline(lambda: harness._has_cli_result(str(log))) is False


def test_a_result_line_starting_exactly_at_the_window_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "e.log"
    log.write_text("x" * 100 + "\n" + RESULT_LINE + "\n")
    monkeypatch.setattr(harness, "CLI_RESULT_TAIL_BYTES", len(RESULT_LINE) + 1)
    assert harness._has_cli_result(str(log)) is True
    monkeypatch.setattr(harness, "CLI_RESULT_TAIL_BYTES", len(RESULT_LINE))  # the window cuts the line
    assert harness._has_cli_result(str(log)) is False


def test_a_fifo_or_symlinked_log_is_no_report(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    assert _within_deadline(lambda: harness.classify_end("claude-code", 1, str(fifo))) == "crashed"
    real = tmp_path / "elsewhere.log"
    real.write_text(RESULT_LINE + "\n")
    link = tmp_path / "link.log"
    link.symlink_to(real)
    assert _within_deadline(lambda: harness._has_cli_result(str(link))) is False
    assert harness._has_cli_result(str(real)) is True
    nested = tmp_path / "nested.log"
    nested.write_text("{" + '"a":[' * 100_000 + "\n")  # nested past the JSON parser's depth
    assert _within_deadline(lambda: harness._has_cli_result(str(nested))) is False
