"""Tensor and expert parallelism inside a cell: megatron-core's column/row-parallel layers and
its MoE layers over gloo.

One HF checkpoint per family (GQA, untied, random biases and norm scales; built locally) starts
every layout: TP 1 × PP 1 (the reference), then for Qwen2 TP 2 × PP 1 and TP 2 × PP 2, and for
Qwen3-MoE (per-head q/k norms, 6 experts, 2 per token) TP 2 with each expert split over the
tensor ranks (EP 1), TP 2 with EP 2 (each rank holds 3 whole experts) and TP 2 × PP 2 × EP 2 —
sequence-parallel, as megatron-core trains MoE with TP. On the same GSPO micro-steps,
streamed through the cell's queue as the live run streams them, each layout gives the reference's
loss and gradients (merged from the shards, under HF names), the same gradient norm (a norm scale
replicated on both shards counts once), and after an update the same weights. Exporting the
imported shards gives back the checkpoint's tensors exactly. A second cell of TP 2 joins a step
(Mooncake pulls shard by shard; the prefix groups reduce each shard with its twin) and the
update equals the single cell's.

Tolerance: float32 sums in a different order (tensor-parallel all-reduces): 1e-5 of the largest
gradient entry, 1e-6 relative on the loss, 1e-6 absolute on the updated weights.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(600)]
transformers = pytest.importorskip("transformers")

LAYOUTS = {"qwen2": [(1, 1, 1), (2, 1, 1), (2, 2, 1)],
           "qwen3_moe": [(1, 1, 1), (2, 1, 1), (2, 1, 2), (2, 2, 2)]}
"""(tp, pp, ep) per family; the first is the reference."""
CASES = [(f, layout) for f, layouts in LAYOUTS.items() for layout in layouts]
OTHERS = [(f, layout) for f, layouts in LAYOUTS.items() for layout in layouts[1:]]


def _id(case: tuple[str, tuple[int, int, int]]) -> str:
    family, (tp, pp, ep) = case
    return f"{family}-tp{tp}pp{pp}" + (f"ep{ep}" if family == "qwen3_moe" else "")


def build_checkpoint(path: Path, family: str = "qwen2") -> dict[str, torch.Tensor]:
    from gyre_megatron import testing

    return testing.build_checkpoint(path, tied=False, seed=21, family=family)


def _microsteps() -> list:
    from gyre_megatron.testing import make_microsteps

    return make_microsteps(4, rows=2, seq_len=20, vocab=160, seed=3)


def _hf_state(parts: list[dict]) -> dict[str, np.ndarray]:
    return {k: v for part in parts for k, v in part.items()}


_measured: dict[str, tuple[dict, dict]] = {}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Per family (measured when a test first asks): per layout, the gradients and loss of one
    streamed batch, the export, one update."""
    def get(family: str) -> tuple[dict, dict]:
        if family not in _measured:
            _measured[family] = _measure(family, tmp_path_factory)
        return _measured[family]

    yield get
    _measured.clear()


def _measure(family: str, tmp_path_factory) -> tuple[dict, dict]:
    from gyre_megatron.export import publish
    from gyre_core.interfaces import PublicationOptions
    from gyre_megatron.hf_import import spec_from_hf_dir
    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.testing import feed_in_bursts, read_weights

    ckpt = tmp_path_factory.mktemp("ckpt")
    original = build_checkpoint(ckpt, family)
    spec = spec_from_hf_dir(ckpt)
    out: dict[tuple[int, int, int], dict] = {}
    for tp, pp, ep in LAYOUTS[family]:
        opts = RankOptions(cells=1, tp=tp, pp=pp, ep=ep, spec=spec, init_from=str(ckpt), normalise_by_tokens=False,
                           clip_grad=1e-3)
        with World(opts, n_queues=2) as w:
            core = w.ranks_of(0)
            ranks = {(i["stage"], i["tp_rank"]): i["rank"] for i in w.info}
            assert all(i["device"] == "cpu" and i["node"] == socket.gethostname() for i in w.info)
            exported = publish(w, PublicationOptions(folder=str(tmp_path_factory.mktemp(f"tp{tp}pp{pp}ep{ep}"))), version=0)
            tk = w.submit(core, "stream_grads_hf", 0)
            feed_in_bursts(w.queues[0], _microsteps(), burst=2, gap_s=0)
            streamed = w.wait(tk, 180)
            tk = w.submit(core, "run_step", 0, 1)
            feed_in_bursts(w.queues[1], _microsteps(), burst=4, gap_s=0)
            stepped = w.wait(tk, 180)
            after = _hf_state(w.call(core, "export_hf"))
        out[(tp, pp, ep)] = {
            "ranks": ranks,
            "grads": _hf_state([s["grads"] for s in streamed]),
            "loss": sum(s["objective"]["loss"] for s in streamed if "objective" in s),
            "objectives": sum("objective" in s for s in streamed),
            "export": read_weights(exported.location),
            "grad_norm": [s["grad_norm"] for s in stepped],
            "after": after,
        }
    return original, out


def test_ranks_are_laid_out_tensor_innermost(measured) -> None:
    _, out = measured("qwen2")
    assert out[(2, 2, 1)]["ranks"] == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}
    assert out[(2, 1, 1)]["ranks"] == {(0, 0): 0, (0, 1): 1}


@pytest.mark.parametrize("case", OTHERS, ids=_id)
def test_loss_and_gradients_equal_tp1(measured, case) -> None:
    family, layout = case
    _, out = measured(family)
    ref, got = out[(1, 1, 1)], out[layout]
    assert got["objectives"] == 1, "one rank (last stage, shard 0) reports the cell's objective"
    assert abs(got["loss"] - ref["loss"]) <= 1e-6 * max(1.0, abs(ref["loss"])), (got["loss"], ref["loss"])
    assert set(got["grads"]) == set(ref["grads"])
    scale = max(float(np.abs(g).max()) for g in ref["grads"].values())
    assert scale > 0
    worst = 0.0
    for k, g in ref["grads"].items():
        err = float(np.abs(got["grads"][k] - g).max())
        worst = max(worst, err / scale)
        assert err <= 1e-5 * scale, (k, err, scale)
    print(f"\n{_id(case)} vs tp1pp1: loss {got['loss']:.6g} vs {ref['loss']:.6g}, "
          f"max |Δgrad| / max |grad| {worst:.2e}")


@pytest.mark.parametrize("case", OTHERS, ids=_id)
def test_grad_norm_and_update_equal_tp1(measured, case) -> None:
    family, layout = case
    _, out = measured(family)
    ref, got = out[(1, 1, 1)], out[layout]
    norm = ref["grad_norm"][0]
    assert norm > 1e-3, "the test's clip (1e-3) must be active"
    assert all(abs(n - norm) <= 1e-5 * norm for n in got["grad_norm"]), (got["grad_norm"], norm)
    for k, v in ref["after"].items():
        assert float(np.abs(got["after"][k] - v).max()) <= 1e-6, k


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_export_of_the_sharded_import_gives_back_the_checkpoint(measured, case) -> None:
    family, layout = case
    original, out = measured(family)
    exported = out[layout]["export"]
    assert set(exported) == set(original)
    for k, v in original.items():
        assert torch.equal(exported[k], v), k


@pytest.mark.mooncake
def test_a_tp2_satellite_joins_and_the_update_equals_one_cell(measured, tmp_path) -> None:
    """Two cells of TP 2: the satellite pulls the core's weights shard by shard, both cells
    stream micro-steps, each shard's gradients are summed with its twin's; the update equals the
    single cell's on the same batch."""
    pytest.importorskip("mooncake.engine", reason="Mooncake (mooncake-transfer-engine-non-cuda + libibverbs1)")
    from gyre_megatron.hf_import import spec_from_hf_dir
    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.testing import feed_in_bursts

    original, out = measured("qwen2")
    ckpt = tmp_path / "ckpt"
    build_checkpoint(ckpt)
    spec = spec_from_hf_dir(ckpt)
    opts = RankOptions(cells=2, tp=2, pp=1, spec=spec, init_from=str(ckpt), normalise_by_tokens=False,
                       clip_grad=1e-3)
    micro = _microsteps()
    with World(opts, n_queues=3) as w:
        core, sat = w.ranks_of(0), w.ranks_of(1)
        assert (core, sat) == ((0, 1), (2, 3))
        w.call(core + sat, "save_state")
        for attempt in range(3):  # a loaded machine may let the core take every micro-step
            q = w.queues[attempt]
            tk_core = w.submit(core, "run_step", 0, attempt)
            q.put(micro[0])
            deadline = time.monotonic() + 30
            while q.unclaimed() > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            tk_sat = w.submit(sat, "run_step", 0, attempt)
            time.sleep(1.5)  # the satellite registers and pulls before the rest arrives
            feed_in_bursts(q, micro[1:], burst=1, gap_s=0.3)
            info = w.wait(tk_core, 180) + w.wait(tk_sat, 180)
            if all(i.get("m") == 2 for i in info):
                break
            w.call(core + sat, "restore_state")
        assert all(i.get("m") == 2 for i in info), info
        pulled = [i for i in info if i["cell"] == 1]
        assert all(i["joined"] and i["pull_bytes"] > 0 for i in pulled)
        assert sum(i["micro_steps"] for i in info if i["rank"] in (0, 2)) == len(micro)
        after_core = _hf_state(w.call(core, "export_hf"))
        sat_params = w.call(sat, "params_numpy")
        core_params = w.call(core, "params_numpy")
    norm = out[(1, 1, 1)]["grad_norm"][0]
    assert all(abs(i["grad_norm"] - norm) <= 1e-5 * norm for i in info if i["cell"] == 0)
    for k, v in out[(1, 1, 1)]["after"].items():
        assert float(np.abs(after_core[k] - v).max()) <= 1e-6, k
    for c, s in zip(core_params, sat_params):  # the new weights went to the satellite's shards
        assert all(np.array_equal(c[k], s[k]) for k in c)


def test_tied_embeddings_count_once_in_the_clipped_norm_at_pp2(tmp_path_factory) -> None:
    """Tied embeddings split over two stages: the first stage's embedding and the last stage's
    output copy both hold the summed gradient after the step; the norm that clipping acts on
    must count it once, exactly as a single stage does (an active clip, so the update shows it)."""
    from gyre_megatron.hf_import import spec_from_hf_dir
    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.testing import build_checkpoint, feed_in_bursts

    ckpt = tmp_path_factory.mktemp("tied")
    build_checkpoint(ckpt, tied=True, seed=23)
    spec = spec_from_hf_dir(ckpt)
    assert spec.tie_embeddings
    norms, after = {}, {}
    for pp in (1, 2):
        opts = RankOptions(cells=1, tp=1, pp=pp, spec=spec, init_from=str(ckpt), normalise_by_tokens=False,
                           clip_grad=1e-3)
        with World(opts, n_queues=1) as w:
            core = w.ranks_of(0)
            tk = w.submit(core, "run_step", 0, 0)
            feed_in_bursts(w.queues[0], _microsteps(), burst=4, gap_s=0)
            norms[pp] = [s["grad_norm"] for s in w.wait(tk, 180)]
            after[pp] = _hf_state(w.call(core, "export_hf"))
    ref = norms[1][0]
    assert ref > 1e-3, "the clip must be active"
    assert all(abs(n - ref) <= 1e-5 * ref for n in norms[2]), (norms, "the shared matrix counted twice?")
    for k, v in after[1].items():
        assert np.allclose(after[2][k], v, atol=1e-6, rtol=1e-5), k
