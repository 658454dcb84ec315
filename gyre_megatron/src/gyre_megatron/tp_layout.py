"""How megatron-core splits each parameter across a stage's tensor-parallel ranks, both ways.

Column-parallel layers split their output dimension (dim 0): ``linear_qkv`` (each rank holds
whole query groups, so the per-group ``[q_0..q_{r-1}, k, v]`` layout survives the split), the
vocabulary-parallel embedding and output layer, and ``linear_fc1``, where each rank holds its own
halves ``[gate_t; up_t]`` of SwiGLU's ``[gate; up]``. Row-parallel layers (``linear_proj``,
``linear_fc2``) split their input dimension (dim 1). Norm scales are replicated.

:func:`shard_tp` cuts a full tensor into rank ``t``'s shard (the HF import), :func:`merge_tp`
joins the shards back (the export); each is the other's inverse.

Mixture-of-experts stages: the router is replicated. Expert parallelism is folded onto the
tensor group (:func:`gyre_megatron.model.transformer_config`): with ``ep == tp`` tensor rank ``t``
holds experts ``t·E/ep .. (t+1)·E/ep − 1`` whole, numbered from 0 locally
(``mlp.experts.local_experts.<j>``); with ``ep == 1`` each expert is split like the dense MLP.
:func:`merge_shards` names the gathered experts by their global index.
"""

from __future__ import annotations

import torch

import re

__all__ = ["expert_offset", "is_expert", "merge_shards", "merge_tp", "shard_tp", "split_tp", "tp_problems"]

_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")


def _replicated(name: str) -> bool:
    return "layernorm" in name or "layer_norm" in name or name.endswith(("norm.weight", "router.weight"))


def is_expert(name: str) -> bool:
    """One expert's weight (``mlp.experts.local_experts.<j>.*``)."""
    return _LOCAL_EXPERT.search(name) is not None


def expert_offset(num_experts: int, ep: int, ep_rank: int) -> int:
    """The global index of expert-parallel rank ``ep_rank``'s first local expert."""
    return ep_rank * (num_experts // ep) if ep > 1 else 0


def global_expert_name(name: str, offset: int) -> str:
    """``name`` with its local expert index moved by ``offset`` (the rank's first expert)."""
    return _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}", name) if offset else name


def split_tp(name: str, tp: int, ep: int) -> int:
    """Over how many ranks parameter ``name`` is tensor-split: experts, with expert parallelism
    folded onto the tensor group, are not split at all."""
    return 1 if ep > 1 and is_expert(name) else tp


def merge_shards(name: str, shards: list[torch.Tensor], ep: int, num_experts: int) -> dict[str, torch.Tensor]:
    """The full tensors of parameter ``name`` gathered from every tensor rank (rank order): one
    merged tensor, or with expert parallelism one whole expert per rank, under global names."""
    if ep > 1 and is_expert(name):
        return {global_expert_name(name, expert_offset(num_experts, ep, r)): s for r, s in enumerate(shards)}
    return {name: merge_tp(name, shards)}


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


def tp_problems(spec: object, tp: int, ep: int = 1) -> list[str]:
    """What keeps a model (a :class:`~gyre_megatron.model.ModelSpec`) from splitting over ``tp``
    tensor and ``ep`` expert ranks: megatron-core divides heads, query groups, FFN width and
    vocabulary evenly, and experts over expert ranks (folded onto the tensor group here)."""
    out = []
    for field in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"):
        v = int(getattr(spec, field))
        if v % tp:
            out.append(f"{field} {v} is not a multiple of tp {tp}")
    experts = int(getattr(spec, "num_experts", 0))
    if ep > 1 and not experts:
        out.append(f"ep {ep} needs a mixture-of-experts model (this one is dense)")
    elif ep not in (1, tp):
        out.append(f"ep {ep}: expert parallelism is folded onto the tensor group, so ep is 1 or tp ({tp})")
    elif experts and experts % ep:
        out.append(f"num_experts {experts} is not a multiple of ep {ep}")
    elif experts and ep == 1 and int(getattr(spec, "expert_ffn_hidden_size", 0)) % tp:
        out.append(f"expert_ffn_hidden_size {getattr(spec, 'expert_ffn_hidden_size')} is not a multiple of tp {tp}")
    return out
