"""The pausable streaming 1F1B schedule: megatron-core's 1F1B for a stream of unknown length.

Stock 1F1B needs ``num_microbatches`` up front because it decides, before each communication,
whether another micro-batch follows (``send_backward_recv_forward`` vs ``send_backward``). Here
that decision is taken from a *control message* read just before the communication that depends
on it. The cell's first stage (the leader) claims micro-steps from the data plane's queue and
broadcasts one message per forward slot to every stage of the cell over a gloo *side group*:

* ``micro`` (with the item, so the last stage has its labels): one more micro-batch;
* ``pause``: nothing available yet, the stream is open. Sent every ``heartbeat_s`` while the
  leader waits, so a pause of any length never blocks anyone on the data (pipeline) group and
  never trips a process-group timeout; followers simply read the next message;
* ``end``: stream closed and queue empty: drain.

For every sequence of messages each stage performs exactly the operations stock 1F1B performs for
that many micro-batches, in the same order (warm-up forwards, steady 1F1B, cool-down backwards),
so there is one start-up and one drain per batch. Every stage is paused at the same logical point
(just before consuming message ``k``), after all communication for earlier micro-batches has
completed. Losses are per token (``calculate_per_token_loss``): no micro-batch count is needed.

That pause point is also where a micro-step that holds part of a split execution gets its
whole-execution ratio: its item's ``outside`` rows (the execution's other parts) run forward only,
without gradient, through every stage before the item itself, and the last stage keeps their
log-ratio sums in the item for its loss. All earlier communication has completed there and every
stage knows the item, so this forward-only pass needs no extra coordination.
"""

from __future__ import annotations

import queue as queue_mod
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from gyre_megatron import compat, wire

__all__ = ["ControlChannel", "StreamResult", "run_streaming_1f1b"]

Claim = Callable[[float], Any]
"""``claim(timeout)``: next item, ``None`` at end of stream, :class:`queue.Empty` if none yet."""


class ControlChannel:
    """The leader's per-slot decisions, broadcast to the cell's stages over the side group."""

    def __init__(self, group: dist.ProcessGroup, leader: int, claim: Claim | None, heartbeat_s: float = 1.0) -> None:
        self.group = group
        self.leader = leader
        self.claim = claim
        self.is_leader = dist.get_rank() == leader
        self.heartbeat_s = heartbeat_s
        self.pauses = 0
        self.paused_s = 0.0
        self._pending: tuple[list[Any], list[torch.Tensor]] | None = None
        self.claimed: list[int] = []
        """Indices (``item["index"]`` when present) of the micro-steps this cell claimed."""
        self.on_claim: Callable[[int], None] | None = None
        """Called with each claimed index before the item is used (claim ledger for re-queues)."""

    FRAME = 1 << 16
    """Bytes of one control frame: a message that fits costs one broadcast (most do); a longer
    one a second broadcast of exactly its size."""

    def _bcast(self, msg: Any) -> Any:
        if self.is_leader:
            # The leader does not wait for its broadcast to complete: it only has to finish
            # before the next one (its frame is kept alive until then), which takes the
            # control channel off the pipeline's critical path.
            self.flush()
            data = wire.pack(msg)  # the control plane's allow-listed format: no pickle between ranks
            frame = torch.zeros(self.FRAME + 8, dtype=torch.uint8)
            frame[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
            head = data[: self.FRAME]
            frame[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
            works = [dist.broadcast(frame, src=self.leader, group=self.group, async_op=True)]
            keep = [frame]
            if len(data) > self.FRAME:
                rest = torch.frombuffer(bytearray(data[self.FRAME :]), dtype=torch.uint8)
                works.append(dist.broadcast(rest, src=self.leader, group=self.group, async_op=True))
                keep.append(rest)
            self._pending = (works, keep)
            return msg
        frame = torch.zeros(self.FRAME + 8, dtype=torch.uint8)
        dist.broadcast(frame, src=self.leader, group=self.group)
        n = int(frame[:8].view(torch.int64)[0])
        if n <= self.FRAME:
            payload = frame[8 : 8 + n].numpy().tobytes()
        else:
            rest = torch.zeros(n - self.FRAME, dtype=torch.uint8)
            dist.broadcast(rest, src=self.leader, group=self.group)
            payload = frame[8:].numpy().tobytes() + rest.numpy().tobytes()
        return wire.unpack(payload)

    def flush(self) -> None:
        """Leader: wait until the last message has left (before reusing the group)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            for w in pending[0]:
                w.wait()

    def broadcast(self, obj: Any) -> Any:
        """A one-off value from the leader to the whole cell (e.g. a join decision)."""
        out = self._bcast(obj)
        self.flush()
        return out

    def next_item(self) -> Any:
        """Block (pausing as long as needed) until the next item or ``None`` at end of stream."""
        t0 = None
        while True:
            if self.is_leader:
                assert self.claim is not None
                try:
                    item = self.claim(self.heartbeat_s)
                    msg: tuple[str, Any] = ("micro", item) if item is not None else ("end", None)
                    if item is not None and isinstance(item, dict) and "index" in item:
                        self.claimed.append(int(item["index"]))
                        if self.on_claim is not None:
                            self.on_claim(int(item["index"]))
                except queue_mod.Empty:
                    msg = ("pause", None)
                self._bcast(msg)
            else:
                msg = self._bcast(None)
            if msg[0] == "pause":
                if t0 is None:
                    t0 = time.monotonic()
                    self.pauses += 1
                continue
            if t0 is not None:
                self.paused_s += time.monotonic() - t0
            return msg[1]


@dataclass
class StreamResult:
    micro_steps: int = 0
    tokens: int = 0
    losses: list[Any] = field(default_factory=list)
    """The loss function's third output per micro-step, on the last stage (in order)."""
    pauses: int = 0
    paused_s: float = 0.0
    outside_tokens: int = 0
    """Tokens run forward only for split executions' ratios."""
    outside_s: float = 0.0
    reference_s: float = 0.0
    """Seconds of forward-only passes through the reference policy (a KL penalty)."""


def run_streaming_1f1b(
    model: torch.nn.Module,
    config: Any,
    p2p: compat.P2P,
    control: ControlChannel,
    forward_step_func: Callable[..., Any],
    shape_of: Callable[[Any], list[tuple[int, ...]]],
    reference: Callable[[], Any] | None = None,
) -> StreamResult:
    """Forward and backward every micro-step of the stream through this pipeline stage.

    ``reference``: a context manager factory under which this stage's parameters are the
    reference policy's; an item marked ``reference_pass`` runs forward once through it first
    (every stage, no gradient), and the last stage hands its per-token log-probs to the item.

    ``shape_of(item)`` is the activation shape sent between stages for that item; every stage
    knows each item, so shapes need no extra communication even when lengths vary.
    Gradients accumulate in the model's (DDP) grad buffers; nothing is reduced here.
    """
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor
    from megatron.core.utils import get_model_type

    model_type = get_model_type(model)
    warmup = p2p.pp_group.size() - p2p.pp_group.rank() - 1
    inputs: deque[Any] = deque()
    outputs: deque[Any] = deque()
    shapes: deque[Any] = deque()
    store: list[Any] = []
    res = StreamResult()
    total = torch.zeros([], dtype=torch.int64)

    def forward(item: Any, x: Any) -> Any:
        nonlocal total
        y, n = compat.forward_step(
            forward_step_func, iter([item]), model, x, store, config, p2p.is_last, res.micro_steps
        )
        total += n.detach().to(device="cpu", dtype=torch.int64)  # a count on the host
        res.micro_steps += 1
        return y

    def ratio_pass(item: dict[str, Any]) -> None:
        """Forward-only over the item's ``outside`` rows; their sums go into the item (last stage)."""
        t0 = time.monotonic()
        sums = None
        for chunk in item["outside"]:
            x = p2p.recv_forward(shape_of(chunk))
            kept: list[Any] = []
            with torch.no_grad():
                y, _ = compat.forward_step(forward_step_func, iter([chunk]), model, x, kept, config, p2p.is_last, 0)
            p2p.send_forward(y)
            res.outside_tokens += int(chunk["tokens"].numel())
            if p2p.is_last:
                part = kept[-1]["ratio_sums"]
                sums = part if sums is None else sums + part
        if sums is not None:
            item["outside_sums"] = sums
        res.outside_s += time.monotonic() - t0

    def reference_pass(item: dict[str, Any]) -> None:
        """Forward-only through the reference weights; ``ref_logprobs`` go into the item (last stage)."""
        if reference is None:
            raise RuntimeError("a micro-step asks for the reference policy, and this rank holds none")
        t0 = time.monotonic()
        probe = {k: v for k, v in item.items() if k not in ("outside", "reference_pass", "outside_sums")}
        probe["reference_only"] = True
        x = p2p.recv_forward(shape_of(item))
        kept: list[Any] = []
        with torch.no_grad(), reference():
            y, _ = compat.forward_step(forward_step_func, iter([probe]), model, x, kept, config, p2p.is_last, 0)
        p2p.send_forward(y)
        if p2p.is_last:
            item["ref_logprobs"] = kept[-1]["ref_logprobs"]
        res.reference_s += time.monotonic() - t0

    def take() -> Any:
        item = control.next_item()
        if isinstance(item, dict) and item.get("outside"):
            ratio_pass(item)
        if isinstance(item, dict) and item.get("reference_pass"):
            reference_pass(item)
        return item

    def backward(grad: Any) -> Any:
        x0, y0 = inputs.popleft(), outputs.popleft()
        shapes.popleft()
        return compat.backward_step(x0, y0, grad, model_type, config)

    ended = False
    while len(outputs) < warmup:  # warm-up forwards
        item = take()
        if item is None:
            ended = True
            break
        x = p2p.recv_forward(shape_of(item))
        y = forward(item, x)
        p2p.send_forward(y)
        inputs.append(x), outputs.append(y), shapes.append(shape_of(item))
        deallocate_output_tensor(y[0] if isinstance(y, list) else y, config.deallocate_pipeline_outputs)
    if not ended:
        item = take()
        if item is None:
            ended = True
        else:
            x = p2p.recv_forward(shape_of(item))
    while not ended:  # steady 1F1B
        y = forward(item, x)
        inputs.append(x), outputs.append(y), shapes.append(shape_of(item))
        grad = p2p.send_forward_recv_backward(y, shapes[0])
        deallocate_output_tensor(y[0] if isinstance(y, list) else y, config.deallocate_pipeline_outputs)
        gin = backward(grad)
        item = take()  # the pause point
        if item is None:
            p2p.send_backward(gin)
            ended = True
        else:
            x = p2p.send_backward_recv_forward(gin, shape_of(item))
    while outputs:  # cool-down backwards (the drain)
        grad = p2p.recv_backward(shapes[0])
        p2p.send_backward(backward(grad))
    control.flush()
    res.tokens = int(total)
    res.losses = store
    res.pauses, res.paused_s = control.pauses, control.paused_s
    return res
