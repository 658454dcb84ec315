"""The trajectory buffer: scored executions held by rollout group until the group is ready.

A group is *ready* once it holds N valid rewards (the first N to arrive); only then can
group-relative advantages be formed. What happens when it cannot get there is decided once, by the
scheduler (:mod:`gyre_core.scheduler.state_machine`, :class:`~gyre_core.config.ShortGroupRule`); the
buffer carries out its commands, so the two never disagree about a group:

* **Oversampling** (N' > N executions per group): once N are valid the group is ready and every
  other member becomes *surplus*. The scheduler cancels the running ones; here a surplus
  execution is recorded once in :attr:`TrajectoryBuffer.surplus`, and its late reward (if any) is
  ignored rather than added to the group.
* **Short group** (excluded members leave fewer than N possible valid rewards):
  ``ShortGroupRule.FILTER`` (the default) makes the group ready with the valid rewards it holds once
  all its executions have terminated, or *empty* (nothing to train, advantages over nothing) with
  fewer than the minimum: the scheduler's ``GroupFiltered``, fed to :meth:`TrajectoryBuffer.filter`.
  ``ShortGroupRule.TOP_UP`` keeps the group, its slot and its policy version, and waits for the
  missing executions of the same query (the scheduler's ``DispatchGroup(refill_of=...)``, fed to
  :meth:`TrajectoryBuffer.dispatch`); ``ShortGroupRule.DROP`` discards the group and everything it
  holds on the scheduler's ``GroupDropped`` (:meth:`TrajectoryBuffer.drop`).

Bad input (an unknown or foreign execution, a duplicate, a reward outside the range or NaN, a
selection that does not fit its tree) raises before anything is stored.
"""

from __future__ import annotations

import enum
import heapq
import threading
from dataclasses import dataclass, field

from gyre_core.dataplane.assessment import RewardRange
from gyre_core.dataplane.objective import group_advantages
from gyre_core.scheduler.events import DispatchGroup, GroupDropped, GroupFiltered
from gyre_core.trajectory import SelectedTrajectory, TrajectoryTree

__all__ = ["GroupNotReady", "ReadyGroup", "ScoredExecution", "TrajectoryBuffer"]


class GroupNotReady(LookupError):
    """A group was asked for training before it held N valid rewards (or after it left)."""


@dataclass(frozen=True)
class ScoredExecution:
    """A terminated execution with a valid reward, its trajectory tree and its selected leaves.

    The zero-reward placeholder of a complete failure (:meth:`placeholder`) has no tree and no
    selected trajectory: it has nothing the policy generated, so it contributes no token and no
    gradient, but its zero counts among the group's N rewards and so shapes its peers' advantages.
    """

    execution_id: int
    group_id: int
    reward: float
    tree: TrajectoryTree | None
    selected: tuple[SelectedTrajectory, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "selected", tuple(self.selected))
        if self.tree is None:
            if self.selected:
                raise ValueError(f"execution {self.execution_id}: selected trajectories without a tree")
            return
        if self.tree.execution_id != self.execution_id:
            raise ValueError(
                f"execution {self.execution_id}: tree belongs to execution {self.tree.execution_id}"
            )
        leaves = set(self.tree.leaves())
        for s in self.selected:
            if s.leaf_id not in leaves:
                raise ValueError(f"execution {self.execution_id}: selected node {s.leaf_id} is not a leaf")
        if len({s.leaf_id for s in self.selected}) != len(self.selected):
            raise ValueError(f"execution {self.execution_id}: a leaf is selected twice")

    @classmethod
    def placeholder(cls, execution_id: int, group_id: int) -> ScoredExecution:
        return cls(execution_id, group_id, 0.0, None, ())


@dataclass(frozen=True)
class ReadyGroup:
    """A ready group: its executions (arrival order), their advantages, its policy version.

    N executions, or fewer for a filtered group; none for an empty one (it trains nothing).
    """

    group_id: int
    version: int
    executions: tuple[ScoredExecution, ...]
    advantages: tuple[float, ...]


class _Member(str, enum.Enum):
    PENDING = "pending"
    VALID = "valid"
    EXCLUDED = "excluded"
    SURPLUS = "surplus"


@dataclass
class _Group:
    version: int
    members: dict[int, _Member]
    valid: list[ScoredExecution] = field(default_factory=list)
    ready: bool = False
    empty: bool = False


class TrajectoryBuffer:
    """Scored executions keyed by rollout group, each group with its policy version.

    Thread-safe: the orchestrator's assessment path and the packing buffer may call it from
    different threads.
    """

    def __init__(
        self,
        group_size: int,
        reward_range: RewardRange = RewardRange(),
        advantage_eps: float = 1e-6,
    ) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be ≥ 1, got {group_size}")
        self.group_size = group_size
        self.reward_range = reward_range
        self.advantage_eps = advantage_eps
        self.surplus: set[int] = set()
        """Executions that became surplus when their group filled (each recorded once)."""
        self.dropped: set[int] = set()
        """Groups dropped under ``ShortGroupRule.DROP``."""
        self._groups: dict[int, _Group] = {}
        self._member_of: dict[int, int] = {}
        self._gone: set[int] = set()  # taken or dropped groups: late news about them is ignored
        self._ready: list[tuple[int, int, int]] = []  # heap of (version, ready order, group id)
        self._ready_count = 0
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- inputs

    def dispatch(self, cmd: DispatchGroup) -> None:
        """Open a group admitted at policy ``cmd.version``, or add a short group's top-up members."""
        with self._lock:
            clash = [e for e in cmd.execution_ids if e in self._member_of]
            if clash:
                raise ValueError(f"group {cmd.group_id}: executions {clash} already belong to a group")
            if len(set(cmd.execution_ids)) != len(cmd.execution_ids):
                raise ValueError(f"group {cmd.group_id}: an execution is listed twice")
            if cmd.refill_of is None:
                if cmd.group_id in self._groups or cmd.group_id in self._gone:
                    raise ValueError(f"group {cmd.group_id} dispatched twice")
                g = self._groups[cmd.group_id] = _Group(cmd.version, {})
            else:
                g = self._open(cmd.refill_of)
                if cmd.group_id != cmd.refill_of or cmd.version != g.version:
                    raise ValueError(f"top-up of group {cmd.refill_of} must keep its id and version")
            for eid in cmd.execution_ids:
                g.members[eid] = _Member.PENDING
                self._member_of[eid] = cmd.group_id

    def put(self, scored: ScoredExecution) -> bool:
        """Store a valid reward; True if it was used (False: surplus, or its group is gone)."""
        with self._lock:
            gid = self._member_of.get(scored.execution_id)
            if gid is None:
                raise ValueError(f"execution {scored.execution_id} belongs to no dispatched group")
            if gid != scored.group_id:
                raise ValueError(
                    f"execution {scored.execution_id} belongs to group {gid}, not {scored.group_id}"
                )
            self.reward_range.check(scored.reward, f"execution {scored.execution_id}")
            if gid in self._gone:
                return False
            g = self._groups[gid]
            state = g.members[scored.execution_id]
            if state is _Member.SURPLUS:
                return False
            if state is not _Member.PENDING:
                raise ValueError(f"execution {scored.execution_id} is already {state.value}")
            g.members[scored.execution_id] = _Member.VALID
            g.valid.append(scored)
            if len(g.valid) == self.group_size:
                self._make_ready(gid, g)
            return True

    def exclude(self, execution_id: int) -> None:
        """The execution will never have a valid reward (budget expired, overall timeout, cancelled).

        What becomes of its group is the scheduler's decision (:meth:`filter`, :meth:`drop`).
        """
        with self._lock:
            gid = self._member_of.get(execution_id)
            if gid is None:
                raise ValueError(f"execution {execution_id} belongs to no dispatched group")
            if gid in self._gone:
                return
            g = self._groups[gid]
            state = g.members[execution_id]
            if state is _Member.SURPLUS:
                return
            if state is not _Member.PENDING:
                raise ValueError(f"execution {execution_id} is already {state.value}")
            g.members[execution_id] = _Member.EXCLUDED

    def filter(self, cmd: GroupFiltered) -> None:
        """The scheduler's ``GroupFiltered``: the group is ready with what it holds (or empty).

        Members never reported valid are excluded (overall timeouts reach the scheduler directly).
        Raises if the buffer holds a different number of valid rewards than the scheduler counted:
        the driver fed the two different histories.
        """
        with self._lock:
            g = self._open(cmd.group_id)
            if g.ready:
                raise ValueError(f"group {cmd.group_id} is already ready")
            if len(g.valid) != cmd.valid:
                raise ValueError(
                    f"group {cmd.group_id}: the scheduler counted {cmd.valid} valid rewards, "
                    f"the buffer holds {len(g.valid)}"
                )
            for eid, m in g.members.items():
                if m is _Member.PENDING:
                    g.members[eid] = _Member.EXCLUDED
            g.empty = cmd.empty
            self._make_ready(cmd.group_id, g)

    def drop(self, cmd: GroupDropped) -> None:
        """The scheduler's ``GroupDropped``: discard the group and everything it holds."""
        with self._lock:
            if cmd.group_id in self._gone:
                return
            self._open(cmd.group_id)
            del self._groups[cmd.group_id]
            self._gone.add(cmd.group_id)
            self.dropped.add(cmd.group_id)

    # ----------------------------------------------------------------- outputs

    def ready(self) -> list[int]:
        """Ready group ids, oldest policy version first (then in the order they became ready)."""
        with self._lock:
            return [gid for _, _, gid in sorted(self._ready)]

    def oldest_ready(self) -> int | None:
        with self._lock:
            return self._ready[0][2] if self._ready else None

    def peek(self, group_id: int) -> ReadyGroup:
        """The ready group's contents, without taking it (a failed materialisation leaves it here)."""
        with self._lock:
            return self._peek(group_id)

    def take(self, group_id: int) -> ReadyGroup:
        """Remove a ready group for training."""
        with self._lock:
            out = self._peek(group_id)
            del self._groups[group_id]
            self._gone.add(group_id)
            self._ready = [r for r in self._ready if r[2] != group_id]
            heapq.heapify(self._ready)
            return out

    # ----------------------------------------------------------------- internals

    def _open(self, group_id: int) -> _Group:
        g = self._groups.get(group_id)
        if g is None:
            raise GroupNotReady(f"group {group_id} is not in the buffer")
        return g

    def _peek(self, group_id: int) -> ReadyGroup:
        g = self._open(group_id)
        if not g.ready:
            missing = sorted(e for e, m in g.members.items() if m is _Member.PENDING)
            raise GroupNotReady(
                f"group {group_id} holds {len(g.valid)} of {self.group_size} valid rewards "
                f"(missing executions: {missing})"
            )
        if g.empty:
            return ReadyGroup(group_id, g.version, (), ())
        advantages = group_advantages([s.reward for s in g.valid], self.advantage_eps)
        return ReadyGroup(group_id, g.version, tuple(g.valid), tuple(advantages))

    def _make_ready(self, gid: int, g: _Group) -> None:
        g.ready = True
        for eid, m in g.members.items():
            if m is _Member.PENDING:
                g.members[eid] = _Member.SURPLUS
                self.surplus.add(eid)
        heapq.heappush(self._ready, (g.version, self._ready_count, gid))
        self._ready_count += 1
