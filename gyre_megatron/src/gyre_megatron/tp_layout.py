"""How megatron-core splits each parameter across a stage's tensor-parallel ranks, both ways.

Column-parallel layers split their output dimension (dim 0): ``linear_qkv`` (each rank holds
whole query groups, so the per-group ``[q_0..q_{r-1}, k, v]`` layout survives the split), the
vocabulary-parallel embedding and output layer, and ``linear_fc1``, where each rank holds its own
halves ``[gate_t; up_t]`` of SwiGLU's ``[gate; up]``. Row-parallel layers (``linear_proj``,
``linear_fc2``) split their input dimension (dim 1). Norm scales are replicated.

:func:`shard_tp` cuts a full tensor into rank ``t``'s shard (the HF import), :func:`merge_tp`
joins the shards back (the export); each is the other's inverse.
"""

from __future__ import annotations

import torch

__all__ = ["merge_tp", "shard_tp", "tp_problems"]


def _replicated(name: str) -> bool:
    return "layernorm" in name or "layer_norm" in name or name.endswith("norm.weight")


def _row_parallel(name: str) -> bool:
    return name.endswith(("linear_proj.weight", "linear_fc2.weight"))


def merge_tp(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """One full tensor from its tensor-parallel shards (rank order)."""
    if len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):  # each rank: [gate_t; up_t]
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return torch.cat([torch.cat(gates), torch.cat(ups)])
    if _row_parallel(name):
        return torch.cat(shards, dim=1)
    if _replicated(name):
        return shards[0]
    return torch.cat(shards, dim=0)  # column-parallel (qkv groups, vocabulary)


def shard_tp(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the full tensor ``full`` of parameter ``name`` (of ``tp``)."""
    if tp == 1 or _replicated(name):
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    dim = 1 if _row_parallel(name) else 0
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: dimension {dim} of {tuple(full.shape)} does not split over {tp} ranks")
    return full.chunk(tp, dim=dim)[rank].contiguous()


def tp_problems(spec: object, tp: int) -> list[str]:
    """What keeps a model (a :class:`~gyre_megatron.model.ModelSpec`) from splitting over ``tp``
    ranks: megatron-core divides heads, query groups, FFN width and vocabulary evenly."""
    out = []
    for field in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"):
        v = int(getattr(spec, field))
        if v % tp:
            out.append(f"{field} {v} is not a multiple of tp {tp}")
    return out
