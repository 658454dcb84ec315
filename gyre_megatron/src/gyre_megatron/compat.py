"""One API over the megatron-core releases Gyre supports (0.13.x to 0.16.x).

The streaming schedule is written against megatron-core's own building blocks; their signatures
drifted between releases (see ``notes/megatron-on-cpu.md``):

* 0.13 has no ``P2PCommunicator`` -- module-level P2P functions take ``config`` and use the global
  pipeline group; ``forward_step`` has no ``cp_group_size``/``is_last_stage``.
* 0.14+ has ``P2PCommunicator(pp_group, config)``; 0.15+ ``forward_step(..., cp_group_size,
  is_last_stage)``.

Everything version-specific is decided here, once, by inspecting what the installed release
offers, so the schedule itself is identical across versions.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

__all__ = ["P2P", "backward_step", "forward_step", "mcore_version", "stock_1f1b"]


def mcore_version() -> str:
    from megatron.core import package_info

    return str(package_info.__version__)


class P2P:
    """Pipeline send/recv between adjacent stages of ``pp_group`` (a cell's pipeline)."""

    def __init__(self, pp_group: torch.distributed.ProcessGroup, config: Any) -> None:
        from megatron.core.pipeline_parallel import p2p_communication as p2p

        self.config = config
        self.pp_group = pp_group
        self.is_first = pp_group.rank() == 0
        self.is_last = pp_group.rank() == pp_group.size() - 1
        cls = getattr(p2p, "P2PCommunicator", None)
        if cls is not None:
            self._comm: Any = cls(pp_group=pp_group, config=config)
            self._legacy = None
        else:  # 0.13: module functions on the global pipeline group
            self._comm = None
            self._legacy = p2p

    def _recv(self, name: str, shapes: Any, flag: bool) -> Any:
        if self._comm is not None:
            return getattr(self._comm, name)(shapes, flag)
        return getattr(self._legacy, name)(_one(shapes), self.config, flag)

    def _send(self, name: str, tensor: Any, flag: bool) -> Any:
        if self._comm is not None:
            return getattr(self._comm, name)(tensor, flag)
        return getattr(self._legacy, name)(tensor, self.config, flag)

    def _send_recv(self, name: str, tensor: Any, shapes: Any, flag: bool) -> Any:
        if self._comm is not None:
            return getattr(self._comm, name)(tensor, shapes, flag)
        return getattr(self._legacy, name)(tensor, _one(shapes), self.config, flag)

    def recv_forward(self, shapes: Any) -> Any:
        return self._recv("recv_forward", shapes, self.is_first)

    def recv_backward(self, shapes: Any) -> Any:
        return self._recv("recv_backward", shapes, self.is_last)

    def send_forward(self, out: Any) -> None:
        self._send("send_forward", out, self.is_last)

    def send_backward(self, grad: Any) -> None:
        self._send("send_backward", grad, self.is_first)

    def send_forward_recv_backward(self, out: Any, shapes: Any) -> Any:
        return self._send_recv("send_forward_recv_backward", out, shapes, self.is_last)

    def send_backward_recv_forward(self, grad: Any, shapes: Any) -> Any:
        return self._send_recv("send_backward_recv_forward", grad, shapes, self.is_first)


def _one(shapes: Any) -> Any:
    """0.13's functions take one shape, later releases a list of shapes."""
    return shapes[0] if isinstance(shapes, list) else shapes


def _params(fn: Callable[..., Any]) -> set[str]:
    return set(inspect.signature(fn).parameters)


def forward_step(
    forward_step_func: Callable[..., Any],
    data_iterator: Any,
    model: torch.nn.Module,
    input_tensor: Any,
    forward_data_store: list[Any],
    config: Any,
    is_last_stage: bool,
    current_microbatch: int,
) -> tuple[Any, Any]:
    """megatron-core's ``forward_step`` in per-token-loss mode (``num_microbatches`` unused: 1)."""
    from megatron.core.pipeline_parallel import schedules

    kwargs: dict[str, Any] = dict(current_microbatch=current_microbatch)
    names = _params(schedules.forward_step)
    if "cp_group_size" in names:
        kwargs["cp_group_size"] = 1
    if "is_last_stage" in names:
        kwargs["is_last_stage"] = is_last_stage
    out = schedules.forward_step(
        forward_step_func, data_iterator, model, 1, input_tensor, forward_data_store, config, **kwargs
    )
    return out if isinstance(out, tuple) else (out, torch.zeros([], dtype=torch.int))


def backward_step(input_tensor: Any, output_tensor: Any, output_tensor_grad: Any, model_type: Any, config: Any) -> Any:
    from megatron.core.pipeline_parallel import schedules

    return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config)


def stock_1f1b(
    forward_step_func: Callable[..., Any],
    items: Sequence[Any],
    model: torch.nn.Module,
    seq_length: int,
    micro_batch_size: int,
) -> list[Any]:
    """Run megatron-core's own non-interleaved 1F1B over ``items`` (the reference schedule)."""
    from megatron.core.pipeline_parallel import schedules

    return schedules.forward_backward_pipelining_without_interleaving(
        forward_step_func=forward_step_func,
        data_iterator=iter(list(items)),
        model=[model],
        num_microbatches=len(items),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
