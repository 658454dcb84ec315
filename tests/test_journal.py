"""The run journal survives a crash mid-write, and every unreadable record is named by its line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gyre_core.orchestrator.embedded import config_changes
from gyre_core.orchestrator.journal import Journal, JournalError, Replay, cut_torn_tail, read_journal
from gyre_core.orchestrator.run_config import load_run_config
from gyre_core.scheduler import events as ev


def _journal(path: Path) -> Journal:
    j = Journal(path, fresh=True)
    j.write("config", config=load_run_config().as_dict())
    j.event(0.0, ev.Start())
    j.write("published", version=1, location="/w/v1")
    return j


def test_a_torn_tail_is_cut_on_reopen_and_the_next_record_survives(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    _journal(path).close()
    whole = path.read_bytes()
    with open(path, "ab") as f:  # a crash mid-write: half a record, no newline
        f.write(b'{"kind":"published","version":2,"loca')
    assert len(list(read_journal(path))) == 3  # the fragment never took effect
    j = Journal(path, fresh=False)
    assert j.cut_bytes == len(b'{"kind":"published","version":2,"loca') and path.read_bytes() == whole
    j.write("published", version=2, location="/w/v2")
    j.close()
    j = Journal(path, fresh=False)  # a second resume: nothing is cut, nothing is lost
    assert j.cut_bytes == 0
    j.close()
    assert Replay.load(path).published == {1: "/w/v1", 2: "/w/v2"}
    assert cut_torn_tail(path) == 0


@pytest.mark.parametrize("bad, says", [
    (b"\xff\xfe not utf-8\n", "corrupt record (UnicodeDecodeError"),
    (b"[1, 2, 3]\n", "not a journal record"),
    (b'{"no": "kind"}\n', "not a journal record"),
    (b'{"kind": "event", "t": 1.0, "event": {"type": "Nonsense"}}\n', "unknown event type 'Nonsense'"),
    (b'{"kind": "published", "version": 3}\n', "missing field 'location'"),
    (b'{"kind": "scored", "execution_id": 4, "group": 1, "reward": "high"}\n', "bad 'scored' record"),
    (b'{"kind": "mystery"}\n', "unknown record kind 'mystery'"),
    (b'{"kind": "published", "version": 3, "loc\n', "corrupt record (JSONDecodeError"),  # torn, then more
])
def test_every_unreadable_record_is_a_journal_error_naming_its_line(tmp_path: Path, bad: bytes, says: str) -> None:
    path = tmp_path / "journal.jsonl"
    _journal(path).close()
    with open(path, "ab") as f:
        f.write(bad)
        f.write(b'{"kind":"published","version":9,"location":"/w/v9"}\n')
    with pytest.raises(JournalError) as e:
        Replay.load(path)
    assert f"{path}:4:" in str(e.value) and says in str(e.value), str(e.value)


def test_the_cli_says_it_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "gyre_core.cli", "run", "--out", str(out), "--resume"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"gyre-orchestrate: error: no journal at {out / 'journal.jsonl'}: "
                                                "nothing to resume"]


def test_a_resume_names_every_changed_setting_the_journal_depends_on() -> None:
    before = load_run_config().as_dict()
    after = load_run_config(None, {"sampling.max_new_tokens": "40", "training.lr": "0.01", "run.seed": "3",
                                   "harness.timeout_s": "100", "run.steps": "9", "watchdog.failures": "5",
                                   "training.step_timeout_s": "30"}).as_dict()
    assert config_changes(before, after) == ["harness.timeout_s", "run.seed", "sampling.max_new_tokens", "training.lr"]
    assert config_changes(before, before) == []


def test_a_forced_resume_is_explicit(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "gyre_core.cli", "run", "--out", str(tmp_path), "--force-resume"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--force-resume needs --resume" in proc.stderr


def test_checkpoint_pruning_keeps_the_newest_and_what_a_resume_needs() -> None:
    from gyre_core.orchestrator.live_steps import prunable

    ckpts = {s: f"/c/step{s}" for s in range(6)}
    assert prunable(ckpts, 2, published=6) == [0, 1, 2, 3]      # steps 4, 5 stay
    assert prunable(ckpts, 2, published=3) == [0, 1, 3]         # step 2 rebuilds published version 3
    assert prunable(ckpts, 0, published=6) == []                # 0: keep all
    assert prunable({0: "a"}, 1, published=0) == []
    # every 3 steps (after steps 3, 6, 9: steps 2, 5, 8), the 2 newest of those, and always the newest
    ckpts10 = {s: f"c{s}" for s in range(10)}
    assert prunable(ckpts10, 2, published=10, interval=3) == [0, 1, 2, 3, 4, 6, 7]  # 5, 8 and 9 stay


def test_a_deleted_checkpoint_is_not_offered_to_a_resume(tmp_path) -> None:
    from gyre_core.orchestrator.journal import Journal, Replay

    j = Journal(tmp_path / "journal.jsonl", fresh=True)
    j.write("config", config={"run": {"steps": 3}})
    for s in range(3):
        j.write("checkpoint", step=s, path=f"/c/step{s}")
    j.write("checkpoint_deleted", step=0)
    j.close()
    assert Replay.load(tmp_path / "journal.jsonl").checkpoints == {1: "/c/step1", 2: "/c/step2"}
