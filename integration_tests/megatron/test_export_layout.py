"""§5 layout rules without ranks: TP shard merging and the QKV regrouping (fast, no processes)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.megatron

from gyre_megatron.export import _split_qkv, megatron_to_hf, merge_tp  # noqa: E402
from gyre_megatron.model import ModelSpec  # noqa: E402


def _shard_like_megatron(name: str, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return list(full.chunk(tp, dim=1))
    return list(full.chunk(tp, dim=0))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name,shape", [
    ("decoder.layers.0.mlp.linear_fc1.weight", (16, 8)),
    ("decoder.layers.0.mlp.linear_fc2.weight", (8, 8)),
    ("decoder.layers.0.self_attention.linear_proj.weight", (8, 8)),
    ("decoder.layers.0.self_attention.linear_qkv.weight", (32, 8)),
    ("embedding.word_embeddings.weight", (16, 8)),
])
def test_merge_tp_inverts_megatron_sharding(tp: int, name: str, shape: tuple[int, int]) -> None:
    full = torch.randn(shape)
    assert torch.equal(merge_tp(name, _shard_like_megatron(name, full, tp)), full)


def test_qkv_regrouping_matches_query_groups() -> None:
    heads, groups, hd, h = 4, 2, 3, 5
    r = heads // groups
    # build the fused tensor from known q, k, v, group by group
    q = torch.randn(heads * hd, h)
    k = torch.randn(groups * hd, h)
    v = torch.randn(groups * hd, h)
    fused = torch.cat([torch.cat([q[g * r * hd:(g + 1) * r * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]])
                       for g in range(groups)])
    q2, k2, v2 = _split_qkv(fused, heads, groups, hd)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_unknown_parameter_is_refused() -> None:
    with pytest.raises(KeyError):
        megatron_to_hf({"decoder.layers.0.mystery.weight": torch.zeros(1)}, ModelSpec(), 0)
