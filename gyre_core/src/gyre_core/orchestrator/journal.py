"""The run's durable state: an append-only journal, written as things happen, replayed on resume.

Event sourcing fits because the scheduler is a pure state machine: its whole state is a function
of the events it was fed and their times. So the journal records (one JSON object per line,
flushed and fsynced before the event takes effect):

- ``event``      -- every event fed to the scheduler, with its time;
- ``trajectory`` -- an execution's trajectory tree and selected leaves, written *before* its
  ``ExecutionEnded`` (the proxy's records live in memory only: a crash keeps both or neither, and
  an execution whose end was journalled can always be evaluated after a resume);
- ``scored``     -- an execution's valid reward (written *before* its ``EvaluationValid`` is fed,
  so a reward is never journalled as an event without its data; older journals carry the tree
  here); ``placeholder`` for a complete failure's zero;
- ``excluded``   -- an execution whose evaluation never resolved inside its budget;
- ``checkpoint`` -- the core saved its training state after step ``step`` (weights + optimizer);
- ``checkpoint_deleted`` -- that state was removed (``checkpoint.keep_last``);
- ``published``  -- policy ``version`` is loadable from ``location``.

Replaying the events through a fresh :class:`~gyre_core.scheduler.state_machine.Scheduler`
reproduces its state and the commands it emitted; :class:`Replay` also rebuilds the data plane
(trajectory buffer, assessments) from the other records and works out which commands were still
in flight at the crash, so the live driver can redo exactly those (see ``live.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Iterator

from gyre_core.scheduler import events as ev
from gyre_core.scheduler.events import Outcome, Role
from gyre_core.trajectory import SelectedTrajectory, TrajectoryTree, TreeNode

__all__ = ["Journal", "JournalError", "Replay", "cut_torn_tail", "read_journal", "tree_from_json", "tree_to_json"]

_EVENT_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (ev.Start, ev.ExecutionEnded, ev.EvaluationValid, ev.EvaluationUnresolved, ev.BufferLow,
                ev.MicroStepsDone, ev.TransitionDone, ev.PublicationDone, ev.Tick)
}


class JournalError(RuntimeError):
    """The journal is missing, corrupt (named by ``path:line``), or belongs to a different run."""


# ------------------------------------------------------------------------------------- codecs


def event_to_json(event: ev.Event) -> dict[str, Any]:
    d: dict[str, Any] = {"type": type(event).__name__}
    for f in fields(event):  # type: ignore[arg-type]
        v = getattr(event, f.name)
        d[f.name] = v.value if isinstance(v, (Outcome, Role)) else v
    return d


def event_from_json(d: dict[str, Any]) -> ev.Event:
    if d.get("type") not in _EVENT_TYPES:
        raise ValueError(f"unknown event type {d.get('type')!r}")
    cls = _EVENT_TYPES[d["type"]]
    kw = {k: v for k, v in d.items() if k != "type"}
    if cls is ev.ExecutionEnded:
        kw["outcome"] = Outcome(kw["outcome"])
    if cls is ev.TransitionDone:
        kw["role"] = Role(kw["role"])
    return cls(**kw)  # type: ignore[no-any-return]


def tree_to_json(tree: TrajectoryTree) -> dict[str, Any]:
    return {"execution_id": tree.execution_id, "nodes": [
        {"id": n.node_id, "parent": n.parent, "tokens": n.token_ids.tolist(), "prov": n.provenance.tolist(),
         "lp": n.logprobs.tolist(), "meta": dict(n.metadata), "temp": n.temperature} for n in tree]}


def tree_from_json(d: dict[str, Any]) -> TrajectoryTree:
    return TrajectoryTree(int(d["execution_id"]), [
        TreeNode(n["id"], n["parent"], n["tokens"], n["prov"], n["lp"], n.get("meta") or {}, n.get("temp", 1.0))
        for n in d["nodes"]])


def selected_to_json(sel: list[SelectedTrajectory] | tuple[SelectedTrajectory, ...]) -> list[dict[str, Any]]:
    return [{"leaf": s.leaf_id, "role": int(s.role), "targets": sorted(s.targets)} for s in sel]


def selected_from_json(d: list[dict[str, Any]]) -> tuple[SelectedTrajectory, ...]:
    return tuple(SelectedTrajectory(x["leaf"], x["role"], frozenset(x["targets"])) for x in d)


# ------------------------------------------------------------------------------------- journal


class Journal:
    """Append-only, fsynced JSON lines at ``path``. ``open_for_append`` after a resume."""

    def __init__(self, path: str | Path, *, fresh: bool) -> None:
        self.path = Path(path)
        if fresh and self.path.exists():
            raise JournalError(f"{self.path} exists: resume the run (--resume) or choose another run.out_dir")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.cut_bytes = 0 if fresh else cut_torn_tail(self.path)
        """Bytes of a torn last record removed on open (a crash mid-write); 0 if none."""
        self._f: IO[str] = open(self.path, "a", encoding="utf-8")

    def write(self, kind: str, **data: Any) -> None:
        self._f.write(json.dumps({"kind": kind, **data}, default=str, separators=(",", ":")) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def event(self, t: float, event: ev.Event) -> None:
        self.write("event", t=round(t, 6), event=event_to_json(event))

    def close(self) -> None:
        self._f.close()


def cut_torn_tail(path: Path) -> int:
    """Truncate ``path`` back to its last complete record (each record is written as one line with
    its newline, then fsynced, so a record without its newline is one a crash cut short and that
    never took effect). Returns how many bytes were removed. Without this, the next record would
    be glued onto the fragment and lost at the following resume."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1
    with open(path, "r+b") as f:
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return len(data) - keep


def read_journal(path: str | Path) -> Iterator[dict[str, Any]]:
    """The journal's records, each a JSON object. A torn *last* line (a crash mid-write, no newline)
    is skipped; anything else that cannot be read is a :class:`JournalError` naming ``path:line``."""
    p = Path(path)
    if not p.exists():
        raise JournalError(f"no journal at {p}: nothing to resume")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise JournalError(f"{p}: cannot be read ({e})") from e
    lines = data.split(b"\n")
    torn = not data.endswith(b"\n")
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        last = i == len(lines) - 1
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if last and torn:
                return  # the crash cut the last record short: it never took effect
            raise JournalError(f"{p}:{i + 1}: corrupt record ({type(e).__name__}: {e})") from e
        if not isinstance(rec, dict) or not isinstance(rec.get("kind"), str):
            raise JournalError(f"{p}:{i + 1}: not a journal record (a JSON object with a 'kind')")
        rec["_line"] = i + 1
        yield rec


@dataclass
class Replay:
    """What the journal says, digested for the live driver's resume."""

    config: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[float, ev.Event]] = field(default_factory=list)
    scored: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Execution id -> ``scored``/``placeholder`` record, in journal order."""
    excluded: set[int] = field(default_factory=set)
    checkpoints: dict[int, str] = field(default_factory=dict)
    published: dict[int, str] = field(default_factory=dict)
    order: list[dict[str, Any]] = field(default_factory=list)
    """Every record, in order (the driver replays events and data records interleaved)."""

    @classmethod
    def load(cls, path: str | Path) -> "Replay":
        r = cls()
        for rec in read_journal(path):
            kind = rec["kind"]
            try:
                if kind == "config":
                    r.config = dict(rec["config"])
                elif kind == "event":
                    r.events.append((float(rec["t"]), event_from_json(rec["event"])))
                elif kind in ("scored", "placeholder"):
                    r.scored[int(rec["execution_id"])] = rec
                    if kind == "scored":
                        float(rec["reward"])
                elif kind == "excluded":
                    r.excluded.add(int(rec["execution_id"]))
                elif kind == "checkpoint":
                    r.checkpoints[int(rec["step"])] = str(rec["path"])
                elif kind == "checkpoint_deleted":
                    r.checkpoints.pop(int(rec["step"]), None)
                elif kind == "published":
                    r.published[int(rec["version"])] = str(rec["location"])
                elif kind == "trajectory":
                    int(rec["execution_id"]), tree_from_json(rec["tree"]), selected_from_json(rec["selected"])
                else:
                    raise ValueError(f"unknown record kind {kind!r}")
            except (KeyError, ValueError, TypeError) as e:
                what = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
                raise JournalError(f"{path}:{rec['_line']}: bad {kind!r} record ({what})") from e
            r.order.append(rec)
        if not r.config:
            raise JournalError(f"{path}: no config record (not a Gyre run journal)")
        return r

    @property
    def last_time(self) -> float:
        return self.events[-1][0] if self.events else 0.0
