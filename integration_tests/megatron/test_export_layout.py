"""§5 layout rules without ranks: TP shard merging and the QKV regrouping (fast, no processes)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.megatron

from gyre_megatron.export import _split_qkv, megatron_to_hf  # noqa: E402
from gyre_megatron.model import ModelSpec  # noqa: E402
from gyre_megatron.tp_layout import merge_tp, shard_tp, tp_problems  # noqa: E402


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
    shards = _shard_like_megatron(name, full, tp)
    assert torch.equal(merge_tp(name, shards), full)
    for t, s in enumerate(shards):  # the import cuts each rank's shard as megatron-core holds it
        assert torch.equal(shard_tp(name, full, tp, t), s)


def test_norm_scales_are_replicated_and_uneven_splits_refused() -> None:
    w = torch.randn(8)
    name = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    assert torch.equal(shard_tp(name, w, 2, 1), w) and torch.equal(merge_tp(name, [w, w]), w)
    with pytest.raises(ValueError, match="does not split over 3"):
        shard_tp("decoder.layers.0.self_attention.linear_proj.weight", torch.zeros(8, 8), 3, 0)
    assert tp_problems(ModelSpec(), 2) == []
    assert tp_problems(ModelSpec(num_query_groups=2, num_attention_heads=4), 4) == [
        "num_query_groups 2 is not a multiple of tp 4"]


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
