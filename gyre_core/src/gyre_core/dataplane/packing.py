"""The stream packing buffer: ready groups in, micro-steps of a fixed token budget out.

One buffer serves one training step. It is fed by the scheduler's commands and answers with its
events, so the live orchestrator only forwards them:

* ``AssignGroup(step, group_id)`` → :meth:`StreamPackingBuffer.assign`: take the ready group from
  the trajectory buffer, materialise its selected trajectories into weighted rows, add them to the
  row pool (kept longest first), and enqueue every micro-step the pool can fill well.
* :meth:`StreamPackingBuffer.poll_low` → ``BufferLow(step)``: fewer than ``low_watermark`` micro-steps
  wait unclaimed and no pull is outstanding. Call it after each assignment and whenever cells
  claim (the queue's counters are shared, so any thread may ask). The scheduler's ``StartStep``
  counts as the first pull.
* ``CloseStream(step)`` → :meth:`StreamPackingBuffer.close`: all B groups are in; flush the pool and
  close the queue once its micro-steps are enqueued.

Packing: a micro-step holds one pack per data-parallel rank, each at most ``token_budget`` tokens
(trainable and context). The unit of packing is an execution: all its rows go into one pack, so
the objective's execution ratio is complete there and a trainer can take each micro-step's
gradient as it arrives (:func:`gyre_core.dataplane.objective.microstep_objective`); only an
execution whose rows together exceed the budget is split, row by row. A pack holding part of a
split execution carries the execution's other rows in :attr:`Pack.outside`: the trainer runs them
forward only, so the part is clipped on the whole execution's ratio, whichever cell trains it. A pack is filled best-fit
decreasing: start with the longest pooled unit, then repeatedly add the longest that still fits. Before the stream closes a micro-step is only
emitted if every pack is at least ``min_fill`` full -- short auxiliary rows of later groups fill
the gaps -- unless the pool already holds ``max_pending_micro_steps`` worth of tokens, so a pool of
rows that cannot pack well never stalls training. Rows are never split: a row longer than the
budget is refused when its group is assigned.

Failure at assignment (group not ready, a malformed trajectory, an oversized row) raises before
anything is taken or enqueued: the group stays ready in the trajectory buffer.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from gyre_core.dataplane.materialise import TrainingRow, materialise_group
from gyre_core.dataplane.microstep_queue import MicroStepQueue
from gyre_core.dataplane.objective import TokenBatch
from gyre_core.dataplane.trajectory_buffer import TrajectoryBuffer
from gyre_core.interfaces import RoleClass
from gyre_core.scheduler.events import BufferLow
from gyre_core.trajectory import TrajectoryRow

__all__ = ["MicroStep", "Pack", "PackingConfig", "StreamPackingBuffer"]


@dataclass(frozen=True)
class PackingConfig:
    token_budget: int
    """Tokens per data-parallel rank per micro-step; also the longest row accepted."""
    dp_size: int = 1
    min_fill: float = 0.98
    low_watermark: int = 2
    max_pending_micro_steps: float = 4.0
    whole_executions: bool = True
    """Keep all rows of an execution in one pack when they fit the budget together. ``False``
    packs row by row: about 2 points more efficient on long-tailed lengths, at the price of a
    forward-only pass over each split execution's other rows (:attr:`Pack.outside`)."""

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.dp_size < 1:
            raise ValueError(f"token_budget and dp_size must be ≥ 1, got {self.token_budget}, {self.dp_size}")
        if not 0 < self.min_fill <= 1:
            raise ValueError(f"min_fill must lie in (0, 1], got {self.min_fill}")
        if self.low_watermark < 0 or self.max_pending_micro_steps < 1:
            raise ValueError("low_watermark must be ≥ 0 and max_pending_micro_steps ≥ 1")


@dataclass(frozen=True, eq=False)
class Pack:
    """One data-parallel rank's share of a micro-step: whole rows, packed end to end."""

    rows: tuple[TrainingRow, ...]
    n_executions: int
    outside: tuple[TrainingRow, ...] = ()
    """Rows of this pack's split executions that other packs hold: run forward only, without
    gradient, for the whole-execution ratio (not trained here, not counted in :attr:`tokens`)."""

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.rows)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as one flat tensor per field instead of several per row.

        Micro-steps cross process boundaries through the queue, and torch serialises each tensor
        storage separately at a fixed cost; a pack of many short rows would otherwise pay it
        dozens of times.
        """
        return (_unflatten_pack, (*_flatten(self.rows), self.n_executions, *_flatten(self.outside)))

    def to_batch(self) -> TokenBatch:
        """The flat per-token tensors the objective reads (see :class:`TokenBatch`)."""
        rows = self.rows
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        return TokenBatch(
            token_ids=_cat([r.row.token_ids for r in rows], torch.int64),
            cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            loss_weights=_cat([r.loss_weights for r in rows], torch.float32),
            behaviour_logprobs=_cat([r.row.behaviour_logprobs for r in rows], torch.float32),
            advantages=torch.repeat_interleave(
                torch.tensor([r.advantage for r in rows], dtype=torch.float32), lengths
            ),
            exec_slots=torch.repeat_interleave(
                torch.tensor([r.exec_slot for r in rows], dtype=torch.int64), lengths
            ),
            n_executions=self.n_executions,
        )


def _cat(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype)


_RowMeta = tuple[int, int, int, int, float, int]  # execution, group, role, slot, advantage, length


def _row_tensors(r: TrainingRow) -> tuple[torch.Tensor, ...]:
    return (r.row.token_ids, r.row.loss_mask, r.row.behaviour_logprobs, r.row.response_ids, r.loss_weights,
            r.row.temperatures)


def _flatten(rows: tuple[TrainingRow, ...]) -> tuple[tuple[torch.Tensor, ...], tuple[_RowMeta, ...]]:
    if not rows:
        return (), ()
    flat = tuple(torch.cat(column) for column in zip(*map(_row_tensors, rows)))
    meta = tuple((r.row.execution_id, r.row.group_id, int(r.row.role), r.exec_slot, r.advantage, len(r)) for r in rows)
    return flat, meta


def _unflatten(flat: tuple[torch.Tensor, ...], meta: tuple[_RowMeta, ...]) -> tuple[TrainingRow, ...]:
    if not meta:
        return ()
    lengths = [m[-1] for m in meta]
    parts = [torch.split(f, lengths) for f in flat]
    return tuple(
        TrainingRow(TrajectoryRow(eid, gid, RoleClass(role), *(p[i] for p in parts[:4]), temperatures=parts[5][i]),
                    slot, adv, parts[4][i])
        for i, (eid, gid, role, slot, adv, _) in enumerate(meta)
    )


def _unflatten_pack(flat: tuple[torch.Tensor, ...], meta: tuple[_RowMeta, ...], n_executions: int,
                    outside_flat: tuple[torch.Tensor, ...] = (), outside_meta: tuple[_RowMeta, ...] = ()) -> Pack:
    return Pack(_unflatten(flat, meta), n_executions, _unflatten(outside_flat, outside_meta))


@dataclass(frozen=True, eq=False)
class MicroStep:
    """Work a cell claims at once: ``packs[i]`` goes to its data-parallel rank ``i``.

    When the stream closes, the last micro-step may leave some ranks' packs empty: those ranks
    contribute nothing to that micro-step (skip the forward, keep the collective schedule).
    """

    step: int
    index: int
    packs: tuple[Pack, ...]

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.packs)


_Unit = tuple[TrainingRow, ...]
"""Rows that go into one pack together: all rows of one execution (or one row of an execution
too long for a pack)."""


class _RowPool:
    """Packing units sorted by length, for best-fit packing."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []  # (length, arrival), ascending
        self._units: list[_Unit] = []
        self._arrival = itertools.count()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._units)

    def add(self, unit: _Unit) -> None:
        length = sum(len(r) for r in unit)
        key = (length, next(self._arrival))
        i = bisect.bisect(self._keys, key)
        self._keys.insert(i, key)
        self._units.insert(i, unit)
        self.tokens += length

    def fill(self, budget: int) -> list[_Unit]:
        """Remove and return units for one pack: longest first, then the longest that still fits."""
        out: list[_Unit] = []
        room = budget
        while self._keys:
            i = bisect.bisect(self._keys, (room, float("inf"))) - 1
            if i < 0:
                break
            length, _ = self._keys.pop(i)
            out.append(self._units.pop(i))
            room -= length
            self.tokens -= length
        return out


def _units(rows: list[TrainingRow], budget: int, whole: bool = True
           ) -> tuple[list[_Unit], dict[int, tuple[TrainingRow, ...]]]:
    """One unit per execution, so its ratio ``s_e`` is complete in one pack; an execution whose
    rows together exceed the budget (or every execution, with ``whole=False``) is split into one
    unit per row. Also: the rows of each split execution with several rows, by slot."""
    by_exec: dict[int, list[TrainingRow]] = {}
    for r in rows:
        by_exec.setdefault(r.exec_slot, []).append(r)
    out: list[_Unit] = []
    split: dict[int, tuple[TrainingRow, ...]] = {}
    for slot, members in by_exec.items():
        if whole and sum(len(r) for r in members) <= budget:
            out.append(tuple(members))
        else:
            out.extend((r,) for r in members)
            if len(members) > 1:
                split[slot] = tuple(members)
    return out, split


def _pack(rows: tuple[TrainingRow, ...], n_executions: int, split: dict[int, tuple[TrainingRow, ...]]) -> Pack:
    """A pack of ``rows``, carrying the rows of its split executions that it does not hold."""
    held = {id(r) for r in rows}
    slots = dict.fromkeys(r.exec_slot for r in rows if r.exec_slot in split)
    outside = tuple(r for s in slots for r in split[s] if id(r) not in held)
    return Pack(rows, n_executions, outside)


class StreamPackingBuffer:
    """The packing buffer of training step ``step`` (B groups of N executions).

    Thread-safe; the micro-steps go to ``queue``, which training processes share.
    """

    def __init__(
        self,
        step: int,
        trajectories: TrajectoryBuffer,
        queue: MicroStepQueue[MicroStep],
        config: PackingConfig,
        groups_per_step: int,
    ) -> None:
        self.step = step
        self.config = config
        self.groups_per_step = groups_per_step
        self.n_executions = groups_per_step * trajectories.group_size
        self.assigned: list[int] = []
        """Group ids in assignment order (group ``k`` owns execution slots ``k·N .. k·N+N−1``)."""
        self.micro_steps = 0
        self.tokens_emitted = 0
        self.split_executions = 0
        """Executions whose rows did not fit one pack together (their parts carry the others'
        rows for the whole-execution ratio: :attr:`Pack.outside`)."""
        self.outside_tokens = 0
        """Tokens the trainer runs forward only for split executions' ratios (the cost of
        exactness): summed over the packs that carry them."""
        self._split: dict[int, tuple[TrainingRow, ...]] = {}
        self.masked_nonfinite = 0
        """Sampled tokens not trained because their recorded log-prob was not finite."""
        self.rows_over_budget = 0
        """Rows left out because they were longer than ``token_budget`` (one micro-step row)."""
        self._trajectories = trajectories
        self._queue = queue
        self._sent: dict[int, MicroStep] = {}
        """Every micro-step emitted, by index, until the step is over: what a cell that died had
        claimed is streamed again (:meth:`redo`)."""
        self._pool = _RowPool()
        self._pulls = 1  # the scheduler's StartStep pulls the first group
        self._closed = False
        self._lock = threading.Lock()

    @property
    def pending_tokens(self) -> int:
        """Tokens materialised but not yet in a micro-step (waiting for fillers)."""
        return self._pool.tokens

    @property
    def efficiency(self) -> float:
        """Emitted tokens over the token capacity of the emitted micro-steps."""
        capacity = self.micro_steps * self.config.dp_size * self.config.token_budget
        return self.tokens_emitted / capacity if capacity else 0.0

    def assign(self, group_id: int) -> None:
        """Pack ready group ``group_id`` (the scheduler's ``AssignGroup``)."""
        with self._lock:
            if self._closed or len(self.assigned) >= self.groups_per_step:
                raise ValueError(
                    f"step {self.step}: stream already has its {self.groups_per_step} groups"
                )
            group = self._trajectories.peek(group_id)
            n = self._trajectories.group_size
            rows = materialise_group(group, len(self.assigned) * n, self.n_executions)
            # A row longer than a micro-step cannot be trained. The proxy refuses calls that would
            # make one, so this is a last line: such a row is left out (its execution's reward still
            # counts in the group's advantages; its other rows train) and counted, never raised.
            fits = [r for r in rows if len(r) <= self.config.token_budget]
            self.rows_over_budget += len(rows) - len(fits)
            rows = fits
            self._trajectories.take(group_id)
            self.assigned.append(group_id)
            self._pulls = max(0, self._pulls - 1)
            units, split = _units(rows, self.config.token_budget, self.config.whole_executions)
            self.split_executions += len(split)
            self._split.update(split)
            self.masked_nonfinite += sum(r.row.masked_nonfinite for r in rows)
            for u in units:
                self._pool.add(u)
            self._emit(final=False)

    def poll_low(self) -> BufferLow | None:
        """``BufferLow`` for the scheduler if this step needs one more group now, else None."""
        with self._lock:
            if (
                self._closed
                or self._pulls > 0
                or len(self.assigned) >= self.groups_per_step
                or self._queue.unclaimed() >= self.config.low_watermark
            ):
                return None
            self._pulls += 1
            return BufferLow(self.step)

    def close(self) -> None:
        """All B groups are assigned (the scheduler's ``CloseStream``): flush and close the queue."""
        with self._lock:
            if self._closed:
                return
            if len(self.assigned) != self.groups_per_step:
                raise ValueError(
                    f"step {self.step}: closing with {len(self.assigned)} of "
                    f"{self.groups_per_step} groups assigned"
                )
            self._emit(final=True)
            self._closed = True
            self._queue.close()

    def redo(self, indices: Sequence[int], queue: MicroStepQueue[MicroStep]) -> int:
        """Stream micro-steps ``indices`` again, into ``queue``, and close it: a step that lost a
        cell finishes on its survivors, who never counted what the dead cell had claimed.
        Returns their tokens."""
        with self._lock:
            missing = [i for i in indices if i not in self._sent]
            if missing:
                raise ValueError(f"step {self.step}: micro-steps {missing} were never emitted")
            items = [self._sent[i] for i in indices]
        for micro in items:
            queue.put(micro)
        queue.close()
        return sum(m.tokens for m in items)

    def _emit(self, final: bool) -> None:
        c = self.config
        capacity = c.dp_size * c.token_budget
        while len(self._pool):
            forced = final or self._pool.tokens >= c.max_pending_micro_steps * capacity
            if not forced and self._pool.tokens < c.min_fill * capacity:
                return
            packs = [self._pool.fill(c.token_budget) for _ in range(c.dp_size)]
            if not forced and any(sum(len(r) for u in p for r in u) < c.min_fill * c.token_budget for p in packs):
                for p in packs:  # not worth a micro-step yet: wait for more rows
                    for u in p:
                        self._pool.add(u)
                return
            micro = MicroStep(self.step, self.micro_steps,
                              tuple(_pack(tuple(r for u in p for r in u), self.n_executions, self._split)
                                    for p in packs))
            self.outside_tokens += sum(len(r) for p in micro.packs for r in p.outside)
            self._queue.put(micro)
            self._sent[micro.index] = micro
            self.micro_steps += 1
            self.tokens_emitted += micro.tokens
