"""bf16 parameters with a float32 optimizer (megatron-core's mixed precision), on a GPU.

The same seeded model in fp32 and bf16, the same GSPO micro-steps: bf16 trains the same objective
(loss within bf16's rounding, gradients pointing the same way), its optimizer keeps float32
master weights and Adam state, and leaving training releases all of it -- the bf16 parameters,
the float32 gradients, Adam's two moments and the master weights -- with nothing left behind. Without CUDA, bf16 is refused at start with the reason
(megatron-core's mixed-precision optimizer wraps only CUDA parameters).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_bf16_without_cuda_is_refused_with_its_reason() -> None:
    from gyre_megatron.launch import RankError, World
    from gyre_megatron.runtime import RankOptions

    with pytest.raises(RankError, match="precision bf16 needs CUDA"):
        World(RankOptions(cells=1, pp=1, precision="bf16"), n_queues=1)


@pytest.fixture(scope="module")
def measured():
    from gyre_megatron.launch import World
    from gyre_megatron.model import ModelSpec
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.testing import feed_in_bursts, make_microsteps

    spec = ModelSpec(hidden_size=64, ffn_hidden_size=128, num_layers=2, vocab_size=128)
    out = {}
    for precision in ("fp32", "bf16"):
        with World(RankOptions(cells=1, pp=1, spec=spec, precision=precision, normalise_by_tokens=False),
                   n_queues=2) as w:
            core = w.ranks_of(0)
            before = w.call(core, "params_numpy")[0]
            tk = w.submit(core, "stream_grads_hf", 0)
            feed_in_bursts(w.queues[0], make_microsteps(4, rows=2, seq_len=16, vocab=128, seed=4), burst=4, gap_s=0)
            streamed = w.wait(tk, 120)[0]
            tk = w.submit(core, "run_step", 0, 1)
            feed_in_bursts(w.queues[1], make_microsteps(4, rows=2, seq_len=16, vocab=128, seed=4), burst=4, gap_s=0)
            stepped = w.wait(tk, 120)[0]
            after = w.call(core, "params_numpy")[0]
            left = w.call(core, "leave_training")[0]
            back = w.call(core, "enter_training")[0]
            again = w.call(core, "params_numpy")[0]
        n_params = sum(v.size for v in before.values())
        out[precision] = {"streamed": streamed, "stepped": stepped, "before": before, "after": after,
                          "left": left, "back": back, "again": again, "n": n_params}
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_bf16_trains_the_same_objective(measured) -> None:
    f, b = measured["fp32"]["streamed"], measured["bf16"]["streamed"]
    lf, lb = f["objective"]["loss"], b["objective"]["loss"]
    assert abs(lf) > 0 and abs(lb - lf) <= 0.02 * abs(lf), (lf, lb)
    gf = np.concatenate([v.ravel() for _, v in sorted(f["grads"].items())]).astype(np.float64)
    gb = np.concatenate([v.ravel() for _, v in sorted(b["grads"].items())]).astype(np.float64)
    cos = float(gf @ gb / (np.linalg.norm(gf) * np.linalg.norm(gb)))
    assert cos > 0.99, cos


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_bf16_parameters_move_by_a_float32_update(measured) -> None:
    """bf16 parameters hold the float32 master weights rounded: an update smaller than bf16's
    spacing still accumulates in the master copy, and both runs move the weights alike."""
    m = measured["bf16"]
    assert m["stepped"]["update_ok"]
    moved = {k: float(np.abs(m["after"][k] - m["before"][k]).max()) for k in m["before"]}
    assert max(moved.values()) > 0
    f = measured["fp32"]
    for k in m["before"]:
        df, db = f["after"][k] - f["before"][k], m["after"][k] - m["before"][k]
        # Adam's first step moves each weight by about lr·sign(g): same direction in both runs
        agree = float(np.mean(np.sign(df) == np.sign(db)))
        assert agree > 0.8 or float(np.abs(df).max()) < 1e-6, (k, agree)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_leaving_training_releases_the_master_weights_too(measured) -> None:
    for precision, per_param in (("fp32", 4 + 4 + 8), ("bf16", 2 + 4 + 8 + 4)):
        m = measured[precision]
        # parameters, float32 grad buffer, Adam's moments (+ bf16: float32 master weights)
        assert m["left"]["released_bytes"] >= per_param * m["n"], (precision, m["left"], m["n"])
        assert m["left"]["remaining_bytes"] == 0
        assert m["back"]["restored_bytes"] == m["left"]["released_bytes"]
        assert all(np.array_equal(m["again"][k], m["after"][k]) for k in m["after"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_bf16_training_publishes_bf16(tmp_path, family: str) -> None:
    """bf16 training serves bf16: the core's part of a publication is registered in the
    parameters' dtype (half a float32 export's bytes), pulled whole by an engine's puller, and a
    written version says bfloat16 in its config; on a Qwen3-layout model (q/k norms, a head size
    of its own) and on its mixture of experts (4 experts, 2 per token: router and experts
    published under the checkpoint's names)."""
    import json

    from gyre_core.published_weights import WeightPuller
    from gyre_megatron.export import gather_serving_tensors, publish, write
    from gyre_core.interfaces import PublicationOptions
    from gyre_megatron.launch import World
    from gyre_megatron.model import ModelSpec
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.testing import read_weights

    experts = {"num_experts": 4, "experts_per_token": 2, "expert_ffn_hidden_size": 64} if family == "qwen3_moe" else {}
    spec = ModelSpec(hidden_size=64, ffn_hidden_size=128, num_layers=2, vocab_size=128, family=family,
                     qkv_bias=False, qk_norm=True, head_dim=32, **experts)
    with World(RankOptions(cells=1, pp=1, spec=spec, precision="bf16"), n_queues=1) as w:
        ref = publish(w, PublicationOptions(transport="mooncake"), 1)
        puller = WeightPuller("127.0.0.1")
        try:
            pulled = {n: t.clone() for n, t in puller.pull(ref.location).tensors()}
        finally:
            puller.close()
        params = gather_serving_tensors(w)  # the same parameters, as float32
        folder = write(w, 1, tmp_path / "v1").location
    assert set(pulled) == set(params) and any(n.endswith("q_norm.weight") for n in pulled)
    assert any(n.endswith("mlp.experts.3.down_proj.weight") for n in pulled) == bool(experts)
    assert all(t.dtype == torch.bfloat16 for t in pulled.values())
    assert all(torch.equal(pulled[n].float(), params[n]) for n in params)
    assert json.loads((tmp_path / "v1" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in read_weights(folder).values())
